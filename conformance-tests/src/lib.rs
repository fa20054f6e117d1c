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

//!
//! ## Layout
//!
//! `ctx` (what a scenario sees and returns), one module per area
//! (`collectives`, `runtime`, `failures`, `train_scenarios`,
//! `zero_scenarios`), the registry ([`all_scenarios`], and
//! [`model_scenarios`] for another framework's model of the fixture) here,
//! and three ways to run it: [`threads`] (ranks as threads of one process,
//! over any [`Backend`](accel_api::Backend): what a backend's own `#[test]`
//! calls), [`harness`] (one process per rank, for backends that need it,
//! like mpi, and for plugins) and the worker ([`worker`], the
//! `accel-conformance-worker` binary, or a framework's test binary with its
//! own scenarios).

/// Scenarios named as the functions that run them, each with its gate:
/// `scenarios![all_reduce: |c| needs(c, &[Op::AllReduce]), ...]`; for a
/// model type `M`, `scenarios![<M> name; train_equivalence: gate, ...]`
/// runs `train_equivalence::<M>` under the name `name("train_equivalence")`.
macro_rules! scenarios {
    (<$m:ty> $name:expr; $($run:ident: $gate:expr),* $(,)?) => {
        vec![$($crate::Scenario { name: $name(stringify!($run)), gate: $gate, run: $run::<$m> }),*]
    };
    ($($run:ident: $gate:expr),* $(,)?) => {
        vec![$($crate::Scenario { name: stringify!($run), gate: $gate, run: $run }),*]
    };
}

