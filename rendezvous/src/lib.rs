//! # accel-rendezvous: the stores every rank bootstraps from
//!
//! Implementations of [`accel_api::Store`], the key-value store through
//! which the ranks of a run find each other (addresses, engine unique ids,
//! barriers) before any collective engine is up.
//!
//! | store | URL ([`open_store`]) | use |
//! |---|---|---|
//! | [`TcpStore`] / [`TcpStoreServer`] | `tcp://host:port` | the default: the launcher (or rank 0) hosts the server, every rank connects; authenticated with the run token |
//! | [`FileStore`] | `file:///abs/dir` | a shared directory (local tmp, NFS) when no TCP server can be hosted |
//! | `EtcdStore` (feature `etcd`) | `etcd://host1:2379,host2:2379/namespace` | an etcd v3 cluster: no machine of the run hosts the store, so any may die |
//! | [`MemoryStore`] | `memory:` | one process: threads as ranks, tests; also the state behind the TCP server |
//! | [`PrefixStore`] | — | any store seen under a key prefix, so that independent users never collide |
//!
//! ```
//! use std::time::Duration;
//! use accel_api::{Store, StoreExt};
//! use accel_rendezvous::{open_store, TcpStoreServer};
//!
//! # fn main() -> accel_api::Result<()> {
//! // The launcher binds first (port 0: a free port) and hosts the store...
//! let server = TcpStoreServer::bind_loopback(0, Some("run-token".into()))?;
//! // ...and every rank opens it from the URL and token it was given.
//! let store = open_store(&server.url(), Some("run-token"), Duration::from_secs(30))?;
//! store.set("rank0/addr", b"10.0.0.1:4000")?;
//! assert_eq!(store.get_string("rank0/addr", Duration::from_secs(1))?, "10.0.0.1:4000");
//! # Ok(())
//! # }
//! ```
//!
//! Every blocking call is bounded: `get` and `wait` by their timeout, every
//! other call by the store's own bound (the TCP client's connect timeout,
//! the file store's lock timeout). A store whose server went away fails
//! each call within that bound with an error naming the server, never hangs.
//!
//! The behaviour every store shares is a set of scenarios, module `testkit`
//! (feature `testkit`): another store's tests stamp them with
//! `store_scenarios!`, as this crate's stores do.
//!
//! ## The TCP protocol
//!
//! Each message is a frame: a `u32` little-endian payload length, then the
//! payload, at most 1 GiB (64 KiB for the first frame, before the client is
//! authenticated); larger frames are refused without being read. A payload
//! is an opcode byte followed by fields: little-endian integers, strings and
//! byte strings as a `u32` length plus bytes, optional fields as a presence
//! byte plus the field, lists as a `u32` count plus items, timeouts as `u64`
//! milliseconds.
//!
//! | request | fields | reply |
//! |---|---|---|
//! | `0x01` hello | magic `ACCELRDV`, version `u16`, token `opt<str>` | ok, refused(`str`), version mismatch(`u16`) |
//! | `0x02` set | key, value | ok |
//! | `0x03` get | key, timeout | value(`bytes`) or timeout(missing keys) |
//! | `0x04` try_get | key | maybe(`opt<bytes>`) |
//! | `0x05` add | key, delta `i64` | int(`i64`) |
//! | `0x06` compare_set | key, expected `opt<bytes>`, desired | swapped, or maybe(current) |
//! | `0x07` wait | keys, timeout | ok or timeout(missing keys) |
//! | `0x08` delete | key | bool |
//!
//! Any request can also be answered with error(kind, message). The first
//! frame of every connection must be a hello; when the server has a token
//! and the hello's differs (compared in constant time) or is missing, the
//! server answers *refused*, logs a warning naming the peer, and closes the
//! connection. A connection carries one request at a time; the server
//! answers a `get` or `wait` when its keys are set or its timeout passed,
//! so no request holds a connection forever.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "etcd")]
mod etcd;
mod file;
mod memory;
mod prefix;
mod tcp;
mod torch;

#[cfg(test)]
mod test_util;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

use std::sync::Arc;
use std::time::Duration;

use accel_api::{Error, Result, Store};

#[cfg(feature = "etcd")]
pub use etcd::{EtcdAuth, EtcdStore, ETCD_ENV};
pub use file::FileStore;
pub use memory::MemoryStore;
pub use prefix::PrefixStore;
pub use tcp::{ServerLimits, TcpStore, TcpStoreServer};
pub use torch::{TorchServerLimits, TorchStore, TorchStoreServer};

const URL_FORMS: &str = "expected tcp://host:port, torch://host:port, \
     etcd://host:port[,host:port...][/namespace], file:///absolute/dir or memory:";

