//! Rendezvous glue: the adapter that serves Gloo's store calls from
//! accel's [`Store`], and the choice of the address Gloo listens on.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::Mutex;
use std::time::Duration;

use accel_api::kit::Deadline;
use accel_api::{Error, ErrorKind, Store};

use crate::ffi::RendezvousStore;
use crate::name::NAME;

/// Serves Gloo's `set` / `get` / `wait` from an accel store, under a key
/// prefix unique to one communicator, and within one deadline for the whole
/// connection (Gloo's `get` has no timeout of its own).
pub(crate) struct StoreAdapter<'a> {
    store: &'a dyn Store,
    prefix: String,
    rank: usize,
    deadline: Deadline,
    error: Mutex<Option<Error>>,
}

impl<'a> StoreAdapter<'a> {
    pub(crate) fn new(
        store: &'a dyn Store,
        prefix: &str,
        rank: usize,
        timeout: Duration,
    ) -> StoreAdapter<'a> {
        StoreAdapter {
            store,
            prefix: prefix.to_string(),
            rank,
            deadline: Deadline::after(timeout),
            error: Mutex::new(None),
        }
    }

    /// The first error a callback hit, if any.
    pub(crate) fn take_error(&self) -> Option<Error> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn key(&self, k: &str) -> String {
        format!("{}/{}", self.prefix, k)
    }

    fn remaining(&self) -> Duration {
        remaining(&self.deadline)
    }

    fn record(&self, e: Error) {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(e);
    }

    /// Turn a store timeout on Gloo's keys into "rank N did not join".
    fn missing(&self, keys: &[String], e: Error) -> Error {
        if !matches!(e.kind(), ErrorKind::Timeout { .. }) {
            return e.with_op("connect").with_backend(NAME).with_rank(self.rank);
        }
        let mut ranks: Vec<usize> = keys
            .iter()
            .filter(|k| !matches!(self.store.try_get(&self.key(k)), Ok(Some(_))))
            .filter_map(|k| k.strip_prefix("rank_").unwrap_or(k).parse().ok())
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        let who = match ranks.as_slice() {
            [] => "some ranks".to_string(),
            [r] => format!("rank {r}"),
            rs => format!(
                "ranks {}",
                rs.iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        Error::timeout(
            "connect",
            self.deadline.timeout(),
            format!(
                "{who} did not join the Gloo rendezvous under `{}` on {} ({})",
                self.prefix,
                self.store.describe(),
                e.message()
            ),
        )
        .with_fix(format!(
            "start every rank with the same world size and store, and look at {who}'s log; or raise the timeout (ACCEL_TIMEOUT)"
        ))
        .with_backend(NAME)
        .with_rank(self.rank)
        .with_source(e)
    }
}

impl RendezvousStore for StoreAdapter<'_> {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), ()> {
        self.store
            .set(&self.key(key), value)
            .map_err(|e| self.record(e.with_op("connect").with_backend(NAME).with_rank(self.rank)))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>, ()> {
        self.store
            .get(&self.key(key), self.remaining())
            .map_err(|e| self.record(self.missing(&[key.to_string()], e)))
    }

    fn wait(&self, keys: &[String], timeout: Option<Duration>) -> Result<(), ()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        let t = match timeout {
            Some(t) => t.min(self.remaining()),
            None => self.remaining(),
        };
        self.store
            .wait(&refs, t)
            .map_err(|e| self.record(self.missing(keys, e)))
    }
}

/// Where the Gloo device listens, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bind {
    /// Host name or IP address (empty when `iface` is used or for Gloo's
    /// default).
    pub(crate) hostname: String,
    /// Network interface name (empty when unused).
    pub(crate) iface: String,
    /// Which setting decided it, for logs and errors.
    pub(crate) source: String,
}

