//! Debug mode (`ACCEL_DEBUG=1`): fingerprint every collective over the store
//! and compare across ranks before entering the engine, so that ranks calling
//! different operations, dtypes, lengths or roots get a per-rank table
//! instead of a hang or a silently wrong result.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use accel_api::{
    CallInfo, Communicator, Error, ErrorKind, Layer, Layered, MismatchEntry, Result, Store,
};

/// A communicator that checks the collective calling convention on every
/// call: [`DebugLayer`] in front of the real one. One store round trip per
/// collective: for debugging, not production.
pub type DebugCommunicator = Layered<DebugLayer>;

/// The debug-mode layer: fingerprints each collective through the store.
pub struct DebugLayer {
    store: Arc<dyn Store>,
    seq: AtomicU64,
}

impl std::fmt::Debug for DebugLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DebugLayer")
            .field("store", &self.store.describe())
            .field("seq", &self.seq)
            .finish()
    }
}

/// Put debug mode in front of `inner`; `store` must be shared by exactly
/// the ranks of `inner`'s group and used by nothing else.
pub fn debug_communicator(
    inner: Box<dyn Communicator>,
    store: Arc<dyn Store>,
) -> DebugCommunicator {
    Layered::new(
        inner,
        DebugLayer {
            store,
            seq: AtomicU64::new(0),
        },
    )
}

impl DebugLayer {
    fn check(&self, inner: &dyn Communicator, call: &CallInfo) -> Result<()> {
        let CallInfo {
            op,
            dtype,
            len,
            root,
            reduce,
            ..
        } = *call;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let rank = inner.rank();
        let world = inner.world_size();
        let call = format!(
            "#{seq} {op} {dtype} [{len}] root={} reduce={}",
            root.map(|r| r.to_string()).unwrap_or_else(|| "-".into()),
            reduce.map(|r| r.name()).unwrap_or("-")
        );
        let tag = |e: Error| {
            e.with_backend(inner.backend_name())
                .with_rank(rank)
                .with_op(op.name())
        };
        self.store
            .set(&format!("{seq}/{rank}"), call.as_bytes())
            .map_err(tag)?;
        let keys: Vec<String> = (0..world).map(|r| format!("{seq}/{r}")).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let waited = self.store.wait(&key_refs, inner.timeout());
        let table: Vec<MismatchEntry> = (0..world)
            .map(|r| MismatchEntry {
                rank: r,
                call: self
                    .store
                    .try_get(&keys[r])
                    .ok()
                    .flatten()
                    .map(|v| String::from_utf8_lossy(&v).into_owned()),
            })
            .collect();
        if let Err(e) = waited {
            if matches!(e.kind(), ErrorKind::Timeout { .. }) {
                let late: Vec<String> = table
                    .iter()
                    .filter(|t| t.call.is_none())
                    .map(|t| t.rank.to_string())
                    .collect();
                let rows: Vec<String> = table
                    .iter()
                    .map(|t| {
                        format!(
                            "rank {}: {}",
                            t.rank,
                            t.call.as_deref().unwrap_or("<not called>")
                        )
                    })
                    .collect();
                let err = Error::timeout(
                    op.name(),
                    inner.timeout(),
                    format!(
                        "rank(s) {} never called collective #{seq}; per-rank calls: {}",
                        late.join(", "),
                        rows.join(" | ")
                    ),
                )
                .with_fix("make every rank call the same collectives in the same order");
                inner.abort(&err.to_string());
                return Err(tag(err));
            }
            return Err(tag(e));
        }
        if table
            .iter()
            .any(|t| t.call.as_deref() != Some(call.as_str()))
        {
            let err = Error::new(
                ErrorKind::Mismatch { table },
                format!("ranks disagree on collective #{seq}"),
            )
            .with_fix(
                "make every rank call the same collective with the same dtype, length and root",
            );
            inner.abort(&err.to_string());
            return Err(tag(err));
        }
        if seq >= 2 {
            // Every rank has read #seq-2 before publishing #seq-1.
            let _ = self.store.delete(&format!("{}/{rank}", seq - 2));
        }
        Ok(())
    }
}

impl Layer for DebugLayer {
    /// Fingerprints every collective; point-to-point calls pass through.
    fn before(&self, inner: &dyn Communicator, call: &CallInfo) -> Result<()> {
        if !call.is_collective() {
            return Ok(());
        }
        self.check(inner, call)
    }

    /// The sub-group gets its own debug layer over a store prefix named
    /// after the split's sequence number and color.
    fn wrap_split(&self, sub: Box<dyn Communicator>, color: u32) -> Box<dyn Communicator> {
        // `before` already took this split's number.
        let seq = self.seq.load(Ordering::SeqCst).saturating_sub(1);
        let store: Arc<dyn Store> = Arc::new(accel_rendezvous::PrefixStore::new(
            self.store.clone(),
            format!("split{seq}/color{color}"),
        ));
        Box::new(debug_communicator(sub, store))
    }
}
