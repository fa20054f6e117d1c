//! Machines as network namespaces for the launcher's tests: each has its own
//! address (10.231.7.x) and its traffic stays inside them. Needs root and
//! `ip netns`; `create` says why not otherwise.

use std::process::Command;

/// Two namespaces joined by a veth pair, removed on drop.
pub struct Netns {
    pub names: [String; 2],
}

impl Netns {
    pub fn ip(args: &[&str]) -> Result<(), String> {
        let o = Command::new("ip")
            .args(args)
            .output()
            .map_err(|e| format!("ip: {e}"))?;
        if o.status.success() {
            Ok(())
        } else {
            Err(format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
    }

    pub fn create() -> Result<Netns, String> {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let euid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|v| v.split_whitespace().nth(1))
            .unwrap_or("?");
        if euid != "0" {
            return Err("not root".into());
        }
        let tag = std::process::id() % 100_000;
        let n = Netns {
            names: [format!("accel{tag}a"), format!("accel{tag}b")],
        };
        let [a, b] = &n.names;
        let (va, vb) = (format!("va{tag}"), format!("vb{tag}"));
        Netns::ip(&["netns", "add", a])?;
        Netns::ip(&["netns", "add", b])?;
        Netns::ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        Netns::ip(&["link", "set", &va, "netns", a])?;
        Netns::ip(&["link", "set", &vb, "netns", b])?;
        for (ns, dev, addr) in [(a, &va, "10.231.7.1/24"), (b, &vb, "10.231.7.2/24")] {
            Netns::ip(&["-n", ns, "addr", "add", addr, "dev", dev])?;
            Netns::ip(&["-n", ns, "link", "set", dev, "up"])?;
            Netns::ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(n)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Netns::ip(&["netns", "del", n]);
        }
    }
}
