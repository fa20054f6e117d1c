//! Sharded data parallelism (issue 21): ZeRO stages 1, 2 and 3 give the
//! parameters of a one-process run on the global batch, with gradient
//! accumulation, with clipping and with fp16 loss scaling; the clipped
//! norm and the skip decision are the same on every rank; between steps
//! a stage-3 model holds no parameters and a stage-2 model run through the
//! gate no gradients. Named `zero_*` so that
//! `--filter zero` runs them.

use accel::train::{try_visit_params_mut, MixedPrecision, Parameters};
use accel::train::{Dataset, GradScaler, GradScalerConfig, Optimizer, Sgd};
use accel::zero::{NoGate, ShardedSgd, Stage, StepOptions, UnitGate, WrapPolicy, ZeroOptimizer};
use std::sync::Arc;

use accel_api::{BufMut, Communicator, CommunicatorExt, Op};

use crate::fixtures::{grad_numel, resident_numel, zero_grads, Mlp, ScenarioModel, Synthetic};
use crate::{Ctx, Outcome};

pub(crate) fn gate_zero(ctx: &Ctx) -> Option<String> {
    crate::ctx::needs(ctx, &[Op::AllReduce, Op::AllGather, Op::ReduceScatter])
}

pub(crate) fn gate_hsdp(ctx: &Ctx) -> Option<String> {
    crate::ctx::needs_peers(
        ctx,
        &[Op::AllReduce, Op::AllGather, Op::ReduceScatter, Op::Split],
    )
}

/// HSDP (issue 39): 2 replicas (all of them on an odd world) of a model
/// sharded over the rest, the mesh's row-major `dp_replicate` × `dp_shard`
/// groups split off the world; stages 1-3 give the one-process run's
/// parameters, as ZeRO over the whole world does.
pub(crate) fn zero_hsdp<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    let (n, rank) = (ctx.world_size(), ctx.comm.rank());
    let replicas = if n % 2 == 0 { 2 } else { n };
    let per = n / replicas;
    let split = |color: usize, key: usize| {
        ctx.comm
            .split(Some(color as u32), key as u32)
            .map_err(|e| e.to_string())?
            .map(Arc::<dyn Communicator>::from)
            .ok_or_else(|| "the split gave this rank no group".to_string())
    };
    let groups =
        split(rank / per, rank % per).and_then(|s| Ok((s, split(rank % per, rank / per)?)));
    let groups = match groups {
        Ok(g) => g,
        Err(e) => return Outcome::Fail(format!("the HSDP groups: {e}")),
    };
    for stage in [Stage::Optimizer, Stage::Gradients, Stage::Full] {
        let what = format!("HSDP {replicas} x {per}, stage {stage}");
        let r = sharded_run_over::<M>(
            ctx,
            Some(groups.clone()),
            stage,
            &WrapPolicy::Depth(1),
            (2, true),
            None,
        )
        .and_then(|(got, _, _, _)| close(&what, &got, &reference(n, 2, None)?.0));
        if let Err(m) = r {
            return Outcome::Fail(m);
        }
    }
    Outcome::Pass
}

const STAGES: [Stage; 4] = [Stage::None, Stage::Optimizer, Stage::Gradients, Stage::Full];
const HIDDEN: usize = 6;
const BS: usize = 3;
const STEPS: usize = 3;

/// `steps` sharded steps of `k` local micro-batches each, the model run
/// module by module through the optimizer's gate (`gated`) or in one pass
/// (stages 0-2 only); returns the parameters and the norms `step_clipped`
/// reported.
fn sharded_run<M: ScenarioModel>(
    ctx: &Ctx,
    stage: Stage,
    policy: &WrapPolicy,
    (k, gated): (usize, bool),
    clip: Option<f32>,
) -> Result<(Vec<f32>, Vec<f32>, usize, u64), String> {
    sharded_run_over::<M>(ctx, None, stage, policy, (k, gated), clip)
}

