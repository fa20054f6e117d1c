//! [`EtcdStore`]: the store on an etcd v3 cluster (feature `etcd`), so that
//! no machine of a run hosts the rendezvous and any machine may die.
//!
//! Keys live under a namespace (`accel/<run id>/`); `add` and
//! `compare_set` are etcd transactions, `get` and `wait` a read then a
//! watch from the read's revision, so no set between the two is missed.
//! Every request is made with etcd's `require-leader`: a member cut off
//! from the quorum answers at once instead of hanging, and the error names
//! the endpoints and the quorum that was lost.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use accel_api::{CasOutcome, Error, ErrorKind, Result, Store};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Txn, TxnOp, TxnResponse,
    WatchOptions,
};
use tokio::runtime::Runtime;

use crate::memory::{counter_sum, missing_keys_error, parse_counter};

/// How a client proves itself to an etcd cluster that asks (its TLS and
/// authentication settings); the default is a plain, unauthenticated
/// cluster. [`EtcdAuth::from_env`] reads what `accel launch --rdzv-conf`
/// passes on to the workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdAuth {
    /// The CA certificate (PEM) the members' certificates are checked
    /// against; setting it turns TLS on.
    pub ca: Option<PathBuf>,
    /// This client's certificate (PEM), for clusters that check clients.
    pub cert: Option<PathBuf>,
    /// The key of [`cert`](Self::cert) (PEM).
    pub key: Option<PathBuf>,
    /// User name and password, for clusters with authentication on.
    pub user: Option<(String, String)>,
}

/// The environment variables of [`EtcdAuth::from_env`].
pub const ETCD_ENV: [&str; 5] = [
    "ACCEL_ETCD_CA",
    "ACCEL_ETCD_CERT",
    "ACCEL_ETCD_KEY",
    "ACCEL_ETCD_USER",
    "ACCEL_ETCD_PASSWORD",
];

impl EtcdAuth {
    /// From `ACCEL_ETCD_CA`, `ACCEL_ETCD_CERT`, `ACCEL_ETCD_KEY`,
    /// `ACCEL_ETCD_USER` and `ACCEL_ETCD_PASSWORD`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] when only one of a pair is set (a
    /// certificate without its key, a user without a password).
    pub fn from_env() -> Result<EtcdAuth> {
        let var = |n: &str| std::env::var(n).ok().filter(|v| !v.is_empty());
        let path = |n: &str| var(n).map(PathBuf::from);
        let user = match (var("ACCEL_ETCD_USER"), var("ACCEL_ETCD_PASSWORD")) {
            (Some(u), Some(p)) => Some((u, p)),
            (None, None) => None,
            (u, _) => {
                let (set, unset) = if u.is_some() {
                    ("ACCEL_ETCD_USER", "ACCEL_ETCD_PASSWORD")
                } else {
                    ("ACCEL_ETCD_PASSWORD", "ACCEL_ETCD_USER")
                };
                return Err(Error::invalid_config(
                    set,
                    "(set)",
                    format!("{unset} is not set; etcd authentication needs both"),
                ));
            }
        };
        let auth = EtcdAuth {
            ca: path("ACCEL_ETCD_CA"),
            cert: path("ACCEL_ETCD_CERT"),
            key: path("ACCEL_ETCD_KEY"),
            user,
        };
        if auth.cert.is_some() != auth.key.is_some() {
            return Err(Error::invalid_config(
                "ACCEL_ETCD_CERT",
                &format!("{:?}", auth.cert),
                "a client certificate needs its key (ACCEL_ETCD_KEY) and the other way round",
            ));
        }
        Ok(auth)
    }