/// Open the store a URL names.
///
/// * `tcp://host:port` (IPv6 as `tcp://[::1]:29500`): [`TcpStore::connect`]
///   with `token` and `timeout`;
/// * `torch://host:port`: [`TorchStore::connect`], a store speaking torch's
///   TCPStore protocol (torchrun's agent store, a torch rank 0); no token;
/// * `file:///absolute/dir`: [`FileStore::new`], with `timeout` as its lock
///   timeout (the directory's permissions are its only protection; `token`
///   is not used);
/// * `etcd://host1:2379,host2:2379/namespace`: an etcd v3 cluster (feature
///   `etcd`), keys under `namespace` (`accel` when none), TLS and
///   authentication from `ACCEL_ETCD_*` (`EtcdAuth::from_env`), `timeout`
///   as the bound of the connection and of every call that does not wait
///   for a key; `token` is not used;
/// * `memory:`: a fresh, empty [`MemoryStore`] (useful in tests only: it is
///   not shared with other processes).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig) naming
/// the URL when it is none of these; otherwise what the store's constructor
/// returns.
pub fn open_store(url: &str, token: Option<&str>, timeout: Duration) -> Result<Arc<dyn Store>> {
    Ok(match parse_store_url(url)? {
        StoreUrl::Tcp(addr) => Arc::new(TcpStore::connect(addr, token, timeout)?),
        StoreUrl::Torch(addr) => Arc::new(TorchStore::connect(addr, timeout)?),
        StoreUrl::File(path) => Arc::new(FileStore::new(path)?.with_lock_timeout(timeout)),
        StoreUrl::Memory => Arc::new(MemoryStore::new()),
        StoreUrl::Etcd {
            endpoints,
            namespace,
        } => open_etcd(&endpoints, namespace, timeout)?,
    })
}

#[cfg(feature = "etcd")]
fn open_etcd(endpoints: &[String], namespace: &str, timeout: Duration) -> Result<Arc<dyn Store>> {
    let auth = EtcdAuth::from_env()?;
    Ok(Arc::new(EtcdStore::connect(
        endpoints, namespace, &auth, timeout,
    )?))
}

#[cfg(not(feature = "etcd"))]
fn open_etcd(endpoints: &[String], namespace: &str, _timeout: Duration) -> Result<Arc<dyn Store>> {
    Err(Error::new(
        accel_api::ErrorKind::Unavailable,
        format!(
            "the store etcd://{}/{namespace} needs accel's etcd client, which this program was \
             built without",
            endpoints.join(",")
        ),
    )
    .with_op("store open")
    .with_fix("build the program with accel's `etcd` feature (features = [\"etcd\"])"))
}

/// Check a store URL's form (scheme, host, port range, absolute path)
/// without opening it: what [`open_store`] refuses before any connection.
///
/// # Errors
/// As [`open_store`]'s [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig)
/// errors.
pub fn check_store_url(url: &str) -> Result<()> {
    parse_store_url(url).map(|_| ())
}