/// [`sharded_run`] sharding over `hybrid`'s first group and averaging
/// across its second (HSDP), or over the world (`None`).
fn sharded_run_over<M: ScenarioModel>(
    ctx: &Ctx,
    hybrid: Option<(Arc<dyn Communicator>, Arc<dyn Communicator>)>,
    stage: Stage,
    policy: &WrapPolicy,
    (k, gated): (usize, bool),
    clip: Option<f32>,
) -> Result<(Vec<f32>, Vec<f32>, usize, u64), String> {
    let (n, rank) = (ctx.world_size(), ctx.comm.rank());
    let data = Synthetic {
        len: n * k * BS * STEPS,
        seed: 7,
    };
    let mut model = M::build(HIDDEN, 3);
    let opt = ShardedSgd::new(0.2).with_momentum(0.5);
    let (shards, replicas) = match hybrid {
        Some((s, r)) => (s, Some(r)),
        None => (ctx.comm.clone(), None),
    };
    let mut zero =
        ZeroOptimizer::new(shards, &model, stage, policy, opt).map_err(|e| e.to_string())?;
    if let Some(r) = replicas {
        zero = zero.with_replicas(r);
    }
    let global = n * k * BS;
    let mut norms = Vec::new();
    for s in 0..STEPS {
        for j in 0..k {
            let start = s * global + (j * n + rank) * BS;
            let batch: Vec<_> = (start..start + BS).map(|i| data.get(i)).collect();
            let gate: &mut dyn UnitGate = if gated { &mut zero } else { &mut NoGate };
            model
                .loss_and_grad_gated(&batch, 1.0 / k as f32, MixedPrecision::No, gate)
                .map_err(|e| e.to_string())?;
        }
        match clip {
            Some(max) => norms.push(
                zero.step_clipped(&mut model, max)
                    .map_err(|e| e.to_string())?,
            ),
            None => zero.step(&mut model).map_err(|e| e.to_string())?,
        }
        zero_grads(&mut model).map_err(|e| e.to_string())?;
        if stage == Stage::Full && resident_numel(&model) != 0 {
            return Err(format!(
                "stage 3: the model still holds {} parameter and gradient elements after step {s}",
                resident_numel(&model)
            ));
        }
        let grads = grad_numel(&model);
        if stage == Stage::Gradients && gated && grads != 0 {
            return Err(format!(
                "stage 2: the model still holds {grads} gradient elements after step {s}"
            ));
        }
    }
    let full = zero.full_parameters(&model).map_err(|e| e.to_string())?;
    Ok((
        in_fixture_order(full.params),
        norms,
        zero.state_numel(),
        zero.prefetched_gathers(),
    ))
}

/// Named values flattened in the fixture's order.
fn in_fixture_order(mut params: Vec<(String, Vec<f32>)>) -> Vec<f32> {
    let at = |n: &str| {
        crate::fixtures::NAMES
            .iter()
            .position(|x| *x == n)
            .unwrap_or(usize::MAX)
    };
    params.sort_by_key(|(n, _)| at(n));
    params.into_iter().flat_map(|(_, v)| v).collect()
}

/// One process on the global batches, clipping as torch's
/// `clip_grad_norm_` when `clip` is given.
fn reference(n: usize, k: usize, clip: Option<f32>) -> Result<(Vec<f32>, Vec<f32>), String> {
    let data = Synthetic {
        len: n * k * BS * STEPS,
        seed: 7,
    };
    let mut m = Mlp::new(HIDDEN, 3);
    let mut opt = Sgd::new(0.2).with_momentum(0.5);
    let global = n * k * BS;
    let mut norms = Vec::new();
    for s in 0..STEPS {
        let batch: Vec<_> = (s * global..(s + 1) * global)
            .map(|i| data.get(i))
            .collect();
        m.loss_and_grad(&batch, 1.0);
        if let Some(max) = clip {
            let sq: f64 = m
                .grads
                .iter()
                .flatten()
                .map(|g| f64::from(*g) * f64::from(*g))
                .sum();
            let norm = sq.sqrt() as f32;
            let coef = max / (norm + 1e-6);
            if coef < 1.0 {
                m.grads.iter_mut().flatten().for_each(|g| *g *= coef);
            }
            norms.push(norm);
        }
        opt.step(&mut m).map_err(|e| e.to_string())?;
        opt.zero_grad(&mut m);
    }
    Ok((m.flat_values(), norms))
}

