//! # accel-conformance: the proof that every engine gives the same answers
//!
//! A library of scenarios (plain functions over a [`Ctx`]: a connected
//! communicator, its backend and a store shared by the ranks), an oracle,
//! a shared-seed property runner, and a multi-process harness that runs the
//! library on every backend and plugin at several world sizes and prints a
//! matrix.
//!
//! * A scenario is gated on declared [`Capabilities`](accel_api::Capabilities):
//!   what a backend does not declare is a **skip with a reason**, never a pass.
//! * Property scenarios draw cases with proptest from a seed every rank reads
//!   from the store, so all ranks generate the same case; after each case the
//!   ranks agree on the verdict through the store (any rank failing fails the
//!   case for all), so shrinking walks the same path everywhere and the
//!   minimal failing case is reported once, with the seed to replay it
//!   (`ACCEL_CONFORMANCE_SEED`). `PROPTEST_CASES` sets the depth.
//! * Verdicts are agreed through the store rather than the communicator under
//!   test, so a broken engine cannot hide its own failure.
//!
//! Vendors run the suite against a plugin with `accel test --plugin PATH` or
//! stamp it into their own test crate with [`conformance_tests!`].

pub mod data;
pub mod harness;
pub mod oracle;
mod prop;
mod scenarios;
mod train_scenarios;

use std::sync::Arc;
use std::time::Duration;

use accel_api::{Backend, Communicator, ConnectContext, Device, Result, Store};

pub use prop::{agree, Seed};
pub use scenarios::{all_scenarios, Scenario};

/// What a scenario concluded on this rank (before agreement).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "outcome", content = "detail", rename_all = "lowercase")]
pub enum Outcome {
    /// The scenario ran and every check held.
    Pass,
    /// A check failed; the text says which, with the shrunk case and seed
    /// for property scenarios.
    Fail(String),
    /// Not run: the backend does not declare what the scenario needs.
    Skip(String),
}

impl Outcome {
    /// Short cell text for the matrix.
    pub fn cell(&self) -> String {
        match self {
            Outcome::Pass => "pass".into(),
            Outcome::Fail(_) => "FAIL".into(),
            Outcome::Skip(r) => format!("skip({r})"),
        }
    }
}

/// One scenario's agreed result in one world.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ScenarioResult {
    /// Scenario name.
    pub name: String,
    /// Agreed outcome.
    #[serde(flatten)]
    pub outcome: Outcome,
    /// Wall time on rank 0, milliseconds.
    pub millis: u64,
}

/// Everything a scenario may use on one rank.
pub struct Ctx {
    /// The world communicator under test.
    pub comm: Arc<dyn Communicator>,
    /// The backend that built it (scenarios that need a fresh communicator,
    /// e.g. with a short timeout, connect again through it).
    pub backend: Arc<dyn Backend>,
    /// A store shared by exactly the ranks of this run, for verdicts and
    /// coordination; never the communicator under test.
    pub store: Arc<dyn Store>,
    /// Local rank and size, for fresh connections.
    pub local_rank: usize,
    /// Number of ranks on this machine.
    pub local_world_size: usize,
    /// The device the world communicator drives.
    pub device: Device,
    /// Property cases per property scenario.
    pub cases: u32,
    /// The run's shared seed.
    pub seed: Seed,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("backend", &self.backend.name())
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("cases", &self.cases)
            .finish()
    }
}

impl Ctx {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Connect a fresh world communicator through the same backend, with its
    /// own store prefix `fresh/<name>` and the given timeout. Collective.
    ///
    /// # Errors
    /// The backend's connect errors.
    pub fn fresh_comm(&self, name: &str, timeout: Duration) -> Result<Box<dyn Communicator>> {
        let store: Arc<dyn Store> = Arc::new(accel_rendezvous::PrefixStore::new(
            self.store.clone(),
            format!("fresh/{name}"),
        ));
        self.backend.connect(ConnectContext {
            rank: self.rank(),
            world_size: self.world_size(),
            local_rank: self.local_rank,
            local_world_size: self.local_world_size,
            device: self.device,
            timeout,
            store,
            run_id: format!("conformance-{name}"),
        })
    }
}

/// Run every scenario (or those whose name contains `filter`) on this rank
/// and agree on each verdict with the other ranks. Every rank returns the
/// same list.
pub fn run_all(ctx: &Ctx, filter: Option<&str>) -> Vec<ScenarioResult> {
    let mut out = Vec::new();
    for s in all_scenarios() {
        if filter.is_some_and(|f| !s.name.contains(f)) {
            continue;
        }
        let start = std::time::Instant::now();
        let local = match (s.gate)(ctx) {
            Some(reason) => Outcome::Skip(reason),
            None => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (s.run)(ctx))) {
                Ok(o) => o,
                Err(p) => Outcome::Fail(format!("panicked: {}", panic_text(&p))),
            },
        };
        let outcome = agree_outcome(ctx, s.name, local);
        tracing::info!(scenario = s.name, outcome = %outcome.cell(), "scenario done");
        out.push(ScenarioResult {
            name: s.name.to_string(),
            outcome,
            millis: start.elapsed().as_millis() as u64,
        });
    }
    out
}

fn agree_outcome(ctx: &Ctx, name: &str, local: Outcome) -> Outcome {
    let verdict = match &local {
        Outcome::Fail(m) => Err(m.clone()),
        _ => Ok(()),
    };
    let wait = ctx.comm.timeout() + Duration::from_secs(30);
    match agree(
        &*ctx.store,
        &format!("verdict/{name}"),
        ctx.rank(),
        ctx.world_size(),
        verdict,
        wait,
    ) {
        Ok(()) => local,
        Err(m) => Outcome::Fail(m),
    }
}

pub(crate) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".into())
}

/// Stamp one `#[test]` per scenario for a backend, for a vendor's own test
/// crate. Each test runs the scenario through the multi-process harness at
/// the given world sizes; `$worker` is the path of a conformance worker
/// binary that has the backend compiled in or can load it as a plugin.
///
/// ```ignore
/// accel_conformance::conformance_tests!(
///     backend = "my-npu",
///     plugin = Some(env!("MY_PLUGIN_SO")),
///     worker = env!("CARGO_BIN_EXE_accel-conformance-worker"),
///     world_sizes = [1, 2],
///     scenarios = [all_reduce, broadcast, barrier_ordering],
/// );
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (backend = $b:expr, plugin = $p:expr, worker = $w:expr, world_sizes = [$($n:expr),*], scenarios = [$($s:ident),* $(,)?] $(,)?) => {
        $(
            #[test]
            fn $s() {
                for n in [$($n),*] {
                    let spec = $crate::harness::RunSpec::new($b, n, std::path::PathBuf::from($w))
                        .with_plugin($p.map(std::path::PathBuf::from))
                        .with_filter(Some(stringify!($s).to_string()));
                    let report = $crate::harness::run_world(&spec);
                    for r in &report.results {
                        if let $crate::Outcome::Fail(m) = &r.outcome {
                            panic!("{} at world size {n}: {m}", r.name);
                        }
                    }
                    assert!(!report.results.is_empty(), "no scenario named {}", stringify!($s));
                }
            }
        )*
    };
}
