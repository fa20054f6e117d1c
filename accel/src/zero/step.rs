//! [`ZeroOptimizer`]: its construction and the optimizer step (stages 0-2
//! reduce the gradients here; stage 3 steps what the gate reduced).

use std::sync::Arc;

use accel_api::{
    Communicator, CommunicatorExt, DType, Error, Op, ReduceOp, Result, StartExt, Work,
};
use accel_sharding::{ShardPlan, Stage, WrapPolicy};

use super::optimizer::ShardOptimizer;
use super::plan::{plan_of_model, read_unit, write_unit, Part};
use super::prefetch::{self, PairWork};
use crate::train::{GradScaler, Parameters};

/// What [`ZeroOptimizer::step_with`] does besides the update.
#[derive(Debug, Default)]
pub struct StepOptions<'a> {
    /// Scale the averaged gradients so their total 2-norm is at most this
    /// first (torch's `clip_grad_norm_`: coefficient
    /// `max_norm / (norm + 1e-6)`, capped at 1).
    pub max_norm: Option<f32>,
    /// fp16 loss scaling: the scaler the loss was multiplied by. The
    /// gradients are unscaled first; when any rank's shard holds an
    /// infinite or NaN gradient the step is skipped on every rank, and the
    /// scaler backs off (or grows) as torch's `GradScaler.update` does.
    pub scaler: Option<&'a mut GradScaler>,
}

/// What one [`ZeroOptimizer::step_with`] did, the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The total gradient norm before clipping (after unscaling), when
    /// clipping was asked for.
    pub grad_norm: Option<f32>,
    /// The update was skipped because a gradient overflowed under fp16.
    pub skipped: bool,
}

/// The sum over ranks of `[norm², overflow]` partials: in f64, or in f32
/// on an engine that cannot reduce f64 (HCCL).
fn partials_sum(comm: &dyn Communicator, v: [f64; 2]) -> Result<[f64; 2]> {
    if comm.capabilities().reduce_dtypes.contains(&DType::F64) {
        let r = comm.all_reduce_vec(&v, ReduceOp::Sum)?;
        Ok([r[0], r[1]])
    } else {
        let r = comm.all_reduce_vec(&[v[0] as f32, v[1] as f32], ReduceOp::Sum)?;
        Ok([f64::from(r[0]), f64::from(r[1])])
    }
}

/// One unit's gradient reduction in flight: this rank's slice, or the
/// whole unit and the range of this rank's slice in it.
enum Reduced {
    Slice(PairWork),
    Whole(Work<Vec<f32>>, std::ops::Range<usize>),
}

/// One unit's parameter gather in flight: the unit, its first parameter.
type Gathered = (usize, usize, PairWork);

/// Gradient synchronisation and the optimizer step of a sharded run, in
/// one collective call; at stage 3 also the keeper of the parameter
/// shards.
pub struct ZeroOptimizer<O> {
    pub(super) comm: Arc<dyn Communicator>,
    /// HSDP: the other replicas of this rank's shard, whose averaged
    /// gradient shards are averaged across before each step.
    pub(super) replicas: Option<Arc<dyn Communicator>>,
    pub(super) plan: ShardPlan,
    pub(super) stage: Stage,
    pub(super) opt: O,
    pub(super) key: String,
    /// Scratch for one unit's padded values (the unit being gathered).
    pub(super) values: Vec<f32>,
    /// This rank's averaged gradient slices, unit after unit.
    pub(super) shard: Vec<f32>,
    /// Stage 3: this rank's slices of the parameters, unit after unit.
    pub(super) params: Vec<f32>,
    /// Stage 3: the model's copy of the unit is current.
    pub(super) fresh: Vec<bool>,
    /// Stage 3: the unit's gradients were reduced since the last step.
    pub(super) reduced: Vec<bool>,
    pub(super) last_norm: Option<f32>,
    /// Stage 3: the next unit's gather on a thread of its own.
    pub(super) prefetch: Option<prefetch::Prefetcher>,
    /// Stage 3: the units of the gathers that needed data, in call order,
    /// as recorded over one step.
    pub(super) order: Vec<usize>,
    /// Stage 3: `order` is being recorded (the first step, or after the
    /// model's calls changed).
    pub(super) recording: bool,
    /// Stage 3: this step's calls left the recorded order.
    pub(super) diverged: bool,
    /// Stage 3: gathers that needed data so far this step.
    pub(super) pos: usize,
    /// Stage 3: gathers served by the prefetch.
    pub(super) prefetched: u64,
    /// Stages 2-3 through the gate: the last unit's reduce-scatter in
    /// flight (where its slice goes in `shard`, the averaging factor).
    pub(super) reducing: Option<(usize, f32, PairWork)>,
    /// Gradient buffers of finished reduce-scatters, for the next ones.
    pub(super) spare: Vec<Vec<f32>>,
}