fn close(what: &str, got: &[f32], want: &[f32]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()));
    }
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        if (a - b).abs() > 1e-4 * (1.0 + b.abs()) {
            return Err(format!("{what}: value {i} is {a}, one process gives {b}"));
        }
    }
    Ok(())
}

pub(crate) fn zero_equivalence<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    for stage in STAGES {
        for policy in [WrapPolicy::Depth(1), WrapPolicy::Whole] {
            for (k, gated) in [(1, true), (2, true), (2, false)] {
                if stage == Stage::Full && !gated {
                    continue;
                }
                let how = if gated {
                    "module by module"
                } else {
                    "in one pass"
                };
                let what = format!("stage {stage}, {policy:?}, {k} micro-steps {how}");
                let r = sharded_run::<M>(ctx, stage, &policy, (k, gated), None).and_then(
                    |(got, _, state, prefetched)| {
                        let (want, _) = reference(n, k, None)?;
                        close(&what, &got, &want)?;
                        // Momentum for this rank's slices only (padding included);
                        // all of it without sharding.
                        let plan = accel::zero::ShardPlan::new(
                            &[
                                ("fc1.weight".into(), want.len() - 2 * HIDDEN - 1),
                                ("fc1.bias".into(), HIDDEN),
                                ("fc2.weight".into(), HIDDEN),
                                ("fc2.bias".into(), 1),
                            ],
                            &policy,
                            if stage == Stage::None { 1 } else { n },
                        )
                        .map_err(|e| e.to_string())?;
                        // From the second step on, stage 3 gathers ahead on a
                        // split communicator where the backend can split.
                        let splits = ctx.comm.capabilities().supports(Op::Split);
                        if stage == Stage::Full && n > 1 && splits && prefetched == 0 {
                            return Err(format!("{what}: no gather was served by the prefetch"));
                        }
                        if state != plan.shard_numel() {
                            return Err(format!(
                                "{what}: {state} elements of optimizer state on this rank, \
                             want the shard's {}",
                                plan.shard_numel()
                            ));
                        }
                        Ok(())
                    },
                );
                if let Err(m) = r {
                    return Outcome::Fail(m);
                }
            }
        }
    }
    Outcome::Pass
}

pub(crate) fn zero_clipping<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    // Small enough that every step clips.
    let max = 0.05;
    for stage in STAGES {
        let r = sharded_run::<M>(ctx, stage, &WrapPolicy::Depth(1), (2, true), Some(max)).and_then(
            |(got, norms, _, _)| {
                let (want, want_norms) = reference(n, 2, Some(max))?;
                close(&format!("stage {stage}: norms"), &norms, &want_norms)?;
                if want_norms.iter().any(|&x| x <= max) {
                    return Err(format!("the test did not clip: norms {want_norms:?}"));
                }
                close(&format!("stage {stage}: parameters"), &got, &want)?;
                let all = ctx.comm.all_gather_vec(&norms).map_err(|e| e.to_string())?;
                if all.chunks(norms.len()).any(|c| c != norms.as_slice()) {
                    return Err(format!(
                        "stage {stage}: the ranks report different norms {all:?}"
                    ));
                }
                Ok(())
            },
        );
        if let Err(m) = r {
            return Outcome::Fail(m);
        }
    }
    Outcome::Pass
}

/// The step at which the last rank's gradients overflow in
/// `zero_fp16_skip_agreed`.
const OVERFLOW_STEP: usize = 1;

/// A gate that, when armed, makes the first gradient element of `fc1`
/// infinite just before `fc1`'s gradients are reduced. That element is the
/// first of unit `fc1`, so at stages 2 and 3 only rank 0's shard holds the
/// infinity after the reduce-scatter: the other ranks skip the step only
/// because the overflow flag is reduced over every rank.
struct OverflowGate<'a, G: UnitGate> {
    inner: &'a mut G,
    armed: bool,
}