/// A store URL, checked.
enum StoreUrl<'a> {
    /// `host:port` (IPv6 in brackets).
    Tcp(&'a str),
    /// The same, speaking torch's TCPStore protocol.
    Torch(&'a str),
    /// An absolute directory.
    File(&'a str),
    Memory,
    /// etcd endpoints (`host:port`) and the namespace.
    Etcd {
        endpoints: Vec<String>,
        namespace: &'a str,
    },
}

fn parse_store_url(url: &str) -> Result<StoreUrl<'_>> {
    let bad = |why: &str| Error::invalid_config("store URL", url, format!("{why}; {URL_FORMS}"));
    let (torch, rest) = match (url.strip_prefix("tcp://"), url.strip_prefix("torch://")) {
        (Some(r), _) => (false, Some(r)),
        (None, Some(r)) => (true, Some(r)),
        (None, None) => (false, None),
    };
    if let Some(rest) = rest {
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
            let (h, p) = v6
                .split_once(']')
                .ok_or_else(|| bad("unclosed `[` in the host"))?;
            (h, p.strip_prefix(':').unwrap_or(""))
        } else {
            rest.rsplit_once(':').unwrap_or((rest, ""))
        };
        if host.is_empty()
            || host.contains(['/', '[', ']'])
            || (host.contains(':') && !rest.starts_with('['))
        {
            return Err(bad("the host is missing or malformed"));
        }
        return match port.parse::<u16>() {
            Ok(p) if p != 0 && torch => Ok(StoreUrl::Torch(rest)),
            Ok(p) if p != 0 => Ok(StoreUrl::Tcp(rest)),
            _ => Err(bad("the port is missing or not in 1..=65535")),
        };
    }
    if let Some(path) = url.strip_prefix("file://") {
        if !path.starts_with('/') {
            return Err(bad(
                "the directory must be an absolute path (three slashes)",
            ));
        }
        return Ok(StoreUrl::File(path));
    }
    if let Some(rest) = url.strip_prefix("etcd://") {
        let (hosts, namespace) = rest.split_once('/').unwrap_or((rest, ""));
        let namespace = namespace.trim_end_matches('/');
        let mut endpoints = Vec::new();
        for h in hosts.split(',') {
            let (host, port) = h.rsplit_once(':').unwrap_or((h, ""));
            if host.is_empty() || !matches!(port.parse::<u16>(), Ok(p) if p != 0) {
                return Err(bad(&format!(
                    "etcd endpoint {h:?} is not host:port with a port in 1..=65535"
                )));
            }
            endpoints.push(h.to_string());
        }
        let namespace = if namespace.is_empty() {
            "accel"
        } else {
            namespace
        };
        return Ok(StoreUrl::Etcd {
            endpoints,
            namespace,
        });
    }
    if url == "memory:" || url == "memory://" {
        return Ok(StoreUrl::Memory);
    }
    Err(bad("unknown scheme"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store_scenarios;
    use crate::test_util::TempDir;
    use crate::testkit::Fixture;
    use accel_api::ErrorKind;

    const T: Duration = Duration::from_secs(5);

    mod memory_scenarios {
        use super::*;
        store_scenarios!(Fixture::new(Arc::new(MemoryStore::new()), ()));
    }

    mod prefix_scenarios {
        use super::*;
        store_scenarios!(Fixture::new(Arc::new(MemoryStore::new()), ()).prefixed("a"));
    }

    mod file_scenarios {
        use super::*;
        store_scenarios!({
            let dir = TempDir::new("scenario");
            Fixture::new(Arc::new(FileStore::new(dir.path()).unwrap()), dir)
        });
    }

    #[cfg(feature = "etcd")]
    mod etcd_scenarios {
        use super::*;
        use accel_test_support::etcd::EtcdCluster;
        // One member per test: each scenario on its own cluster.
        store_scenarios!(optional EtcdCluster::start(1).map(|c| {
            let url = format!("etcd://{}/scenario", c.endpoint_list());
            Fixture::new(open_store(&url, None, T).unwrap(), c)
        }));
    }

    #[test]
    fn open_store_understands_each_scheme() {
        let m = open_store("memory:", None, T).unwrap();
        m.set("k", b"v").unwrap();
        assert_eq!(m.describe(), "memory store");
        // Each `memory:` is a fresh store.
        assert_eq!(
            open_store("memory:", None, T)
                .unwrap()
                .try_get("k")
                .unwrap(),
            None
        );

        let dir = TempDir::new("open");
        let url = format!("file://{}", dir.path().display());
        let f = open_store(&url, None, T).unwrap();
        f.set("k", b"v").unwrap();
        assert_eq!(f.describe(), url);
        assert_eq!(
            open_store(&url, None, T).unwrap().try_get("k").unwrap(),
            Some(b"v".to_vec())
        );

        let s = TcpStoreServer::bind_loopback(0, Some("tok".into())).unwrap();
        let url = s.url();
        let t = open_store(&url, Some("tok"), T).unwrap();
        t.set("k", b"v").unwrap();
        assert_eq!(t.describe(), url);
        let e = match open_store(&url, Some("bad"), T) {
            Err(e) => e,
            Ok(_) => panic!("a wrong token must be refused"),
        };
        assert_eq!(e.kind(), &ErrorKind::Unauthorized);
        let v6 = format!("tcp://[::1]:{}", s.local_addr().port());
        // ::1 may be absent in containers; only the parse is checked here.
        if let Err(e) = open_store(&v6, Some("tok"), Duration::from_millis(50)) {
            assert!(!matches!(e.kind(), ErrorKind::InvalidConfig), "{e}");
        }
    }

    #[test]
    fn open_store_rejects_unknown_urls_naming_them() {
        for url in [
            "redis://h:1",
            "",
            "tcp://",
            "tcp://host",
            "tcp://host:0",
            "tcp://host:99999",
            "tcp://:29500",
            "tcp://::1:29500",
            "tcp://[::1",
            "tcp://h:1/path",
            "file://relative/dir",
            "file:relative",
            "memory:extra",
            "etcd://",
            "etcd://host",
            "etcd://h:1,,h:2",
            "etcd://h:0/ns",
        ] {
            let e = match open_store(url, None, Duration::from_millis(10)) {
                Err(e) => e,
                Ok(s) => panic!("{url:?} opened {}", s.describe()),
            };
            assert_eq!(e.kind(), &ErrorKind::InvalidConfig, "{url:?}: {e}");
            let m = e.to_string();
            assert!(m.contains(&format!("{url:?}")), "{m}");
            assert!(m.contains("tcp://host:port"), "{m}");
        }
    }
}
