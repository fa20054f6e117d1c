//! A test fixture for `accel-plugin`'s integration tests, built as a cdylib
//! plugin. Not an example to copy.
//!
//! Backend `fixture`:
//!
//! * `probe` always panics ("fixture probe always panics"): the host must
//!   report the backend unavailable, not crash.
//! * `connect` picks a scenario from `ctx.run_id`:
//!   * `store-roundtrip`: calls every method of the host's store through the
//!     C vtable and writes what it saw to the key `fixture/report`;
//!   * `store-timeout`: waits 100 ms for a key nobody sets and returns the
//!     host store's timeout error unchanged (it crosses the boundary twice);
//!   * `connect-panic`: panics;
//!   * anything else: a one-rank communicator (the `single` engine) that
//!     keeps the host's store and counts each `barrier` under the key
//!     `fixture/barriers`, so the store must outlive `connect`.
#![deny(unsafe_code)]

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use accel_api::{
    Backend, Buf, BufMut, Capabilities, CasOutcome, Communicator, ConnectContext, Device,
    DeviceKind, Probe, ProbeContext, ReduceOp, Result, Store,
};
use accel_backend_single::SingleCommunicator;

accel_plugin::export_plugin!(Fixture);

/// The fixture backend.
#[derive(Debug)]
pub struct Fixture;

impl Backend for Fixture {
    fn name(&self) -> &str {
        "fixture"
    }

    fn priority(&self) -> i32 {
        -100
    }

    fn device_kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn probe(&self, _ctx: &ProbeContext) -> Probe {
        panic!("fixture probe always panics")
    }

    fn connect(&self, ctx: ConnectContext) -> Result<Box<dyn Communicator>> {
        match ctx.run_id.as_str() {
            "store-roundtrip" => {
                let report = round_trip(ctx.store.as_ref())?;
                ctx.store.set("fixture/report", report.as_bytes())?;
            }
            "store-timeout" => {
                ctx.store
                    .get("fixture/never-set", Duration::from_millis(100))?;
            }
            "connect-panic" => panic!("fixture connect panics on request"),
            _ => {}
        }
        Ok(Box::new(StoreComm {
            inner: SingleCommunicator::new(ctx.device, ctx.timeout),
            store: ctx.store,
        }))
    }
}

/// Every store method once; what each returned, on one line.
fn round_trip(store: &dyn Store) -> Result<String> {
    let t = Duration::from_secs(5);
    let mut r = String::new();
    store.set("fixture/a", b"alpha")?;
    let got = store.get("fixture/a", t)?;
    let _ = write!(r, "get={}", String::from_utf8_lossy(&got));
    let _ = write!(r, " try_get={:?}", store.try_get("fixture/absent")?);
    let present = store
        .try_get("fixture/a")?
        .map(|v| String::from_utf8_lossy(&v).into_owned());
    let _ = write!(r, " try_get_a={present:?}");
    let a = store.add("fixture/n", 5)?;
    let b = store.add("fixture/n", -2)?;
    let _ = write!(r, " add={a},{b}");
    let cas = |o: CasOutcome| match o {
        CasOutcome::Swapped => "swapped".to_string(),
        CasOutcome::Current(None) => "absent".to_string(),
        CasOutcome::Current(Some(v)) => format!("current:{}", String::from_utf8_lossy(&v)),
    };
    let c1 = cas(store.compare_set("fixture/c", None, b"one")?);
    let c2 = cas(store.compare_set("fixture/c", Some(b"zzz"), b"two")?);
    let c3 = cas(store.compare_set("fixture/c", Some(b"one"), b"two")?);
    let c4 = cas(store.compare_set("fixture/absent", Some(b"x"), b"y")?);
    let _ = write!(r, " cas={c1},{c2},{c3},{c4}");
    store.wait(&["fixture/a", "fixture/n", "fixture/c"], t)?;
    let d1 = store.delete("fixture/a")?;
    let d2 = store.delete("fixture/a")?;
    let _ = write!(r, " delete={d1},{d2}");
    let _ = write!(r, " describe={}", store.describe());
    Ok(r)
}

/// The `single` engine plus the host's store, kept past `connect`.
struct StoreComm {
    inner: SingleCommunicator,
    store: Arc<dyn Store>,
}

impl Communicator for StoreComm {
    fn backend_name(&self) -> &str {
        "fixture"
    }

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn device(&self) -> Device {
        self.inner.device()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn capabilities(&self) -> &Capabilities {
        self.inner.capabilities()
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.inner.all_reduce(buf, op)
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        self.inner.reduce(buf, op, root)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.inner.broadcast(buf, root)
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.inner.all_gather(send, recv)
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.inner.gather(send, recv, root)
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        self.inner.scatter(send, recv, root)
    }

    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.inner.reduce_scatter(send, recv, op)
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.inner.all_to_all(send, recv)
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        self.inner.send(buf, dst, tag)
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        self.inner.recv(buf, src, tag)
    }

    fn barrier(&self) -> Result<()> {
        self.store.add("fixture/barriers", 1)?;
        self.inner.barrier()
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Box<dyn Communicator>>> {
        self.inner.split(color, key)
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}
