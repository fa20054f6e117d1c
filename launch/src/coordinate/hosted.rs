//! [`HostedStore`]: the coordination of a run on one machine, or of an
//! mpirun started from machine 0.

use std::path::PathBuf;
use std::sync::mpsc::Sender;

use accel_api::worker::WorkerEnv;
use accel_api::Result;
use accel_rendezvous::{TcpStoreServer, TorchStoreServer};

use super::{host_name, read_stall, Coordinator};
use crate::event::Event;
use crate::group::Attempt;
use crate::output::say;
use crate::report;

/// The coordination of a run on one machine (or of an mpirun started from
/// machine 0): this launcher hosts the store, a fresh one per attempt
/// unless `per_run` (several machines reach one address).
#[derive(Debug)]
pub struct HostedStore {
    /// Where the stores bind and the workers dial them.
    pub addr: String,
    /// MASTER_PORT (0: a free one): the torch-protocol endpoint torch
    /// workers join (TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun).
    /// accel's own store, with the token, listens on a free port
    /// (ACCEL_STORE_URL).
    pub port: u16,
    /// Bind exactly (several machines were told the port).
    pub per_run: bool,
    /// The store's token.
    pub token: String,
    /// What every worker of every attempt shares (run id, timeout, ...);
    /// store fields and the restart count are filled in per attempt.
    pub base: WorkerEnv,
    /// Where error-file directories go.
    pub scratch: PathBuf,
    /// Host name for reports.
    pub host: String,
    /// Restarts allowed.
    pub max_restarts: u32,
    /// Say the store's notices (a busy port avoided).
    pub echo: bool,
    server: Option<TcpStoreServer>,
    torch: Option<TorchStoreServer>,
    url: String,
}

impl HostedStore {
    /// A coordinator hosting the store at `addr:port` with `token`.
    pub fn new(addr: &str, port: u16, per_run: bool, token: &str, base: WorkerEnv) -> Self {
        HostedStore {
            addr: addr.to_string(),
            port,
            per_run,
            token: token.to_string(),
            base,
            scratch: std::env::temp_dir(),
            host: host_name(),
            max_restarts: 0,
            echo: true,
            server: None,
            torch: None,
            url: String::new(),
        }
    }
}

impl Coordinator for HostedStore {
    fn begin(&mut self, n: u32, _tx: &Sender<Event>) -> Result<Attempt> {
        if !self.per_run || self.server.is_none() {
            // A fresh store per attempt: no key of a failed attempt can
            // confuse the next one.
            self.server = None;
            self.torch = None;
            // Across machines (mpirun) the given port is accel's store's,
            // which the other machines were told; on one machine it is the
            // torch endpoint's, and accel's store takes a free port.
            let accel_port = if self.per_run { self.port } else { 0 };
            let (server, notice) =
                crate::store::host(&self.addr, accel_port, self.per_run, &self.token)?;
            let notice = if self.per_run {
                notice
            } else {
                let (torch, notice) = crate::store::host_torch(&self.addr, self.port, false)?;
                self.torch = Some(torch);
                notice
            };
            if let Some(msg) = notice.filter(|_| n == 0 && self.echo) {
                say(&msg);
            }
            self.server = Some(server);
        }
        let accel_port = self.server.as_ref().map_or(0, |s| s.local_addr().port());
        let port = self
            .torch
            .as_ref()
            .map_or(accel_port, |s| s.local_addr().port());
        self.url = accel_api::worker::tcp_url(&self.addr, accel_port);
        let mut env = self.base.clone();
        env.master_addr = Some(
            self.addr
                .trim_start_matches('[')
                .trim_end_matches(']')
                .into(),
        );
        env.master_port = Some(port);
        env.store_url = Some(self.url.clone());
        env.agent_store = self.torch.is_some().then_some(true);
        env.token = Some(self.token.clone());
        env.restart_count = Some(n);
        env.max_restarts = Some(self.max_restarts);
        Ok(Attempt {
            number: n,
            env,
            rank_offset: 0,
            error_dir: self.scratch.join(format!("attempt-{n}")),
            host: self.host.clone(),
        })
    }

    fn max_restarts(&self) -> u32 {
        self.max_restarts
    }

    fn end(&mut self, _last: u32) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        if let Some(t) = self.torch.take() {
            t.shutdown();
        }
    }

    fn store_url(&self) -> String {
        self.url.clone()
    }

    /// Reads the verdict from the hosted store.
    fn stall(&self, attempt: &Attempt) -> Option<report::Stall> {
        read_stall(self.server.as_ref()?.store().clone(), attempt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn hosted_store_urls_bracket_ipv6_and_fill_the_attempt() {
        let (tx, _rx) = channel();
        let mut c = HostedStore::new("127.0.0.1", 0, false, "tok", WorkerEnv::default());
        c.echo = false;
        let a = c.begin(3, &tx).unwrap();
        assert!(c.store_url().starts_with("tcp://127.0.0.1:"));
        assert_eq!(a.env.store_url.as_deref(), Some(c.store_url().as_str()));
        assert_eq!(
            (a.env.restart_count, a.env.token.as_deref()),
            (Some(3), Some("tok"))
        );
        c.end(3);
        // IPv6, where this machine has a loopback for it.
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            let mut c = HostedStore::new("::1", 0, false, "tok", WorkerEnv::default());
            c.echo = false;
            let a = c.begin(0, &tx).unwrap();
            assert!(
                c.store_url().starts_with("tcp://[::1]:"),
                "{}",
                c.store_url()
            );
            assert_eq!(a.env.master_addr.as_deref(), Some("::1"));
            c.end(0);
        }
    }
}