/// Choose the listening address. First match wins:
///
/// 1. `ACCEL_GLOO_HOSTNAME`: a host name or IP address of this machine.
/// 2. `ACCEL_GLOO_IFNAME`: a network interface name (first address).
/// 3. `GLOO_SOCKET_IFNAME`: PyTorch's variable; with a comma-separated list
///    the first interface is used.
/// 4. The store's host: an in-process store or a store on a loopback
///    address means a one-machine run, so `127.0.0.1`; a store on another
///    host means this machine's address on the route to that host.
/// 5. Gloo's default: this machine's host name, resolved.
pub(crate) fn choose_bind(store_describe: &str, env: &dyn Fn(&str) -> Option<String>) -> Bind {
    let var = |name: &str| {
        env(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    if let Some(h) = var("ACCEL_GLOO_HOSTNAME") {
        return Bind {
            hostname: h,
            iface: String::new(),
            source: "ACCEL_GLOO_HOSTNAME".into(),
        };
    }
    for name in ["ACCEL_GLOO_IFNAME", "GLOO_SOCKET_IFNAME"] {
        if let Some(i) = var(name) {
            let first = i.split(',').map(str::trim).find(|s| !s.is_empty());
            if let Some(first) = first {
                return Bind {
                    hostname: String::new(),
                    iface: first.to_string(),
                    source: name.into(),
                };
            }
        }
    }
    match store_host(store_describe) {
        StoreHost::InProcess => Bind {
            hostname: Ipv4Addr::LOCALHOST.to_string(),
            iface: String::new(),
            source: format!("in-process store ({store_describe})"),
        },
        StoreHost::Remote(host, port) => match local_ip_towards(&host, port) {
            Some(ip) => Bind {
                hostname: ip.to_string(),
                iface: String::new(),
                source: format!("route to the store host {host}"),
            },
            None => gloo_default(store_describe),
        },
        StoreHost::Unknown => gloo_default(store_describe),
    }
}

fn gloo_default(store_describe: &str) -> Bind {
    Bind {
        hostname: String::new(),
        iface: String::new(),
        source: format!("this machine's host name (store: {store_describe})"),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum StoreHost {
    InProcess,
    Remote(String, u16),
    Unknown,
}

/// Read the host out of a store description (`tcp://10.0.0.1:29500`,
/// `memory store`, `file:///tmp/x`).
fn store_host(describe: &str) -> StoreHost {
    let d = describe.trim();
    if d.to_ascii_lowercase().starts_with("memory") {
        return StoreHost::InProcess;
    }
    let Some((_, rest)) = d.split_once("://") else {
        return StoreHost::Unknown;
    };
    let authority = rest.split(['/', ' ', '?', '#']).next().unwrap_or("");
    let authority = authority.rsplit('@').next().unwrap_or("");
    // A cluster's members (`etcd://h1:2379,h2:2379/...`): the first one's
    // route is this machine's address towards all of them.
    let authority = authority.split(',').next().unwrap_or("");
    if authority.is_empty() {
        return StoreHost::Unknown;
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        match v6.split_once(']') {
            Some((h, tail)) => (h.to_string(), tail.strip_prefix(':').unwrap_or("")),
            None => return StoreHost::Unknown,
        }
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h.to_string(), p),
            _ => (authority.to_string(), ""),
        }
    };
    let port = port.parse().unwrap_or(1);
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if loopback {
        StoreHost::InProcess
    } else {
        StoreHost::Remote(host, port)
    }
}

/// This machine's address on the route to `host` (a UDP "connect" sends
/// nothing; it only asks the kernel which source address it would use).
fn local_ip_towards(host: &str, port: u16) -> Option<IpAddr> {
    let target: SocketAddr = (host, port.max(1)).to_socket_addrs().ok()?.next()?;
    let bind: SocketAddr = if target.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = UdpSocket::bind(bind).ok()?;
    sock.connect(target).ok()?;
    let ip = sock.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// What is left of a call's `deadline` for its next Gloo call: at least
/// 1 ms (Gloo reads zero as "no timeout"). The store exchange and the
/// engine's calls both use it.
pub(crate) fn remaining(deadline: &Deadline) -> Duration {
    deadline.remaining().max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn store_hosts_are_parsed() {
        assert_eq!(store_host("memory store"), StoreHost::InProcess);
        assert_eq!(store_host("tcp://127.0.0.1:29500"), StoreHost::InProcess);
        assert_eq!(store_host("tcp://localhost:1"), StoreHost::InProcess);
        assert_eq!(store_host("tcp://[::1]:1"), StoreHost::InProcess);
        assert_eq!(
            store_host("tcp://10.1.2.3:29500"),
            StoreHost::Remote("10.1.2.3".into(), 29500)
        );
        assert_eq!(
            store_host("tcp://tok@node7:9/x"),
            StoreHost::Remote("node7".into(), 9)
        );
        assert_eq!(
            store_host("etcd://10.1.2.3:2379,10.1.2.4:2379/accel/run"),
            StoreHost::Remote("10.1.2.3".into(), 2379)
        );
        assert_eq!(
            store_host("etcd://127.0.0.1:2379,127.0.0.1:2381/accel/run"),
            StoreHost::InProcess
        );
        assert_eq!(store_host("file:///tmp/store"), StoreHost::Unknown);
        assert_eq!(store_host("something else"), StoreHost::Unknown);
    }

    #[test]
    fn explicit_settings_win_in_order() {
        let env = |k: &str| match k {
            "ACCEL_GLOO_HOSTNAME" => Some("10.0.0.5".to_string()),
            "ACCEL_GLOO_IFNAME" => Some("eth1".to_string()),
            "GLOO_SOCKET_IFNAME" => Some("eth0,eth2".to_string()),
            _ => None,
        };
        let b = choose_bind("memory store", &env);
        assert_eq!(b.hostname, "10.0.0.5");
        assert!(b.iface.is_empty());

        let env = |k: &str| match k {
            "ACCEL_GLOO_IFNAME" => Some("eth1".to_string()),
            "GLOO_SOCKET_IFNAME" => Some("eth0".to_string()),
            _ => None,
        };
        assert_eq!(choose_bind("memory store", &env).iface, "eth1");

        let env = |k: &str| (k == "GLOO_SOCKET_IFNAME").then(|| " eth0 , eth2".to_string());
        let b = choose_bind("memory store", &env);
        assert_eq!(b.iface, "eth0");
        assert_eq!(b.source, "GLOO_SOCKET_IFNAME");
    }

    #[test]
    fn loopback_stores_bind_loopback() {
        assert_eq!(choose_bind("memory store", &no_env).hostname, "127.0.0.1");
        assert_eq!(
            choose_bind("tcp://127.0.0.1:5", &no_env).hostname,
            "127.0.0.1"
        );
        let b = choose_bind("file:///x", &no_env);
        assert!(b.hostname.is_empty() && b.iface.is_empty());
    }
}