impl<O> std::fmt::Debug for ZeroOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroOptimizer")
            .field("stage", &self.stage)
            .field("rank", &self.comm.rank())
            .field("units", &self.plan.units().len())
            .finish_non_exhaustive()
    }
}

impl<O: ShardOptimizer> ZeroOptimizer<O> {
    /// A sharded optimizer for `model` at `stage` over `comm`, units
    /// chosen by `policy`. At [`Stage::Full`] it keeps this rank's slices
    /// of `model`'s current values (every rank must start from the same
    /// ones) and the model's own copy counts as out of date: the first
    /// [`UnitGate::gather`](crate::zero::UnitGate::gather) of each unit all-gathers it, and
    /// `release(&mut model, "")` frees it at once
    /// ([`Accelerator::prepare_zero`](crate::Accelerator::prepare_zero)
    /// does). Collective at stage 3 (the prefetch's communicator is split
    /// off here).
    ///
    /// # Errors
    /// [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported) when the communicator does not declare a
    /// collective the stage needs (all-gather; all-reduce for `none` and
    /// `optimizer`; reduce-scatter for `gradients` and `full`), naming it
    /// and the backend; the errors of [`ShardPlan::new`];
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) at stage 3 when a value is not `f32`
    /// host memory.
    pub fn new(
        comm: Arc<dyn Communicator>,
        model: &dyn Parameters,
        stage: Stage,
        policy: &WrapPolicy,
        opt: O,
    ) -> Result<ZeroOptimizer<O>> {
        let world = comm.world_size();
        let needs: &[Op] = match stage {
            Stage::None => &[Op::AllReduce],
            Stage::Optimizer => &[Op::AllReduce, Op::AllGather],
            Stage::Gradients | Stage::Full => &[Op::ReduceScatter, Op::AllGather],
        };
        if world > 1 {
            let caps = comm.capabilities();
            if let Some(op) = needs.iter().find(|op| !caps.supports(**op)) {
                return Err(Error::unsupported(
                    "sharding",
                    format!(
                        "stage {stage} needs {op}, which backend {} does not declare",
                        comm.backend_name()
                    ),
                )
                .with_fix("use sharding stage `none`, or a backend that declares it"));
            }
        }
        // `none` steps every element on every rank: a plan of one share.
        let shares = if stage == Stage::None { 1 } else { world };
        let plan = plan_of_model(model, policy, shares)?;
        let units = plan.units().len();
        let mut z = ZeroOptimizer {
            comm,
            replicas: None,
            plan,
            stage,
            opt,
            key: "zero_0".into(),
            values: Vec::new(),
            shard: Vec::new(),
            params: Vec::new(),
            fresh: vec![false; units],
            reduced: vec![false; units],
            last_norm: None,
            prefetch: None,
            order: Vec::new(),
            recording: true,
            diverged: false,
            pos: 0,
            prefetched: 0,
            reducing: None,
            spare: Vec::new(),
        };
        if stage == Stage::Gradients {
            z.shard = vec![0.0; z.plan.shard_numel()];
        }
        if stage == Stage::Full {
            z.check_model(model)?;
            z.params = z.slices_of(model)?;
            z.shard = vec![0.0; z.plan.shard_numel()];
            if world > 1 && z.comm.capabilities().supports(Op::Split) {
                let rank = u32::try_from(z.comm.rank()).unwrap_or(u32::MAX);
                if let Some(side) = z.comm.split(Some(0), rank)? {
                    z.prefetch = Some(prefetch::Prefetcher::start(Arc::from(side))?);
                }
            }
        }
        Ok(z)
    }

    /// The same optimizer with (`true`, the default at stage 3 where the
    /// backend can split a communicator) or without the prefetch of the
    /// next unit's parameters. Every rank must choose alike.
    pub fn with_prefetch(mut self, on: bool) -> Self {
        if !on {
            self.prefetch = None;
        }
        self
    }

    /// Stage 3: how many unit gathers the prefetch served (it runs from
    /// the second step on, in the order the model gathered units in the
    /// step before).
    pub fn prefetched_gathers(&self) -> u64 {
        self.prefetched
    }

    /// The same optimizer saved under `key` in checkpoints (default
    /// `zero_0`; give each of several optimizers its own).
    pub fn with_checkpoint_key(mut self, key: impl Into<String>) -> Self {
        self.key = key.into();
        self
    }

    /// The units and shares.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// The stage.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The wrapped optimizer.
    pub fn optimizer(&self) -> &O {
        &self.opt
    }

    /// The wrapped optimizer, mutably (to set the learning rate).
    pub fn optimizer_mut(&mut self) -> &mut O {
        &mut self.opt
    }

    /// Elements of optimizer state this rank holds.
    pub fn state_numel(&self) -> usize {
        self.opt.state_numel()
    }

    /// Elements of parameters, gradients and scratch this optimizer holds
    /// on this rank (its own buffers; the model's are the model's).
    pub fn buffer_numel(&self) -> usize {
        [&self.values, &self.shard, &self.params]
            .iter()
            .map(|v| v.capacity())
            .chain(self.spare.iter().map(Vec::capacity))
            .sum()
    }

    /// The index of the unit called `name`.
    pub fn unit_named(&self, name: &str) -> Option<usize> {
        self.plan.units().iter().position(|u| u.name == name)
    }

    /// The total gradient norm of the last clipped step.
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.last_norm
    }

    /// Average the gradients across ranks and update the parameters.
    /// Collective: every rank calls it with the same model layout.
    ///
    /// # Behavior
    /// Stages 0-2: the model's gradients are read (the local sums of this
    /// rank's micro-batches) and left as they are; its values are replaced
    /// by the updated ones on every rank. Stage 3: the gradient shards
    /// [`UnitGate::reduce_grads`](crate::zero::UnitGate::reduce_grads) accumulated are stepped and cleared; the
    /// model's copies of the units become out of date (gather before use).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) when the model's parameters differ
    /// from the plan's (names, sizes, order), or at stage 3 when a unit's
    /// gradients were not reduced since the last step; the communicator's
    /// errors.
    pub fn step(&mut self, model: &mut dyn Parameters) -> Result<()> {
        self.step_with(model, StepOptions::default()).map(|_| ())
    }

    /// As [`step`](Self::step), with the averaged gradients clipped to a
    /// total 2-norm of `max_norm` first. Returns the total norm before
    /// clipping, identical on every rank.
    ///
    /// # Errors
    /// As [`step_with`](Self::step_with).
    pub fn step_clipped(&mut self, model: &mut dyn Parameters, max_norm: f32) -> Result<f32> {
        let opts = StepOptions {
            max_norm: Some(max_norm),
            scaler: None,
        };
        let report = self.step_with(model, opts)?;
        Ok(report.grad_norm.unwrap_or(0.0))
    }

    /// As [`step`](Self::step), with clipping and fp16 loss scaling as
    /// `opts` asks. The norm and the overflow decision take one all-reduce
    /// of every rank's shard figures, so they are global and the same on
    /// every rank.
    ///
    /// # Errors
    /// As [`step`](Self::step); [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for a
    /// negative or non-finite `max_norm`.
    pub fn step_with(
        &mut self,
        model: &mut dyn Parameters,
        opts: StepOptions<'_>,
    ) -> Result<StepReport> {
        if let Some(max) = opts.max_norm {
            if !(max.is_finite() && max >= 0.0) {
                return Err(Error::invalid_argument(
                    "clip_grad_norm",
                    format!("max_norm {max} is not a finite number >= 0"),
                ));
            }
        }
        // Stage 3 always, stage 2 when the model ran through the gate:
        // the gradients were reduce-scattered during the backward.
        self.drain_reduce()?;
        let gated = self.stage == Stage::Full
            || (self.stage == Stage::Gradients && self.reduced.iter().any(|r| *r));
        if gated {
            if let Some(u) = self.reduced.iter().position(|r| !r) {
                return Err(Error::invalid_argument(
                    "sharded optimizer step",
                    format!(
                        "unit {u} ({:?}) had no gradients reduced since the last step",
                        self.plan.units()[u].name
                    ),
                )
                .with_fix("call reduce_grads(model, module) after every module's backward"));
            }
        } else {
            self.check_model(model)?;
            self.reduce_all(model)?;
        }
        self.average_across_replicas()?;
        let report = self.finish(opts)?;
        if !report.skipped {
            self.update_params(model)?;
            self.opt.finish_step();
        }
        if gated {
            self.shard.fill(0.0);
            self.reduced.fill(false);
        }
        if self.stage == Stage::Full {
            self.end_window()?;
        }
        Ok(report)
    }

    /// Hybrid sharding (HSDP): shard over `comm` as given to
    /// [`new`](Self::new) (the mesh's `dp_shard` group) and average the
    /// gradient shards across `replicas` (its `dp_replicate` group: the
    /// ranks holding the same shard) before every step, so that the step
    /// sees the average over every data-parallel rank.
    /// [`Accelerator::prepare_zero`](crate::Accelerator::prepare_zero)
    /// does this when the parallelism configuration asks for it.
    pub fn with_replicas(mut self, replicas: Arc<dyn Communicator>) -> Self {
        self.replicas = (replicas.world_size() > 1).then_some(replicas);
        self
    }

    /// HSDP: the gradient shard, averaged within the shard group, averaged
    /// across the replicas too (a sum, then a scale: exact for any engine).
    fn average_across_replicas(&mut self) -> Result<()> {
        let Some(rep) = &self.replicas else {
            return Ok(());
        };
        rep.all_reduce_slice(&mut self.shard, ReduceOp::Sum)
            .map_err(|e| e.with_op("HSDP gradient average"))?;
        let scale = 1.0 / rep.world_size() as f32;
        self.shard.iter_mut().for_each(|g| *g *= scale);
        Ok(())
    }

    /// The reduce op and the factor that make a sum an average.
    pub(super) fn avg_op(&self) -> (ReduceOp, f32) {
        let world = self.comm.world_size();
        if self.comm.capabilities().reduce_ops.contains(&ReduceOp::Avg) {
            (ReduceOp::Avg, 1.0)
        } else if world == 1 {
            (ReduceOp::Sum, 1.0)
        } else {
            (ReduceOp::Sum, 1.0 / world as f32)
        }
    }

    /// This rank's share index (0 for a plan of one share).
    pub(super) fn share(&self) -> usize {
        if self.plan.world_size() == 1 {
            0
        } else {
            self.comm.rank()
        }
    }

    /// Stages 0-2: this rank's averaged gradient slices into `shard`.
    /// Each unit's reduction is started without waiting, two in flight at
    /// most: the next unit's gradients are read while the previous ones
    /// travel (two units' scratch, never a copy of the model).
    fn reduce_all(&mut self, model: &dyn Parameters) -> Result<()> {
        let world = self.comm.world_size();
        let rank = self.share();
        let (op, scale) = self.avg_op();
        // Stage 1 needs only this rank's slice of the averaged gradients too
        // (the model's own gradients are never overwritten): half an
        // all-reduce's bytes, where the engine can reduce-scatter.
        let scatter = self.stage == Stage::Gradients
            || (self.stage == Stage::Optimizer
                && self.comm.capabilities().supports(Op::ReduceScatter));
        self.shard.clear();
        self.shard.resize(self.plan.shard_numel(), 0.0);
        let mut flights = std::collections::VecDeque::new();
        let (mut first, mut at) = (0, 0);
        for u in 0..self.plan.units().len() {
            let mut full = self.spare.pop().unwrap_or_default();
            let nslots = self.plan.units()[u].slots.len();
            read_unit(model, &self.plan.units()[u], first, Part::Grads, &mut full)?;
            let r = self.plan.shard_range(u, rank);
            if world == 1 {
                let mine = &mut self.shard[at..at + r.len()];
                mine.copy_from_slice(&full);
                if scale != 1.0 {
                    mine.iter_mut().for_each(|g| *g *= scale);
                }
                self.spare.push(full);
            } else {
                let flight = if scatter {
                    Reduced::Slice(self.comm.start_reduce_scatter(
                        full,
                        vec![0.0f32; r.len()],
                        op,
                    )?)
                } else {
                    Reduced::Whole(self.comm.start_all_reduce(full, op)?, r.clone())
                };
                flights.push_back((at, flight));
                if flights.len() > 1 {
                    self.land(flights.pop_front(), scale)?;
                }
            }
            first += nslots;
            at += r.len();
        }
        while let Some(f) = flights.pop_front() {
            self.land(Some(f), scale)?;
        }
        Ok(())
    }

    /// Wait for one unit's reduction and put this rank's slice, averaged,
    /// at `at` in `shard`.
    fn land(&mut self, flight: Option<(usize, Reduced)>, scale: f32) -> Result<()> {
        let Some((at, flight)) = flight else {
            return Ok(());
        };
        let (spare, len) = match flight {
            Reduced::Slice(w) => {
                let (send, recv) = w.wait()?;
                self.shard[at..at + recv.len()].copy_from_slice(&recv);
                (send, recv.len())
            }
            Reduced::Whole(w, r) => {
                let full = w.wait()?;
                self.shard[at..at + r.len()].copy_from_slice(&full[r.clone()]);
                (full, r.len())
            }
        };
        if scale != 1.0 {
            self.shard[at..at + len]
                .iter_mut()
                .for_each(|g| *g *= scale);
        }
        self.spare.push(spare);
        Ok(())
    }

    /// Unscale, agree on overflow and the norm, clip: the gradient shard
    /// is ready to step unless the report says skipped.
    fn finish(&mut self, opts: StepOptions<'_>) -> Result<StepReport> {
        let StepOptions { max_norm, scaler } = opts;
        if let Some(s) = &scaler {
            let inv = s.inv_scale();
            self.shard.iter_mut().for_each(|g| *g *= inv);
        }
        if max_norm.is_none() && scaler.is_none() {
            return Ok(StepReport {
                grad_norm: None,
                skipped: false,
            });
        }
        let local_sq: f64 = self.shard.iter().map(|g| f64::from(*g).powi(2)).sum();
        let local_bad = f64::from(u8::from(self.shard.iter().any(|g| !g.is_finite())));
        let [sq, bad] = if self.plan.world_size() == 1 {
            [local_sq, local_bad]
        } else {
            partials_sum(&*self.comm, [local_sq, local_bad])?
        };
        let norm = sq.sqrt() as f32;
        let skipped = scaler.is_some() && bad > 0.0;
        if let Some(s) = scaler {
            s.update(skipped);
        }
        if let Some(max) = max_norm {
            self.last_norm = Some(norm);
            let coef = max / (norm + 1e-6);
            if coef < 1.0 && !skipped {
                self.shard.iter_mut().for_each(|g| *g *= coef);
            }
        }
        Ok(StepReport {
            grad_norm: max_norm.map(|_| norm),
            skipped,
        })
    }

    /// Step this rank's slices; stages 1-2 then all-gather them into the
    /// model unit by unit (each gather started without waiting, two in
    /// flight: the next unit steps while the previous one travels), stage 3
    /// keeps them.
    fn update_params(&mut self, model: &mut dyn Parameters) -> Result<()> {
        let rank = self.share();
        let mut flights = std::collections::VecDeque::new();
        let (mut first, mut at) = (0, 0);
        for u in 0..self.plan.units().len() {
            let nslots = self.plan.units()[u].slots.len();
            let r = self.plan.shard_range(u, rank);
            let grads = &self.shard[at..at + r.len()];
            if self.stage == Stage::Full {
                self.opt
                    .step_shard(u, &mut self.params[at..at + r.len()], grads)?;
            } else {
                let mut values = self.spare.pop().unwrap_or_default();
                read_unit(
                    model,
                    &self.plan.units()[u],
                    first,
                    Part::Values,
                    &mut values,
                )?;
                let mut mine = values[r.clone()].to_vec();
                self.opt.step_shard(u, &mut mine, grads)?;
                if self.plan.world_size() == 1 {
                    values.copy_from_slice(&mine);
                    write_unit(model, &self.plan.units()[u], first, &values, false)?;
                    self.spare.push(values);
                } else {
                    flights.push_back((u, first, self.comm.start_all_gather(mine, values)?));
                    if flights.len() > 1 {
                        self.write_gathered(model, flights.pop_front())?;
                    }
                }
            }
            first += nslots;
            at += r.len();
        }
        while let Some(f) = flights.pop_front() {
            self.write_gathered(model, Some(f))?;
        }
        if self.stage == Stage::Full {
            self.fresh.fill(false);
        }
        Ok(())
    }

    /// Wait for one unit's gathered values and write them into the model.
    fn write_gathered(
        &mut self,
        model: &mut dyn Parameters,
        flight: Option<Gathered>,
    ) -> Result<()> {
        let Some((u, first, work)) = flight else {
            return Ok(());
        };
        let (_, values) = work.wait()?;
        write_unit(model, &self.plan.units()[u], first, &values, false)?;
        self.spare.push(values);
        Ok(())
    }

    pub(super) fn check_model(&self, model: &dyn Parameters) -> Result<()> {
        let mut got = Vec::new();
        model.visit_params(&mut |p| got.push((p.name.to_string(), p.value.len(), p.grad.len())));
        let want: Vec<_> = self.plan.params().collect();
        // At stage 3 a released unit holds nothing; at stage 2 a unit whose
        // gradients were reduced holds no gradients.
        let full = self.stage == Stage::Full;
        let sharded_grads = full || self.stage == Stage::Gradients;
        let same = got.len() == want.len()
            && got.iter().zip(&want).all(|((n, v, g), (wn, wl))| {
                n == wn
                    && (*v == *wl || (full && *v == 0))
                    && (*g == *wl || (sharded_grads && *g == 0))
            });
        if same {
            Ok(())
        } else {
            Err(Error::invalid_argument(
                "sharded optimizer step",
                "the model's parameters (names, sizes or order) are not the ones the plan was made for",
            )
            .with_fix("make the ZeroOptimizer from this model"))
        }
    }

    /// This rank's slices of `model`'s values, unit after unit.
    pub(super) fn slices_of(&self, model: &dyn Parameters) -> Result<Vec<f32>> {
        let rank = self.share();
        let mut mine = Vec::with_capacity(self.plan.shard_numel());
        let (mut first, mut scratch) = (0, Vec::new());
        for (u, unit) in self.plan.units().iter().enumerate() {
            read_unit(model, unit, first, Part::Values, &mut scratch)?;
            mine.extend_from_slice(&scratch[self.plan.shard_range(u, rank)]);
            first += unit.slots.len();
        }
        Ok(mine)
    }
}
