//! What every scenario sees ([`Ctx`]) and returns ([`Outcome`]), the
//! [`Scenario`] record, and the gates and helpers the areas share.

use std::sync::Arc;
use std::time::Duration;

use accel_api::{
    Backend, Communicator, ConnectContext, DType, Device, Element, Op, ReduceOp, Result, Store,
};
use proptest::prelude::*;
use proptest::sample::select;

use crate::data::input;
use crate::Seed;

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

/// One scenario: a name, a gate (`Some(reason)` = skip) and the body.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    /// Unique snake_case name (also the stamped test's name).
    pub name: &'static str,
    /// `Some(reason)` when the backend does not declare what this needs.
    pub gate: fn(&Ctx) -> Option<String>,
    /// The scenario itself, run on every rank.
    pub run: fn(&Ctx) -> Outcome,
}

pub(crate) fn needs(ctx: &Ctx, ops: &[Op]) -> Option<String> {
    let caps = ctx.comm.capabilities();
    ops.iter()
        .find(|op| !caps.supports(**op))
        .map(|op| format!("{op} not declared"))
}

pub(crate) fn needs_peers(ctx: &Ctx, ops: &[Op]) -> Option<String> {
    if ctx.world_size() < 2 {
        return Some("needs 2+ ranks".into());
    }
    needs(ctx, ops)
}

pub(crate) fn reduce_dtypes(ctx: &Ctx) -> Vec<DType> {
    ctx.comm
        .capabilities()
        .reduce_dtypes
        .iter()
        .copied()
        .collect()
}

pub(crate) fn move_dtypes(ctx: &Ctx) -> Vec<DType> {
    ctx.comm.capabilities().dtypes.iter().copied().collect()
}

pub(crate) fn reduce_ops(ctx: &Ctx) -> Vec<ReduceOp> {
    ctx.comm.capabilities().reduce_ops.iter().copied().collect()
}

/// Sizes: 0, 1, small primes, a few hundred.
pub(crate) fn sizes() -> impl Strategy<Value = usize> {
    prop_oneof![
        2 => select(vec![0usize, 1, 2, 3, 5, 7, 13, 31, 97, 257]),
        1 => 0usize..700,
    ]
}

pub(crate) fn err_text(e: accel_api::Error) -> String {
    e.to_string()
}

pub(crate) fn everyone<T: Element>(
    n: usize,
    seed: u64,
    len: usize,
    range: (i64, i64),
) -> Vec<Vec<T>> {
    (0..n).map(|r| input::<T>(seed, r, len, range)).collect()
}