/// `impl Parameters for $ty` by handing every method to `self.$field` (a
/// framework's [`ScenarioModel`] around that framework's adapter:
/// `delegate_parameters!(CandleMlp => model, uses_mixed_precision: true)`);
/// `uses_mixed_precision: B` answers that method with `B` (a model whose
/// forward computes in the mixed precision's type) instead of asking the
/// adapter.
#[macro_export]
macro_rules! delegate_parameters {
    ($ty:ty => $field:ident) => {
        impl $crate::__accel::train::Parameters for $ty {
            $crate::delegate_parameters!(@methods $field);
            fn uses_mixed_precision(&self) -> bool {
                $crate::__accel::train::Parameters::uses_mixed_precision(&self.$field)
            }
        }
    };
    ($ty:ty => $field:ident, uses_mixed_precision: $mp:literal) => {
        impl $crate::__accel::train::Parameters for $ty {
            $crate::delegate_parameters!(@methods $field);
            fn uses_mixed_precision(&self) -> bool {
                $mp
            }
        }
    };
    (@methods $field:ident) => {
        fn visit_params(&self, f: &mut dyn FnMut($crate::__accel::train::ParamRef<'_>)) {
            $crate::__accel::train::Parameters::visit_params(&self.$field, f)
        }
        fn visit_params_mut(&mut self, f: &mut dyn FnMut($crate::__accel::train::ParamMut<'_>)) {
            $crate::__accel::train::Parameters::visit_params_mut(&mut self.$field, f)
        }
        fn num_params(&self) -> usize {
            $crate::__accel::train::Parameters::num_params(&self.$field)
        }
        fn grad_kernels(
            &self,
        ) -> Option<std::sync::Arc<dyn $crate::__accel::train::GradKernels>> {
            $crate::__accel::train::Parameters::grad_kernels(&self.$field)
        }
        fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
            $crate::__accel::train::Parameters::param_shape(&self.$field, name)
        }
        fn set_param_storage(&mut self, name: &str, numel: usize) -> $crate::__accel::Result<()> {
            $crate::__accel::train::Parameters::set_param_storage(&mut self.$field, name, numel)
        }
        fn release_grad(&mut self, name: &str) -> $crate::__accel::Result<()> {
            $crate::__accel::train::Parameters::release_grad(&mut self.$field, name)
        }
    };
}

#[doc(hidden)]
pub use accel as __accel;

mod async_scenarios;
mod collectives;
mod ctx;
pub mod data;
mod failures;
pub mod fixtures;
pub mod harness;
mod mesh_scenarios;
pub mod oracle;
mod prop;
mod runtime;
mod seed;
pub mod threads;
mod train_scenarios;
pub mod worker;
mod zero_scenarios;

use std::time::Duration;

pub use ctx::{Ctx, Outcome, Scenario, ScenarioResult};
pub use fixtures::{ScenarioModel, TpCase, TpGrads};
pub use prop::agree;
pub use seed::Seed;
pub use threads::{
    assert_conformance, assert_scenario_list, run_in_process, run_spec_in_process,
    run_world_in_process,
};

/// Every scenario, in the order the matrix lists them: the collectives, the
/// runtime built on them, failure behaviour, then the training loop.
pub fn all_scenarios() -> Vec<Scenario> {
    let mut all = collectives::scenarios();
    all.extend(mesh_scenarios::scenarios());
    all.extend(runtime::scenarios());
    all.extend(failures::scenarios());
    all.extend(async_scenarios::scenarios());
    all.extend(train_scenarios::train_scenarios());
    all.extend(model_scenarios::<fixtures::Mlp>());
    all
}

/// The scenarios that train a model, for model type `M`: accumulation
/// cadence, W×k equivalence with one process, the fp16 skip, bf16
/// equivalence, clipping, the ZeRO stages (equivalence, clipping, the
/// fp16 skip, HSDP), and its tensor-parallel layers against one rank's.
/// Each is named with [`ScenarioModel::PREFIX`] before the fixture's name
/// (`candle_train_equivalence`); the oracles are the fixture
/// [`Mlp`](fixtures::Mlp) on one process. A framework's integration runs
/// them on every column with [`worker::main_with`] (a model type's names
/// are made once per call and live as long as the process).
pub fn model_scenarios<M: ScenarioModel>() -> Vec<Scenario> {
    let name = |base: &'static str| -> &'static str {
        if M::PREFIX.is_empty() {
            base
        } else {
            Box::leak(format!("{}{base}", M::PREFIX).into_boxed_str())
        }
    };
    use mesh_scenarios::{gate_tp, tensor_parallel};
    use train_scenarios::*;
    use zero_scenarios::*;
    // The training scenarios that train a model, the sharding ones, then
    // tensor parallelism.
    scenarios![<M> name;
        train_accumulation_cadence: gate_train,
        train_equivalence: gate_train,
        train_fp16_skip_agreed: gate_train,
        train_bf16_equivalence: gate_train,
        train_clip_norm_agreed: gate_train,
        train_overlap_bit_identical: gate_train,
        zero_equivalence: gate_zero,
        zero_clipping: gate_zero,
        zero_fp16_skip_agreed: gate_zero,
        zero_hsdp: gate_hsdp,
        tensor_parallel: gate_tp,
    ]
}

/// Run every scenario (or those whose name contains `filter`; `=name` for
/// exactly one) on this rank and agree on each verdict with the other
/// ranks. Every rank returns the same list.
pub fn run_all(ctx: &Ctx, filter: Option<&str>) -> Vec<ScenarioResult> {
    run_scenarios(ctx, &all_scenarios(), filter)
}

/// [`run_all`] over the given scenarios (a framework's
/// [`model_scenarios`]).
pub fn run_scenarios(
    ctx: &Ctx,
    scenarios: &[Scenario],
    filter: Option<&str>,
) -> Vec<ScenarioResult> {
    let mut out = Vec::new();
    for s in scenarios.iter().copied() {
        if filter.is_some_and(|f| !matches_filter(s.name, f)) {
            continue;
        }
        let start = std::time::Instant::now();
        let local = match (s.gate)(ctx) {
            Some(reason) => Outcome::Skip(reason),
            None => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (s.run)(ctx))) {
                Ok(o) => o,
                Err(p) => Outcome::Fail(format!("panicked: {}", prop::panic_text(&p))),
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

/// `filter` selects the scenarios whose name contains it, or, written
/// `=name`, exactly the scenario `name`.
fn matches_filter(name: &str, filter: &str) -> bool {
    match filter.strip_prefix('=') {
        Some(exact) => name == exact,
        None => name.contains(filter),
    }
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

/// Stamp one `#[test]` per scenario for a backend, for a backend's or a
/// vendor's own test crate.
///
/// In-process form: each test runs the scenario with ranks as threads of the
/// test process ([`run_in_process`]) at the given world sizes, over the
/// backend built by the expression. Every scenario is either listed or
/// skipped with a reason (an `#[ignore]`d test that says it; `--ignored`
/// runs it): one more test, `scenario_list_is_complete`, fails naming the
/// scenarios that are neither ([`assert_scenario_list`]).
///
/// ```ignore
/// accel_conformance::conformance_tests!(
///     in_process = std::sync::Arc::new(my_backend::MyBackend::new()),
///     world_sizes = [1, 2, 3, 4],
///     scenarios = [all_reduce, broadcast, barrier_ordering],
///     skips = [split_subgroups: "no sub-communicators yet"],
/// );
/// ```
///
/// Multi-process form: each test runs the scenario through the harness (one
/// process per rank); `$worker` is the path of a conformance worker binary
/// that has the backend compiled in or can load it as a plugin:
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
    (in_process = $b:expr, world_sizes = $ws:expr, scenarios = [$($s:ident),* $(,)?]
        $(, skips = [$($k:ident: $why:literal),* $(,)?])? $(,)?) => {
        $(
            #[test]
            fn $s() {
                $crate::assert_conformance($b, &$ws, Some(concat!("=", stringify!($s))));
            }
        )*
        $($(
            #[test]
            #[ignore = $why]
            fn $k() {
                $crate::assert_conformance($b, &$ws, Some(concat!("=", stringify!($k))));
            }
        )*)?
        #[test]
        fn scenario_list_is_complete() {
            $crate::assert_scenario_list(
                $b,
                &[$(stringify!($s)),*],
                &[$($((stringify!($k), $why)),*)?],
            );
        }
    };
    (backend = $b:expr, plugin = $p:expr, worker = $w:expr, world_sizes = $ws:expr, scenarios = [$($s:ident),* $(,)?] $(,)?) => {
        $(
            #[test]
            fn $s() {
                for n in $ws {
                    let spec = $crate::harness::RunSpec::new($b, n, std::path::PathBuf::from($w))
                        .with_plugin($p.map(std::path::PathBuf::from))
                        .with_filter(Some(concat!("=", stringify!($s)).to_string()));
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