    fn options(&self, timeout: Duration) -> Result<ConnectOptions> {
        let mut o = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_require_leader(true)
            .with_keep_alive(Duration::from_secs(2), timeout);
        if let Some((u, p)) = &self.user {
            o = o.with_user(u.clone(), p.clone());
        }
        if self.ca.is_some() || self.cert.is_some() {
            use etcd_client::{Certificate, Identity, TlsOptions};
            let read = |p: &PathBuf| {
                std::fs::read(p).map_err(|e| {
                    Error::new(
                        ErrorKind::InvalidConfig,
                        format!("cannot read the etcd TLS file {}: {e}", p.display()),
                    )
                    .with_op("etcd connect")
                })
            };
            let mut tls = TlsOptions::new();
            if let Some(ca) = &self.ca {
                tls = tls.ca_certificate(Certificate::from_pem(read(ca)?));
            }
            if let (Some(c), Some(k)) = (&self.cert, &self.key) {
                tls = tls.identity(Identity::from_pem(read(c)?, read(k)?));
            }
            o = o.with_tls(tls);
        }
        Ok(o)
    }
}

/// A [`Store`] on an etcd v3 cluster: every key under a namespace, every
/// call bounded. Open it with [`EtcdStore::connect`], or through
/// [`open_store`](crate::open_store) with `etcd://host1:2379,host2:2379/namespace`.
pub struct EtcdStore {
    /// Shared with the stores made by [`EtcdStore::sibling`].
    rt: Arc<Runtime>,
    client: Client,
    endpoints: Vec<String>,
    namespace: String,
    members: usize,
    timeout: Duration,
    /// This client's id and count of transactions, for their markers.
    id: String,
    ops: AtomicU64,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .field("namespace", &self.namespace)
            .field("members", &self.members)
            .finish_non_exhaustive()
    }
}

/// A key's value and modification revision (when set), and the revision
/// of the read.
type Read = (Option<(Vec<u8>, i64)>, i64);

/// Why a watch ended without the key.
enum Retry {
    /// A member went away under it: read and watch again.
    Transient,
    /// The cluster refused or is gone.
    Fatal(Error),
}

/// The answer to a call, or why there was none.
enum Call<T> {
    Done(T),
    Failed(etcd_client::Error),
    Late,
}

impl EtcdStore {
    /// Connect to the cluster at `endpoints` (`host:port`, or
    /// `http(s)://host:port`), keys under `namespace`. Retries while
    /// `timeout` lasts (a cluster may start after its clients); `timeout`
    /// also bounds every later call that does not wait for a key.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for no endpoint or an unreadable TLS
    /// file; [`ErrorKind::Timeout`] naming the endpoints when no quorum of
    /// the cluster answered in time; [`ErrorKind::Unauthorized`] when the
    /// cluster refused the credentials.
    pub fn connect(
        endpoints: &[String],
        namespace: &str,
        auth: &EtcdAuth,
        timeout: Duration,
    ) -> Result<EtcdStore> {
        if endpoints.is_empty() || endpoints.iter().any(|e| e.trim().is_empty()) {
            return Err(Error::invalid_config(
                "etcd endpoints",
                &endpoints.join(","),
                "expected host:port[,host:port...]",
            ));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("accel-etcd")
            .enable_all()
            .build()
            .map_err(|e| {
                Error::new(ErrorKind::Io, format!("cannot start the etcd client: {e}"))
                    .with_op("etcd connect")
            })?;
        let opts = auth.options(timeout)?;
        let eps = endpoints.to_vec();
        let start = Instant::now();
        let mut last = String::from("no answer");
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            let attempt = rt.block_on(async {
                let connect = async {
                    let c = Client::connect(&eps, Some(opts.clone())).await?;
                    let mut c2 = c.clone();
                    let list = c2.member_list().await?;
                    // A linearizable read: only a cluster with a quorum answers.
                    c2.get("accel/", Some(GetOptions::new().with_count_only()))
                        .await?;
                    Ok::<_, etcd_client::Error>((c, list.members().len()))
                };
                tokio::time::timeout(left.max(Duration::from_millis(1)), connect).await
            });
            match attempt {
                Ok(Ok((client, members))) => {
                    return Ok(EtcdStore {
                        rt: Arc::new(rt),
                        client,
                        endpoints: eps,
                        namespace: namespace.to_string(),
                        members,
                        timeout,
                        id: client_id(),
                        ops: AtomicU64::new(0),
                    })
                }
                Ok(Err(e)) if is_auth(&e) => {
                    return Err(Error::new(
                        ErrorKind::Unauthorized,
                        format!("the etcd cluster at {} refused this client: {e}", eps.join(",")),
                    )
                    .with_op("etcd connect")
                    .with_fix("pass the cluster's user and password or client certificate (--rdzv-conf user=...,password_file=... or cert=...,key=...)"))
                }
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => {}
            }
            if start.elapsed() >= timeout {
                return Err(Error::timeout(
                    "etcd connect",
                    timeout,
                    format!(
                        "no quorum of the etcd cluster at {} answered within {timeout:?} ({last})",
                        eps.join(",")
                    ),
                )
                .with_fix(
                    "start the etcd members (scripts/etcd_cluster.sh for a test cluster), check \
                     --rdzv-endpoint, or raise the join timeout",
                ));
            }
            std::thread::sleep(Duration::from_millis(200).min(left));
        }
    }

