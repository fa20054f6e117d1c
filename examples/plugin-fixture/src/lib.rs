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
//!     keeps the host's store and counts every call that reaches the plugin
//!     under `fixture/calls` and each `barrier` under `fixture/barriers`, so
//!     the store must outlive `connect`.
#![deny(unsafe_code)]

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use accel_api::{
    Backend, CallInfo, CasOutcome, Communicator, ConnectContext, DeviceKind, Layer, Layered, Op,
    Probe, ProbeContext, Result, Store,
};

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
        let store = ctx.store.clone();
        let inner = accel_backend_single::connect_named("fixture", ctx)?;
        Ok(Box::new(Layered::new(
            Box::new(inner),
            CountCalls { store },
        )))
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

/// Counts, in the host's store, every call that reaches this plugin
/// (`fixture/calls`) and every barrier (`fixture/barriers`), so that host
/// tests can tell which calls crossed the boundary.
struct CountCalls {
    store: Arc<dyn Store>,
}

impl Layer for CountCalls {
    fn before(&self, _inner: &dyn Communicator, call: &CallInfo) -> Result<()> {
        self.store.add("fixture/calls", 1)?;
        if call.op == Op::Barrier {
            self.store.add("fixture/barriers", 1)?;
        }
        Ok(())
    }
}
