//! Machines as network namespaces for the launcher's tests: a [`Cluster`]
//! of N machines, each a namespace with its own address (10.231.7.1,
//! .2, ...) on one bridge, with faults to inject (a cut link, a killed or
//! frozen machine). The bridge lives in a namespace of its own, so the
//! root namespace gets no interface and test traffic stays inside the
//! cluster. Needs root and `ip netns` (iproute2); `create` says why not
//! otherwise.
//!
//! Names are unique per cluster (`accel{pid}c{n}m{i}`), so tests running in
//! parallel do not clash; the same addresses are reused by every cluster,
//! each on its own bridge. Dropping a cluster (also while a test panics)
//! kills every process left in its namespaces and removes them; a cluster
//! left by a test process that was itself killed is removed by the next
//! `create`.

use std::process::Command;

use nix::sys::signal::Signal::{self, SIGCONT, SIGKILL, SIGSTOP};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// `ip ARGS...`, with its stderr in the error.
pub fn ip(args: &[&str]) -> Result<String, String> {
    let o = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e} (install iproute2)"))?;
    if o.status.success() {
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1))
        == Some("0")
}

/// The prefix of every namespace the clusters of this process create.
fn prefix(pid: u32) -> String {
    format!("accel{pid}c")
}

/// Remove the namespaces of clusters whose test process is gone.
fn sweep_orphans() {
    let Ok(list) = ip(&["netns", "list"]) else {
        return;
    };
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(pid) = name
            .strip_prefix("accel")
            .and_then(|r| r.split_once('c'))
            .and_then(|(p, _)| p.parse::<u32>().ok())
        else {
            continue;
        };
        if name.starts_with(&prefix(pid)) && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        {
            kill_in(name, SIGKILL);
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// The processes in namespace `ns`.
fn pids_in_ns(ns: &str) -> Vec<u32> {
    ip(&["netns", "pids", ns])
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn kill(pid: u32, sig: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
    }
}

fn kill_in(ns: &str, sig: Signal) {
    for p in pids_in_ns(ns) {
        kill(p, sig);
    }
}

/// One machine of a [`Cluster`].
#[derive(Debug, Clone)]
pub struct Machine {
    /// Its network namespace.
    pub ns: String,
    /// Its address on the bridge.
    pub addr: String,
    /// Its link's name on the bridge's side (in the bridge's namespace).
    port: String,
}

/// N namespaces on one bridge, removed on drop.
#[derive(Debug)]
pub struct Cluster {
    pub machines: Vec<Machine>,
    switch: String,
}

impl Cluster {
    /// `n` machines (at most 200): machine `i` at 10.231.7.{i+1}/24.
    pub fn create(n: usize) -> Result<Cluster, String> {
        if !is_root() {
            return Err("not root".into());
        }
        assert!((1..=200).contains(&n), "1..=200 machines");
        ip(&["-V"])?;
        sweep_orphans();
        static SERIAL: AtomicU32 = AtomicU32::new(0);
        let pid = std::process::id();
        let tag = format!("{}{}", prefix(pid), SERIAL.fetch_add(1, Ordering::SeqCst));
        let mut c = Cluster {
            machines: Vec::new(),
            switch: format!("{tag}sw"),
        };
        // From here on, a failure drops `c`, which removes what was made.
        ip(&["netns", "add", &c.switch])?;
        ip(&["-n", &c.switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &c.switch, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let m = Machine {
                ns: format!("{tag}m{i}"),
                addr: format!("10.231.7.{}", i + 1),
                port: format!("m{i}"),
            };
            ip(&["netns", "add", &m.ns])?;
            c.machines.push(m.clone());
            // Both ends are made inside their namespaces: the root
            // namespace never sees them, and names cannot clash.
            ip(&[
                "link", "add", "eth0", "netns", &m.ns, "type", "veth", "peer", "name", &m.port,
                "netns", &c.switch,
            ])?;
            ip(&["-n", &c.switch, "link", "set", &m.port, "master", "br0"])?;
            ip(&["-n", &c.switch, "link", "set", &m.port, "up"])?;
            let cidr = format!("{}/24", m.addr);
            ip(&["-n", &m.ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", &m.ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &m.ns, "link", "set", "lo", "up"])?;
        }
        Ok(c)
    }

    /// [`Cluster::create`], or `None` after printing why the test `name`
    /// skips. Under make test and CI (root, iproute2 from `make setup`) that
    /// is a failure.
    pub fn or_skip(n: usize, name: &str) -> Option<Cluster> {
        match Cluster::create(n) {
            Ok(c) => Some(c),
            Err(why) => {
                accel_test_support::skips::skip_needs_root(&format!("{name}: {why}"));
                None
            }
        }
    }

    /// Machine `i`'s address.
    pub fn addr(&self, i: usize) -> &str {
        &self.machines[i].addr
    }

    /// `program ARGS...` on machine `i` (`ip netns exec` execs it: the
    /// child's pid is the program's).
    pub fn command(&self, i: usize, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.machines[i].ns, program])
            .args(args);
        c
    }

    /// Cut machine `i`'s link in both directions, as a pulled cable: its
    /// port on the bridge goes down, packets are dropped without a reset.
    pub fn cut(&self, i: usize) {
        let m = &self.machines[i];
        ip(&["-n", &self.switch, "link", "set", &m.port, "down"]).expect("cut the link");
    }

    /// Reconnect machine `i`'s link.
    pub fn reconnect(&self, i: usize) {
        let m = &self.machines[i];
        ip(&["-n", &self.switch, "link", "set", &m.port, "up"]).expect("reconnect the link");
    }

    /// The processes running on machine `i`.
    pub fn pids(&self, i: usize) -> Vec<u32> {
        pids_in_ns(&self.machines[i].ns)
    }

    /// Freeze every process of machine `i` (SIGSTOP), as a machine that
    /// stopped answering without closing a connection.
    pub fn freeze(&self, i: usize) {
        kill_in(&self.machines[i].ns, SIGSTOP);
    }

    /// Let machine `i`'s processes run again.
    pub fn thaw(&self, i: usize) {
        kill_in(&self.machines[i].ns, SIGCONT);
    }

    /// SIGKILL process `pid` (a machine's launcher: its workers die with it).
    pub fn sigkill(pid: u32) {
        kill(pid, SIGKILL);
    }

    /// Wait up to `limit` until no process is left on any machine; the
    /// pids left (with their command lines) otherwise.
    pub fn wait_empty(&self, limit: Duration) -> Result<(), String> {
        let end = std::time::Instant::now() + limit;
        loop {
            let left: Vec<String> = (0..self.machines.len())
                .flat_map(|i| {
                    self.pids(i).into_iter().map(move |p| {
                        let cmd = std::fs::read(format!("/proc/{p}/cmdline"))
                            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                            .unwrap_or_default();
                        format!("machine {i}: pid {p} {cmd}")
                    })
                })
                .collect();
            if left.is_empty() {
                return Ok(());
            }
            if std::time::Instant::now() > end {
                return Err(left.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for m in &self.machines {
            // A frozen process cannot die of SIGKILL until it runs again.
            kill_in(&m.ns, SIGKILL);
            kill_in(&m.ns, SIGCONT);
        }
        for m in &self.machines {
            let _ = ip(&["netns", "del", &m.ns]);
        }
        let _ = ip(&["netns", "del", &self.switch]);
    }
}

/// Two machines (10.231.7.1 and .2): the names of their namespaces.
pub struct Netns {
    pub names: [String; 2],
    _cluster: Cluster,
}

impl Netns {
    pub fn create() -> Result<Netns, String> {
        let c = Cluster::create(2)?;
        Ok(Netns {
            names: [c.machines[0].ns.clone(), c.machines[1].ns.clone()],
            _cluster: c,
        })
    }
}