    /// Bound every later call that does not wait for a key by `d` instead
    /// of the connection's timeout.
    #[must_use]
    pub fn with_call_timeout(mut self, d: Duration) -> EtcdStore {
        self.timeout = d;
        self
    }

    /// A second store on this one's connection and client thread (and
    /// namespace), its calls bounded by `d`: a heartbeat's own store, without
    /// a second connection. Its transactions carry markers of their own.
    #[must_use]
    pub fn sibling(&self, d: Duration) -> EtcdStore {
        EtcdStore {
            rt: Arc::clone(&self.rt),
            client: self.client.clone(),
            endpoints: self.endpoints.clone(),
            namespace: self.namespace.clone(),
            members: self.members,
            timeout: d,
            id: format!(
                "{}-{}",
                client_id(),
                self.ops.fetch_add(1, Ordering::SeqCst)
            ),
            ops: AtomicU64::new(0),
        }
    }

    /// The namespace every key lives under.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn key(&self, k: &str) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.namespace.len() + k.len() + 1);
        v.extend_from_slice(self.namespace.as_bytes());
        v.push(b'/');
        v.extend_from_slice(k.as_bytes());
        v
    }

    /// Run `f` on a clone of the client, bounded by `limit`.
    fn call<T, F, Fut>(&self, limit: Duration, f: F) -> Call<T>
    where
        F: FnOnce(Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let fut = f(self.client.clone());
        match self
            .rt
            .block_on(async { tokio::time::timeout(limit, fut).await })
        {
            Ok(Ok(v)) => Call::Done(v),
            Ok(Err(e)) => Call::Failed(e),
            Err(_) => Call::Late,
        }
    }

    /// A short, idempotent call: its answer, through transient failures
    /// (a member down, an election) while the store's timeout lasts, or an
    /// error naming the cluster.
    fn quick<T, F, Fut>(&self, op: &str, what: &str, f: F) -> Result<T>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        let deadline = Instant::now() + self.timeout;
        let mut retried = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.call(left, &f) {
                Call::Done(v) => return Ok(v),
                Call::Failed(e) if transient(&e) && !left.is_zero() => {
                    retried = true;
                    std::thread::sleep(RETRY.min(left));
                    if Instant::now() >= deadline {
                        return Err(self.failed(op, what, e, retried));
                    }
                }
                Call::Failed(e) => return Err(self.failed(op, what, e, retried)),
                Call::Late => return Err(self.late(op, what, self.timeout)),
            }
        }
    }

    /// `txn`, whose then-branch is made to also write a marker of its
    /// own, through transient failures: `None` when a try whose answer was
    /// lost had in fact applied it (the marker is there), so that a retried
    /// `add` never counts twice.
    fn txn(
        &self,
        (op, what): (&str, &str),
        when: Compare,
        then: Vec<TxnOp>,
        otherwise: Vec<TxnOp>,
    ) -> Result<Option<TxnResponse>> {
        let marker = {
            let n = self.ops.fetch_add(1, Ordering::Relaxed);
            format!("accel-ops/{}/{n}", self.id).into_bytes()
        };
        let mut then = then;
        then.push(TxnOp::put(marker.clone(), b"1".to_vec(), None));
        let txn = Txn::new().when([when]).and_then(then).or_else(otherwise);
        let deadline = Instant::now() + self.timeout;
        let mut tried = false;
        let applied = |s: &Self| -> Result<bool> {
            let m = marker.clone();
            let r = s.quick(op, what, |mut c| {
                let m = m.clone();
                async move { c.get(m, None).await }
            })?;
            Ok(!r.kvs().is_empty())
        };
        loop {
            if tried && applied(self)? {
                self.forget(&marker);
                return Ok(None);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            tried = true;
            match self.call(left, |mut c| {
                let t = txn.clone();
                async move { c.txn(t).await }
            }) {
                Call::Done(r) => {
                    if r.succeeded() {
                        self.forget(&marker);
                    }
                    return Ok(Some(r));
                }
                Call::Failed(e) if transient(&e) && Instant::now() < deadline => {
                    std::thread::sleep(RETRY);
                }
                Call::Failed(e) => return Err(self.failed(op, what, e, tried)),
                Call::Late => return Err(self.late(op, what, self.timeout)),
            }
        }
    }

    /// Remove a transaction's marker (best effort: a leftover is a few bytes).
    fn forget(&self, marker: &[u8]) {
        let m = marker.to_vec();
        let _ = self.call(self.timeout, |mut c| {
            let m = m.clone();
            async move { c.delete(m, None).await }
        });
    }

    fn quorum(&self) -> String {
        format!(
            "a quorum is {} of its {} member(s)",
            self.members / 2 + 1,
            self.members
        )
    }

    /// `e`, the last failure of a call (`retried`: after transient ones
    /// for as long as the call's bound), as an error naming the cluster.
    fn failed(&self, op: &str, what: &str, e: etcd_client::Error, retried: bool) -> Error {
        let eps = self.endpoints.join(",");
        let kind = if is_auth(&e) {
            ErrorKind::Unauthorized
        } else {
            ErrorKind::PeerLost { peer: None }
        };
        let why = if e.to_string().contains("no leader") {
            format!(
                "the etcd cluster at {eps} lost its quorum ({})",
                self.quorum()
            )
        } else if retried && transient(&e) {
            format!(
                "the etcd cluster at {eps} lost its quorum or cannot be reached ({}; no member \
                 answered for {:?})",
                self.quorum(),
                self.timeout
            )
        } else {
            format!("the etcd cluster at {eps} failed")
        };
        Error::new(kind, format!("{why} during {what}: {e}"))
            .with_op(op.to_string())
            .with_fix(FIX_CLUSTER)
    }

    fn late(&self, op: &str, what: &str, after: Duration) -> Error {
        Error::timeout(
            op.to_string(),
            after,
            format!(
                "the etcd cluster at {} did not answer {what} within {after:?}: its members are \
                 unreachable or it lost its quorum ({})",
                self.endpoints.join(","),
                self.quorum()
            ),
        )
        .with_fix(FIX_CLUSTER)
    }

    /// The value and modification revision of `key`, and the read's revision.
    fn read(&self, op: &str, key: &str) -> Result<Read> {
        let k = self.key(key);
        let mut r = self.quick(op, &format!("a read of `{key}`"), |mut c| {
            let k = k.clone();
            async move { c.get(k, None).await }
        })?;
        let rev = r.header().map_or(0, |h| h.revision());
        let kv = r
            .take_kvs()
            .into_iter()
            .next()
            .map(|kv| (kv.value().to_vec(), kv.mod_revision()));
        Ok((kv, rev))
    }

    /// Wait until `key` is set, up to `deadline`: `None` when it passed.
    fn await_key(&self, op: &str, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        loop {
            match self.watch_once(op, key, deadline) {
                // A member went away under the watch: read and watch again
                // on another, while the caller's time and the store's last.
                // (A cluster that is gone fails the next read.)
                Err(Retry::Transient) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    std::thread::sleep(RETRY.min(left));
                }
                Err(Retry::Fatal(e)) => return Err(e),
                Ok(v) => return Ok(v),
            }
        }
    }

    /// One read and one watch of [`await_key`](Self::await_key).
    fn watch_once(
        &self,
        op: &str,
        key: &str,
        deadline: Instant,
    ) -> std::result::Result<Option<Vec<u8>>, Retry> {
        let (kv, rev) = self.read(op, key).map_err(Retry::Fatal)?;
        if let Some((v, _)) = kv {
            return Ok(Some(v));
        }
        let k = self.key(key);
        let left = deadline.saturating_duration_since(Instant::now());
        let what = format!("a watch of `{key}`");
        let got = self.call(left, |mut c| async move {
            let opts = WatchOptions::new().with_start_revision(rev + 1);
            let mut w = c.watch(k, Some(opts)).await?;
            loop {
                let Some(msg) = w.message().await? else {
                    return Err(etcd_client::Error::WatchError(
                        "the watch stream ended".into(),
                    ));
                };
                if msg.canceled() {
                    return Err(etcd_client::Error::WatchError(format!(
                        "the watch was cancelled: {}",
                        msg.cancel_reason()
                    )));
                }
                for ev in msg.events() {
                    if ev.event_type() == EventType::Put {
                        if let Some(kv) = ev.kv() {
                            return Ok(kv.value().to_vec());
                        }
                    }
                }
            }
        });
        match got {
            Call::Done(v) => Ok(Some(v)),
            Call::Failed(e) if transient(&e) => Err(Retry::Transient),
            Call::Failed(e) => Err(Retry::Fatal(self.failed(op, &what, e, false))),
            Call::Late => Ok(None),
        }
    }
}