impl<G: UnitGate> UnitGate for OverflowGate<'_, G> {
    fn gather(&mut self, model: &mut dyn Parameters, module: &str) -> accel_api::Result<()> {
        self.inner.gather(model, module)
    }
    fn release(&mut self, model: &mut dyn Parameters, module: &str) -> accel_api::Result<()> {
        self.inner.release(model, module)
    }
    fn reduce_grads(&mut self, model: &mut dyn Parameters, module: &str) -> accel_api::Result<()> {
        if self.armed && module == "fc1" {
            try_visit_params_mut(model, |i, p| match p.grad {
                BufMut::Host(mut h) if i == 0 => {
                    h.as_mut_slice::<f32>()?[0] = f32::INFINITY;
                    Ok(())
                }
                _ => Ok(()),
            })?;
        }
        self.inner.reduce_grads(model, module)
    }
}

pub(crate) fn zero_fp16_skip_agreed<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    let (n, rank) = (ctx.world_size(), ctx.comm.rank());
    let data = Synthetic {
        len: n * BS * STEPS,
        seed: 7,
    };
    let global = n * BS;
    let init = 1024.0;
    // One process on the global batches, the overflowing step skipped.
    let want = {
        let mut m = Mlp::new(HIDDEN, 3);
        let mut opt = Sgd::new(0.2).with_momentum(0.5);
        for s in (0..STEPS).filter(|s| *s != OVERFLOW_STEP) {
            let batch: Vec<_> = (s * global..(s + 1) * global)
                .map(|i| data.get(i))
                .collect();
            m.loss_and_grad(&batch, 1.0);
            if let Err(e) = opt.step(&mut m) {
                return Outcome::Fail(e.to_string());
            }
            opt.zero_grad(&mut m);
        }
        m.flat_values()
    };
    for stage in STAGES {
        let r = (|| -> Result<(), String> {
            let mut model = M::build(HIDDEN, 3);
            let opt = ShardedSgd::new(0.2).with_momentum(0.5);
            let mut zero =
                ZeroOptimizer::new(ctx.comm.clone(), &model, stage, &WrapPolicy::Depth(1), opt)
                    .map_err(|e| e.to_string())?;
            let mut scaler = GradScaler::new(GradScalerConfig {
                init_scale: init,
                ..GradScalerConfig::default()
            });
            let mut skipped = Vec::new();
            for s in 0..STEPS {
                let start = s * global + rank * BS;
                let batch: Vec<_> = (start..start + BS).map(|i| data.get(i)).collect();
                let mut gate = OverflowGate {
                    inner: &mut zero,
                    armed: s == OVERFLOW_STEP && rank + 1 == n,
                };
                model
                    .loss_and_grad_gated(&batch, scaler.scale, MixedPrecision::No, &mut gate)
                    .map_err(|e| e.to_string())?;
                let opts = StepOptions {
                    max_norm: None,
                    scaler: Some(&mut scaler),
                };
                let report = zero
                    .step_with(&mut model, opts)
                    .map_err(|e| e.to_string())?;
                skipped.push(report.skipped);
                zero_grads(&mut model).map_err(|e| e.to_string())?;
            }
            let expect: Vec<bool> = (0..STEPS).map(|s| s == OVERFLOW_STEP).collect();
            if skipped != expect {
                return Err(format!(
                    "stage {stage}: rank {rank} skipped steps {skipped:?}, want {expect:?} \
                     (the last rank overflows at step {OVERFLOW_STEP})"
                ));
            }
            if f64::from(scaler.scale) != init * 0.5 {
                return Err(format!(
                    "stage {stage}: the scale is {} after one overflow, want {}",
                    scaler.scale,
                    init * 0.5
                ));
            }
            let full = zero.full_parameters(&model).map_err(|e| e.to_string())?;
            let got = in_fixture_order(full.params);
            close(&format!("stage {stage}: parameters"), &got, &want)
        })();
        if let Err(m) = r {
            return Outcome::Fail(m);
        }
    }
    Outcome::Pass
}
