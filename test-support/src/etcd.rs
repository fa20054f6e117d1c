//! A real etcd cluster for tests: `n` members of Debian's `etcd` (installed
//! by the Makefile's setup), each with its own data directory, on loopback
//! with free ports ([`EtcdCluster::start`]) or each on a host of its own,
//! such as a network namespace ([`EtcdCluster::start_on`]); killed and
//! restarted one by one, all stopped on drop. Both skip (a failure under
//! `make test`) when `etcd` is not installed.

use crate::free_port;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where a member runs: its address, and the command that runs a program
/// there (empty: here; `["ip", "netns", "exec", NS]` in a namespace).
#[derive(Debug, Clone)]
pub struct Host {
    /// The member's address.
    pub addr: String,
    /// The prefix of its command line.
    pub prefix: Vec<String>,
}

/// One member: its name, host, ports and process (none while killed).
#[derive(Debug)]
struct Member {
    name: String,
    host: Host,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// A running etcd cluster of loopback members.
#[derive(Debug)]
pub struct EtcdCluster {
    dir: PathBuf,
    members: Vec<Member>,
    /// The members' TLS files for clients (certificate, key, CA), if any.
    tls: Option<[PathBuf; 3]>,
}

/// The `etcd` binary, when installed.
pub fn etcd_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

impl EtcdCluster {
    /// Start `n` members and wait (up to 30 s) until each answers its
    /// health check. `None` after a skip when `etcd` is not installed.
    ///
    /// # Panics
    /// When a member does not come up in time.
    pub fn start(n: usize) -> Option<EtcdCluster> {
        let loopback = Host {
            addr: "127.0.0.1".into(),
            prefix: Vec::new(),
        };
        let members = (0..n).map(|_| (loopback.clone(), free_port(), free_port()));
        Self::start_members(members.collect(), None)
    }

    /// One member on each of `hosts` (ports 2379 and 2380 on each), and
    /// wait (up to 30 s) until every member serves and one leads. `None`
    /// after a skip when `etcd` is not installed.
    ///
    /// # Panics
    /// When a member does not come up in time.
    pub fn start_on(hosts: Vec<Host>) -> Option<EtcdCluster> {
        Self::start_members(hosts.into_iter().map(|h| (h, 2379, 2380)).collect(), None)
    }

    fn start_members(
        spec: Vec<(Host, u16, u16)>,
        tls: Option<[PathBuf; 3]>,
    ) -> Option<EtcdCluster> {
        let Some(bin) = etcd_binary() else {
            crate::skips::skip(
                "no `etcd` binary (Debian's etcd-server; the Makefile's setup installs it)",
            );
            return None;
        };
        let dir =
            std::env::temp_dir().join(format!("accel-etcd-{}-{}", std::process::id(), free_port()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the cluster's folder");
        let members: Vec<Member> = spec
            .into_iter()
            .enumerate()
            .map(|(i, (host, client, peer))| Member {
                name: format!("m{i}"),
                host,
                client,
                peer,
                child: None,
            })
            .collect();
        let mut c = EtcdCluster { dir, members, tls };
        c.start_all(&bin);
        Some(c)
    }

    /// One loopback member serving clients over TLS only, with the
    /// certificate `cert` and key `key` and checking every client's
    /// certificate against `ca` (etcd's `--client-cert-auth`). `None`
    /// after a skip when `etcd` is not installed.
    ///
    /// # Panics
    /// When the member does not come up in time.
    pub fn start_tls(cert: &Path, key: &Path, ca: &Path) -> Option<EtcdCluster> {
        let loopback = Host {
            addr: "127.0.0.1".into(),
            prefix: Vec::new(),
        };
        let tls = [cert.into(), key.into(), ca.into()];
        Self::start_members(vec![(loopback, free_port(), free_port())], Some(tls))
    }

    fn start_all(&mut self, bin: &PathBuf) {
        let c = self;
        let n = c.members.len();
        for i in 0..n {
            c.spawn(bin, i, true);
        }
        c.wait_healthy();
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://{}:{}", m.name, m.host.addr, m.peer))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, bin: &PathBuf, i: usize, new: bool) {
        let initial = self.initial_cluster();
        let log = std::fs::File::create(self.dir.join(format!("m{i}.log"))).expect("a log file");
        let m = &mut self.members[i];
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://{}:{}", m.host.addr, m.client);
        let peer = format!("http://{}:{}", m.host.addr, m.peer);
        // Killed with this test's thread, even by SIGKILL: no member outlives it.
        let mut line: Vec<std::ffi::OsString> = m.host.prefix.iter().map(Into::into).collect();
        if Path::new("/usr/bin/setpriv").is_file() {
            line.extend(["/usr/bin/setpriv", "--pdeathsig", "KILL", "--"].map(Into::into));
        }
        line.push(bin.into());
        let mut cmd = Command::new(&line[0]);
        cmd.args(&line[1..]);
        let child = cmd
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(self.dir.join(&m.name))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial])
            .args([
                "--initial-cluster-state",
                if new { "new" } else { "existing" },
            ])
            .args(["--initial-cluster-token", "accel-test"])
            // Fast elections: a lost leader is replaced within a second.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(self.tls.iter().flat_map(|[cert, key, ca]| {
                [
                    "--cert-file".into(),
                    cert.clone().into_os_string(),
                    "--key-file".into(),
                    key.clone().into_os_string(),
                    "--trusted-ca-file".into(),
                    ca.clone().into_os_string(),
                    "--client-cert-auth".into(),
                ]
            }))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd starts");
        m.child = Some(child);
    }

    fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            while !self.serves(m) {
                assert!(
                    Instant::now() < deadline,
                    "etcd member {} did not answer within 30 s (log: {})",
                    m.name,
                    self.dir.join(format!("{}.log", m.name)).display()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// `true` when member `m` serves with a leader behind it: asked over
    /// HTTP here, or, in a host of its own (unreachable from here) or
    /// behind TLS, read from its log.
    fn serves(&self, m: &Member) -> bool {
        if m.host.prefix.is_empty() && self.tls.is_none() {
            return healthy(&format!("{}:{}", m.host.addr, m.client));
        }
        let log = std::fs::read_to_string(self.dir.join(format!("{}.log", m.name)));
        log.is_ok_and(|l| {
            l.contains("ready to serve client requests") && l.contains("elected leader")
        })
    }

    /// Each member's client endpoint, `host:port`.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("{}:{}", m.host.addr, m.client))
            .collect()
    }

    /// The endpoints joined by commas (`--rdzv-endpoint`'s form).
    pub fn endpoint_list(&self) -> String {
        self.endpoints().join(",")
    }

    /// SIGKILL member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start member `i` again on its data (after [`kill`](Self::kill)), and
    /// wait until the members that run are healthy.
    pub fn restart(&mut self, i: usize) {
        let bin = etcd_binary().expect("etcd was there at start");
        self.spawn(&bin, i, false);
        self.wait_healthy();
    }
}

/// `true` when the member at `host:port` says it is healthy (a quorum
/// behind it).
fn healthy(addr: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let req = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.contains("\"health\":\"true\"")
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