/// Unique enough across the clients of a cluster: host, pid, time.
fn client_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{}-{nanos}", host.trim(), std::process::id())
}

const FIX_CLUSTER: &str = "check that a majority of the etcd members run and reach each other \
     (`etcdctl endpoint health --cluster`), and that --rdzv-endpoint names them";

/// Pause between the tries of a call through a transient failure.
const RETRY: Duration = Duration::from_millis(100);

/// A failure another try may not see: a member down or cut off (the
/// channel moves to another), an election under way.
fn transient(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => matches!(
            s.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::DeadlineExceeded
        ),
        _ => false,
    }
}

/// A refusal of the client's credentials (etcd says some with the code
/// `InvalidArgument`, so its words are read too).
fn is_auth(e: &etcd_client::Error) -> bool {
    let etcd_client::Error::GRpcStatus(s) = e else {
        return false;
    };
    matches!(
        s.code(),
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
    ) || [
        "authentication failed",
        "user name is empty",
        "invalid auth token",
        "permission denied",
    ]
    .iter()
    .any(|w| s.message().contains(w))
}

impl Store for EtcdStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let (k, v) = (self.key(key), value.to_vec());
        self.quick("store set", &format!("a set of `{key}`"), |mut c| {
            let (k, v) = (k.clone(), v.clone());
            async move { c.put(k, v, None).await }
        })
        .map(|_| ())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        match self.await_key("store get", key, Instant::now() + timeout)? {
            Some(v) => Ok(v),
            None => Err(missing_keys_error(
                "store get",
                &[key.to_string()],
                timeout,
                &self.describe(),
            )),
        }
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.read("store get", key)?.0.map(|(v, _)| v))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        loop {
            let (kv, _) = self.read("store add", key)?;
            let (cur, rev) = match &kv {
                Some((v, rev)) => (parse_counter(key, v)?, Some(*rev)),
                None => (0, None),
            };
            let new = counter_sum(key, cur, delta)?;
            let k = self.key(key);
            let when = match rev {
                Some(r) => Compare::mod_revision(k.clone(), CompareOp::Equal, r),
                None => Compare::version(k.clone(), CompareOp::Equal, 0),
            };
            let put = vec![TxnOp::put(k, new.to_string(), None)];
            let what = format!("an add to `{key}`");
            match self.txn(("store add", &what), when, put, Vec::new())? {
                Some(r) if !r.succeeded() => continue,
                _ => return Ok(new),
            }
        }
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let k = self.key(key);
        let when = match expected {
            Some(v) => Compare::value(k.clone(), CompareOp::Equal, v.to_vec()),
            None => Compare::version(k.clone(), CompareOp::Equal, 0),
        };
        let get = vec![TxnOp::get(k.clone(), None)];
        let put = vec![TxnOp::put(k, new.to_vec(), None)];
        let what = format!("a compare-and-set of `{key}`");
        let r = match self.txn(("store compare_set", &what), when, put, get)? {
            None => return Ok(CasOutcome::Swapped),
            Some(r) if r.succeeded() => return Ok(CasOutcome::Swapped),
            Some(r) => r,
        };
        let current = r.op_responses().into_iter().find_map(|op| match op {
            etcd_client::TxnOpResponse::Get(mut g) => Some(
                g.take_kvs()
                    .into_iter()
                    .next()
                    .map(|kv| kv.value().to_vec()),
            ),
            _ => None,
        });
        Ok(CasOutcome::Current(current.flatten()))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        for (i, key) in keys.iter().enumerate() {
            if self.await_key("store wait", key, deadline)?.is_none() {
                let mut missing = Vec::new();
                for k in &keys[i..] {
                    if self.try_get(k)?.is_none() {
                        missing.push((*k).to_string());
                    }
                }
                if missing.is_empty() {
                    return Ok(());
                }
                return Err(missing_keys_error(
                    "store wait",
                    &missing,
                    timeout,
                    &self.describe(),
                ));
            }
        }
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let k = self.key(key);
        let r = self.quick("store delete", &format!("a delete of `{key}`"), |mut c| {
            let k = k.clone();
            async move { c.delete(k, None).await }
        })?;
        Ok(r.deleted() > 0)
    }

    fn describe(&self) -> String {
        format!("etcd://{}/{}", self.endpoints.join(","), self.namespace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_test_support::etcd::EtcdCluster;

    const T: Duration = Duration::from_secs(3);

    #[test]
    fn a_sibling_shares_the_connection_and_keys_and_counts_its_adds_apart() {
        let Some(c) = EtcdCluster::start(1) else {
            return;
        };
        let s = EtcdStore::connect(&c.endpoints(), "sib", &EtcdAuth::default(), T).unwrap();
        let b = s.sibling(Duration::from_millis(700));
        s.set("k", b"1").unwrap();
        assert_eq!(b.get("k", T).unwrap(), b"1");
        // Each store's transactions carry their own markers: no add is
        // mistaken for a retry of the other's.
        for _ in 0..3 {
            s.add("n", 1).unwrap();
            b.add("n", 1).unwrap();
        }
        assert_eq!(s.add("n", 0).unwrap(), 6);
        assert_eq!(b.describe(), s.describe());
        // The sibling outlives the store it came from.
        drop(s);
        assert_eq!(b.add("n", 1).unwrap(), 7);
    }

    #[test]
    fn one_lost_member_is_survived_and_a_lost_quorum_is_named_within_the_timeout() {
        let Some(mut c) = EtcdCluster::start(3) else {
            return;
        };
        let s = EtcdStore::connect(&c.endpoints(), "q", &EtcdAuth::default(), T).unwrap();
        s.set("k", b"1").unwrap();
        c.kill(0);
        // Two of three: a quorum, the store goes on.
        assert_eq!(s.add("n", 2).unwrap(), 2);
        assert_eq!(s.get("k", T).unwrap(), b"1");
        c.kill(1);
        let start = Instant::now();
        let e = s.set("k", b"2").unwrap_err();
        let took = start.elapsed();
        assert!(took < T + Duration::from_secs(2), "{took:?}");
        let m = e.to_string();
        for ep in c.endpoints() {
            assert!(m.contains(&ep), "{m}");
        }
        assert!(m.contains("quorum") && m.contains("2 of its 3"), "{m}");
        // A wait fails as fast, not at its own (longer) timeout.
        let start = Instant::now();
        let e = s.get("absent", Duration::from_secs(30)).unwrap_err();
        assert!(start.elapsed() < T + Duration::from_secs(2), "{e}");
        // Back to a quorum: the same store works again, the data is there
        // (the failed set may apply then: a write without quorum is
        // ambiguous in etcd, as in any consensus store).
        c.restart(1);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match s.try_get("k") {
                Ok(v) => {
                    assert!(matches!(v.as_deref(), Some(b"1" | b"2")), "{v:?}");
                    break;
                }
                Err(e) => assert!(Instant::now() < deadline, "{e}"),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    #[test]
    fn no_cluster_is_a_timeout_naming_the_endpoints() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let eps = vec![format!("127.0.0.1:{port}")];
        let start = Instant::now();
        let e = EtcdStore::connect(&eps, "x", &EtcdAuth::default(), Duration::from_millis(500))
            .unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
        assert!(e.to_string().contains(&eps[0]), "{e}");
    }

    #[test]
    fn an_unreadable_certificate_is_refused_naming_the_file() {
        // Not through the process environment (tests run in parallel).
        let a = EtcdAuth {
            cert: Some("/nonexistent/cert.pem".into()),
            key: Some("/nonexistent/key.pem".into()),
            ..EtcdAuth::default()
        };
        let e = a.options(T).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cert.pem"), "{e}");
    }
}

#[cfg(test)]
mod secured {
    //! TLS with client certificates, and users, on real etcd members.
    use super::*;
    use accel_test_support::etcd::EtcdCluster;
    const T: Duration = Duration::from_secs(3);

    #[test]
    fn a_tls_cluster_takes_a_client_with_its_certificate_and_no_other() {
        let dir = tempfile_dir("tls");
        accel_test_support::tls::certificates(&dir);
        let p = |f: &str| dir.join(f);
        let Some(c) = EtcdCluster::start_tls(&p("server.pem"), &p("server.key"), &p("ca.pem"))
        else {
            return;
        };
        let auth = EtcdAuth {
            ca: Some(p("ca.pem")),
            cert: Some(p("client.pem")),
            key: Some(p("client.key")),
            user: None,
        };
        let s = EtcdStore::connect(&c.endpoints(), "tls", &auth, T).unwrap();
        s.set("k", b"over tls").unwrap();
        assert_eq!(s.get("k", T).unwrap(), b"over tls");
        // Without a client certificate, or without TLS: refused in time.
        for bad in [
            EtcdAuth {
                ca: Some(p("ca.pem")),
                ..EtcdAuth::default()
            },
            EtcdAuth::default(),
        ] {
            let start = Instant::now();
            let e = EtcdStore::connect(&c.endpoints(), "tls", &bad, Duration::from_secs(1))
                .unwrap_err();
            assert!(start.elapsed() < Duration::from_secs(4), "{e}");
            assert!(e.to_string().contains(&c.endpoints()[0]), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_cluster_with_users_takes_the_right_password_and_names_a_wrong_one() {
        let Some(c) = EtcdCluster::start(1) else {
            return;
        };
        // Users on, through etcd's own client: root, then authentication.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let eps = c.endpoints();
        rt.block_on(async {
            let mut cl = Client::connect(&eps, None).await.unwrap();
            cl.user_add("root", "s3cret", None).await.unwrap();
            cl.user_grant_role("root", "root").await.unwrap();
            cl.auth_enable().await.unwrap();
        });
        let user = |pw: &str| EtcdAuth {
            user: Some(("root".into(), pw.into())),
            ..EtcdAuth::default()
        };
        let s = EtcdStore::connect(&eps, "users", &user("s3cret"), T).unwrap();
        s.set("k", b"v").unwrap();
        assert_eq!(s.try_get("k").unwrap(), Some(b"v".to_vec()));
        for bad in [user("wrong"), EtcdAuth::default()] {
            let e = EtcdStore::connect(&eps, "users", &bad, T).unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::Unauthorized, "{e}");
            assert!(e.to_string().contains(&eps[0]), "{e}");
        }
    }

    fn tempfile_dir(label: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("accel-etcd-{label}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
