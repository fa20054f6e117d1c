//! Sharded data parallelism: ZeRO stage 1 (optimizer state) and stage 2
//! (gradients) over any communicator that declares the collectives.
//!
//! Parameters are grouped into *units* (a [`WrapPolicy`] over parameter
//! names, like FSDP's auto-wrap), each unit flattened into one buffer
//! padded to a multiple of the world size. Rank `r` owns the `r`-th equal
//! slice of every unit: it keeps the optimizer state for that slice only
//! and updates only those elements; an all-gather then hands every rank the
//! updated parameters.
//!
//! | stage | gradients | optimizer state | parameters |
//! |---|---|---|---|
//! | [`Stage::None`] | all-reduced, full on every rank | full | full |
//! | [`Stage::Optimizer`] (ZeRO-1) | all-reduced, full | 1/W per rank | full, all-gathered after the step |
//! | [`Stage::Gradients`] (ZeRO-2, FSDP `SHARD_GRAD_OP`) | reduce-scattered: each rank gets its 1/W | 1/W | full, all-gathered after the step |
//!
//! Stage 3 (parameters sharded too, FSDP `FULL_SHARD`) needs the model to
//! materialise a unit's weights just before its forward and release them
//! after; it is refused by name until that hook exists.
//!
//! [`ZeroOptimizer::step`] replaces both the gradient all-reduce and the
//! optimizer step, so use it on a model whose gradients are *not* already
//! synchronised (accumulate micro-batches locally, then step once).

use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;

use accel_api::{
    Buf, Communicator, CommunicatorExt, Error, ErrorKind, HostBuf, HostBufMut, Op, ReduceOp, Result,
};

use crate::train::{Parameters, StateDict};

/// What each rank keeps of the training state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stage {
    /// Everything replicated (DDP).
    #[default]
    None,
    /// ZeRO-1: optimizer state sharded.
    Optimizer,
    /// ZeRO-2: optimizer state and gradients sharded.
    Gradients,
}

impl Stage {
    /// The spelling [`FromStr`] reads back.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::None => "none",
            Stage::Optimizer => "optimizer",
            Stage::Gradients => "gradients",
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Stage {
    type Err = Error;

    /// `none|optimizer|gradients`, also DeepSpeed's stage numbers
    /// (`0`, `1`, `2`, `zero1`, `zero2`) and FSDP's `NO_SHARD` and
    /// `SHARD_GRAD_OP`, case-insensitive.
    fn from_str(s: &str) -> Result<Stage> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "no" | "0" | "zero0" | "no_shard" => Ok(Stage::None),
            "optimizer" | "1" | "zero1" => Ok(Stage::Optimizer),
            "gradients" | "2" | "zero2" | "shard_grad_op" => Ok(Stage::Gradients),
            "full" | "3" | "zero3" | "full_shard" => Err(Error::unsupported(
                "sharding",
                "stage 3 (parameters sharded too) is not available yet: the model \
                 would have to gather each unit's weights before its forward",
            )
            .with_fix("use `gradients` (ZeRO-2), which shards gradients and optimizer state")),
            other => Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("unknown sharding stage {other:?}"),
            )
            .with_fix("use one of none, optimizer, gradients")),
        }
    }
}

/// How parameters are grouped into units. Units are always runs of
/// consecutive parameters in visiting order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WrapPolicy {
    /// One unit holding every parameter.
    Whole,
    /// A unit per run of parameters whose names share their first `n`
    /// dot-separated components (`1`: `fc1.weight` and `fc1.bias` together).
    Depth(usize),
    /// A unit per run of parameters under the same listed module prefix
    /// (`name == p` or `name` starts with `p.`); parameters under none of
    /// them form units of their own runs.
    Prefixes(Vec<String>),
}

impl WrapPolicy {
    fn key(&self, name: &str) -> String {
        match self {
            WrapPolicy::Whole => String::new(),
            WrapPolicy::Depth(n) => name.split('.').take(*n).collect::<Vec<_>>().join("."),
            WrapPolicy::Prefixes(ps) => ps
                .iter()
                .find(|p| {
                    name == p.as_str()
                        || name
                            .strip_prefix(p.as_str())
                            .is_some_and(|r| r.starts_with('.'))
                })
                .cloned()
                .unwrap_or_default(),
        }
    }
}

/// One parameter's place in its unit's flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The parameter's name.
    pub name: String,
    /// First element within the unit.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
}

/// A group of consecutive parameters flattened into one padded buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// The policy's key for the unit (a module prefix; empty for `Whole`).
    pub name: String,
    /// Its parameters, in order.
    pub slots: Vec<Slot>,
    /// Elements before padding.
    pub numel: usize,
    /// Elements after padding to a multiple of the world size.
    pub padded: usize,
}

/// The units of a model and each rank's share of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    world: usize,
    units: Vec<Unit>,
}

impl ShardPlan {
    /// Group `params` (name and element count, in visiting order) into
    /// units under `policy`, padded for `world` ranks.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a world of 0, no parameters, a
    /// repeated name, or sizes that overflow.
    pub fn new(params: &[(String, usize)], policy: &WrapPolicy, world: usize) -> Result<ShardPlan> {
        let bad = |m: String| Error::invalid_argument("sharding plan", m);
        if world == 0 {
            return Err(bad("the world size is 0".into()));
        }
        if params.is_empty() {
            return Err(bad("the model has no parameters".into()));
        }
        let mut seen = std::collections::HashSet::new();
        let mut units: Vec<Unit> = Vec::new();
        let mut last_key = None;
        for (name, numel) in params {
            if !seen.insert(name.as_str()) {
                return Err(bad(format!("parameter {name:?} appears twice")));
            }
            let key = policy.key(name);
            if last_key.as_ref() != Some(&key) {
                units.push(Unit {
                    name: key.clone(),
                    slots: Vec::new(),
                    numel: 0,
                    padded: 0,
                });
                last_key = Some(key);
            }
            let u = units.last_mut().expect("a unit was pushed");
            u.slots.push(Slot {
                name: name.clone(),
                offset: u.numel,
                numel: *numel,
            });
            u.numel = u
                .numel
                .checked_add(*numel)
                .ok_or_else(|| bad(format!("unit {:?} overflows", u.name)))?;
        }
        for u in &mut units {
            u.padded = u
                .numel
                .div_ceil(world)
                .checked_mul(world)
                .ok_or_else(|| bad(format!("unit {:?} overflows", u.name)))?;
        }
        Ok(ShardPlan { world, units })
    }

    /// The plan of `model`'s parameters.
    ///
    /// # Errors
    /// As [`ShardPlan::new`].
    pub fn of_model(
        model: &dyn Parameters,
        policy: &WrapPolicy,
        world: usize,
    ) -> Result<ShardPlan> {
        let mut params = Vec::new();
        model.visit_params(&mut |p| params.push((p.name.to_string(), p.value.len())));
        ShardPlan::new(&params, policy, world)
    }

    /// The number of shares (the world size; 1 for [`Stage::None`]).
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The units, in parameter order.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// The elements of unit `unit` that `rank` owns, as a range of the
    /// unit's padded buffer.
    ///
    /// # Panics
    /// If `unit` or `rank` is out of range.
    pub fn shard_range(&self, unit: usize, rank: usize) -> Range<usize> {
        assert!(rank < self.world, "rank {rank} of {}", self.world);
        let len = self.units[unit].padded / self.world;
        rank * len..(rank + 1) * len
    }

    /// Elements one rank owns across all units (padding included).
    pub fn shard_numel(&self) -> usize {
        self.units.iter().map(|u| u.padded / self.world).sum()
    }

    /// Elements of the model (no padding).
    pub fn numel(&self) -> usize {
        self.units.iter().map(|u| u.numel).sum()
    }

    /// Elements of every unit's padded buffer together.
    fn padded_numel(&self) -> usize {
        self.units.iter().map(|u| u.padded).sum()
    }

    /// `(name, numel)` in order, to compare with a model.
    fn params(&self) -> impl Iterator<Item = (&str, usize)> {
        self.units
            .iter()
            .flat_map(|u| u.slots.iter().map(|s| (s.name.as_str(), s.numel)))
    }
}

/// An elementwise optimizer that can update one rank's slice of a unit.
///
/// Elementwise optimizers (SGD, Adam, ...) give the same values on a slice
/// as on the whole parameter, which is what makes sharding them exact.
pub trait ShardOptimizer: Send {
    /// Update `params` from `grads` (the same length: this rank's slice of
    /// unit `unit`, padding included; padding gradients are 0).
    ///
    /// # Errors
    /// The optimizer's own.
    fn step_shard(&mut self, unit: usize, params: &mut [f32], grads: &[f32]) -> Result<()>;

    /// Called once after every unit was stepped.
    fn finish_step(&mut self);

    /// The learning rate in use.
    fn lr(&self) -> f64;

    /// Replace the learning rate.
    fn set_lr(&mut self, lr: f64);

    /// Elements of optimizer state this rank holds.
    fn state_numel(&self) -> usize;

    /// This rank's optimizer state.
    fn state_dict(&self) -> StateDict;

    /// Restore what [`state_dict`](Self::state_dict) returned.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] for a state this optimizer did not write.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()>;
}

/// [`Sgd`](crate::train::Sgd)'s update (PyTorch's `SGD`) on shards, with
/// momentum buffers for this rank's slices only.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedSgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 for plain SGD).
    pub momentum: f32,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
    /// Optimizer steps taken.
    pub steps: u64,
    buffers: Vec<Option<Vec<f32>>>,
}

impl ShardedSgd {
    /// Plain SGD at `lr`.
    pub fn new(lr: f64) -> ShardedSgd {
        ShardedSgd {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            steps: 0,
            buffers: Vec::new(),
        }
    }

    /// The same optimizer with `momentum`.
    pub fn with_momentum(mut self, momentum: f32) -> ShardedSgd {
        self.momentum = momentum;
        self
    }

    /// The same optimizer with `weight_decay`.
    pub fn with_weight_decay(mut self, weight_decay: f32) -> ShardedSgd {
        self.weight_decay = weight_decay;
        self
    }
}

impl ShardOptimizer for ShardedSgd {
    fn step_shard(&mut self, unit: usize, params: &mut [f32], grads: &[f32]) -> Result<()> {
        if params.len() != grads.len() {
            return Err(Error::invalid_argument(
                "sharded optimizer step",
                format!(
                    "unit {unit}: {} parameters, {} gradients",
                    params.len(),
                    grads.len()
                ),
            ));
        }
        let (lr, mom, wd) = (self.lr as f32, self.momentum, self.weight_decay);
        if mom == 0.0 {
            for (w, g) in params.iter_mut().zip(grads) {
                *w -= lr * (*g + wd * *w);
            }
            return Ok(());
        }
        if self.buffers.len() <= unit {
            self.buffers.resize(unit + 1, None);
        }
        let first = self.buffers[unit].is_none();
        let b = self.buffers[unit].get_or_insert_with(|| vec![0.0; params.len()]);
        if b.len() != params.len() {
            return Err(Error::invalid_argument(
                "sharded optimizer step",
                format!(
                    "unit {unit}: the momentum buffer holds {} elements",
                    b.len()
                ),
            ));
        }
        for ((w, g), b) in params.iter_mut().zip(grads).zip(b.iter_mut()) {
            let d = *g + wd * *w;
            *b = if first { d } else { mom * *b + d };
            *w -= lr * *b;
        }
        Ok(())
    }

    fn finish_step(&mut self) {
        self.steps += 1;
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn state_numel(&self) -> usize {
        self.buffers.iter().flatten().map(Vec::len).sum()
    }

    fn state_dict(&self) -> StateDict {
        let mut s = StateDict::default();
        s.put("lr", &self.lr);
        s.put("momentum", &self.momentum);
        s.put("weight_decay", &self.weight_decay);
        s.put("steps", &self.steps);
        for (u, b) in self.buffers.iter().enumerate() {
            if let Some(b) = b {
                s.put_tensor(format!("momentum_buffer.unit{u}"), b.clone());
            }
        }
        s
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.lr = state.get("lr")?;
        self.momentum = state.get("momentum")?;
        self.weight_decay = state.get("weight_decay")?;
        self.steps = state.get("steps")?;
        self.buffers.clear();
        for (name, t) in &state.tensors {
            let unit = name
                .strip_prefix("momentum_buffer.unit")
                .and_then(|u| u.parse::<usize>().ok())
                .filter(|u| *u < 1 << 20)
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::Corrupt,
                        format!("unexpected sharded SGD state tensor {name:?}"),
                    )
                })?;
            if self.buffers.len() <= unit {
                self.buffers.resize(unit + 1, None);
            }
            self.buffers[unit] = Some(t.data.clone());
        }
        Ok(())
    }
}

/// Gradient synchronisation and the optimizer step of a sharded run, in
/// one collective call.
pub struct ZeroOptimizer<O> {
    comm: Arc<dyn Communicator>,
    plan: ShardPlan,
    stage: Stage,
    opt: O,
    grads: Vec<f32>,
    values: Vec<f32>,
    shard: Vec<f32>,
    last_norm: Option<f32>,
}

impl<O> std::fmt::Debug for ZeroOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroOptimizer")
            .field("stage", &self.stage)
            .field("rank", &self.comm.rank())
            .field("units", &self.plan.units.len())
            .finish_non_exhaustive()
    }
}

impl<O: ShardOptimizer> ZeroOptimizer<O> {
    /// A sharded optimizer for `model` at `stage` over `comm`, units
    /// chosen by `policy`.
    ///
    /// # Errors
    /// [`ErrorKind::Unsupported`] when the communicator does not declare a
    /// collective the stage needs (all-gather; all-reduce for `none` and
    /// `optimizer`; reduce-scatter for `gradients`), naming it and the
    /// backend; the errors of [`ShardPlan::new`].
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
            Stage::Gradients => &[Op::ReduceScatter, Op::AllGather],
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
        let plan = ShardPlan::of_model(model, policy, shares)?;
        Ok(ZeroOptimizer {
            comm,
            plan,
            stage,
            opt,
            grads: Vec::new(),
            values: Vec::new(),
            shard: Vec::new(),
            last_norm: None,
        })
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

    /// The total gradient norm of the last [`step_clipped`](Self::step_clipped).
    pub fn last_grad_norm(&self) -> Option<f32> {
        self.last_norm
    }

    /// Average the gradients across ranks and update the parameters.
    /// Collective: every rank calls it with the same model layout.
    ///
    /// # Behavior
    /// The model's gradients are read (the local sums of this rank's
    /// micro-batches) and left as they are; its values are replaced by the
    /// updated ones on every rank.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when the model's parameters differ
    /// from the plan's (names, sizes, order); the communicator's errors.
    pub fn step(&mut self, model: &mut dyn Parameters) -> Result<()> {
        self.step_inner(model, None).map(|_| ())
    }

    /// As [`step`](Self::step), with the averaged gradients scaled so
    /// their 2-norm is at most `max_norm` first (torch's
    /// `clip_grad_norm_`: coefficient `max_norm / (norm + 1e-6)`, capped at
    /// 1). Returns the total norm before clipping, identical on every rank.
    ///
    /// # Errors
    /// As [`step`](Self::step); [`ErrorKind::InvalidArgument`] for a
    /// negative or non-finite `max_norm`.
    pub fn step_clipped(&mut self, model: &mut dyn Parameters, max_norm: f32) -> Result<f32> {
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            return Err(Error::invalid_argument(
                "clip_grad_norm",
                format!("max_norm {max_norm} is not a finite number >= 0"),
            ));
        }
        self.step_inner(model, Some(max_norm))
    }

    fn check_model(&self, model: &dyn Parameters) -> Result<()> {
        let mut got = Vec::new();
        model.visit_params(&mut |p| got.push((p.name.to_string(), p.value.len(), p.grad.len())));
        let want: Vec<_> = self.plan.params().collect();
        let same = got.len() == want.len()
            && got
                .iter()
                .zip(&want)
                .all(|((n, v, g), (wn, wl))| n == wn && v == wl && g == wl);
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

    /// Where each parameter starts in the concatenated padded units.
    fn places(&self) -> Vec<usize> {
        let mut places = Vec::new();
        let mut base = 0;
        for u in &self.plan.units {
            places.extend(u.slots.iter().map(|s| base + s.offset));
            base += u.padded;
        }
        places
    }

    /// Copy values and gradients into the padded unit layout.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming a parameter whose values or
    /// gradient are not `f32` host memory.
    fn flatten(&mut self, model: &dyn Parameters) -> Result<()> {
        let n = self.plan.padded_numel();
        self.grads.clear();
        self.grads.resize(n, 0.0);
        self.values.clear();
        self.values.resize(n, 0.0);
        let places = self.places();
        let (grads, values) = (&mut self.grads, &mut self.values);
        let (mut i, mut bad) = (0, None);
        model.visit_params(&mut |p| {
            let at = places[i];
            i += 1;
            match (p.grad_f32(), p.value_f32()) {
                (Ok(g), Ok(v)) => {
                    grads[at..at + g.len()].copy_from_slice(g);
                    values[at..at + v.len()].copy_from_slice(v);
                }
                (Err(e), _) | (_, Err(e)) => {
                    bad.get_or_insert(e);
                }
            }
        });
        bad.map_or(Ok(()), Err)
    }

    fn step_inner(&mut self, model: &mut dyn Parameters, clip: Option<f32>) -> Result<f32> {
        self.check_model(model)?;
        self.flatten(model)?;
        let (world, shares) = (self.comm.world_size(), self.plan.world);
        let rank = if shares == 1 { 0 } else { self.comm.rank() };
        let native_avg = self.comm.capabilities().reduce_ops.contains(&ReduceOp::Avg);
        let op = if native_avg {
            ReduceOp::Avg
        } else {
            ReduceOp::Sum
        };
        let scale = if native_avg || world == 1 {
            1.0
        } else {
            1.0 / world as f32
        };
        // This rank's gradient shards of every unit, one after another.
        let shard_len = self.plan.shard_numel();
        self.shard.clear();
        self.shard.resize(shard_len, 0.0);
        let mut base = 0;
        let mut at = 0;
        for (u, unit) in self.plan.units.iter().enumerate() {
            let full = &mut self.grads[base..base + unit.padded];
            let r = self.plan.shard_range(u, rank);
            let mine = &mut self.shard[at..at + r.len()];
            if world == 1 {
                mine.copy_from_slice(full);
            } else if self.stage == Stage::Gradients {
                self.comm.reduce_scatter(
                    Buf::Host(HostBuf::from(&full[..])),
                    HostBufMut::from(&mut mine[..]).into(),
                    op,
                )?;
            } else {
                self.comm.all_reduce_slice(full, op)?;
                mine.copy_from_slice(&full[r.clone()]);
            }
            if scale != 1.0 {
                mine.iter_mut().for_each(|g| *g *= scale);
            }
            base += unit.padded;
            at += r.len();
        }
        let norm = match clip {
            Some(max) => {
                let local: f64 = self
                    .shard
                    .iter()
                    .map(|g| f64::from(*g) * f64::from(*g))
                    .sum();
                let total = if shares == 1 {
                    local
                } else {
                    self.comm.all_reduce_vec(&[local], ReduceOp::Sum)?[0]
                };
                let norm = total.sqrt() as f32;
                let coef = max / (norm + 1e-6);
                if coef < 1.0 {
                    self.shard.iter_mut().for_each(|g| *g *= coef);
                }
                self.last_norm = Some(norm);
                norm
            }
            None => 0.0,
        };
        // Step this rank's slices, then gather every rank's.
        let (mut base, mut at) = (0, 0);
        for (u, unit) in self.plan.units.iter().enumerate() {
            let r = self.plan.shard_range(u, rank);
            let full = &mut self.values[base..base + unit.padded];
            let mut mine = full[r.clone()].to_vec();
            self.opt
                .step_shard(u, &mut mine, &self.shard[at..at + r.len()])?;
            if shares == 1 {
                full.copy_from_slice(&mine);
            } else {
                self.comm.all_gather(
                    Buf::Host(HostBuf::from(&mine[..])),
                    HostBufMut::from(full).into(),
                )?;
            }
            base += unit.padded;
            at += r.len();
        }
        self.opt.finish_step();
        self.write_values(model)?;
        Ok(norm)
    }

    fn write_values(&self, model: &mut dyn Parameters) -> Result<()> {
        let places = self.places();
        let (mut i, mut bad) = (0, None);
        model.visit_params_mut(&mut |mut p| {
            let at = places[i];
            i += 1;
            match p.f32_mut() {
                Ok((v, _)) => v.copy_from_slice(&self.values[at..at + v.len()]),
                Err(e) => {
                    bad.get_or_insert(e);
                }
            }
        });
        bad.map_or(Ok(()), Err)
    }

    fn unit_layout(&self) -> Vec<(String, usize)> {
        let units = self.plan.units.iter();
        units.map(|u| (u.name.clone(), u.numel)).collect()
    }

    /// This rank's shard of the optimizer state, with the layout it was
    /// made for (world size, rank, units), for a sharded checkpoint.
    pub fn state_dict(&self) -> StateDict {
        let mut s = self.opt.state_dict();
        s.put("zero.stage", &self.stage.as_str());
        s.put("zero.world_size", &self.comm.world_size());
        s.put("zero.rank", &self.comm.rank());
        s.put("zero.units", &self.unit_layout());
        s
    }

    /// Restore a state written by [`state_dict`](Self::state_dict) on the
    /// same rank of a run with the same world size and units.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for a state of another world size,
    /// rank or unit layout (naming both); the optimizer's own.
    pub fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let world: usize = state.get("zero.world_size")?;
        let rank: usize = state.get("zero.rank")?;
        let units: Vec<(String, usize)> = state.get("zero.units")?;
        let mine = self.unit_layout();
        if world != self.comm.world_size() || rank != self.comm.rank() || units != mine {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "this sharded optimizer state belongs to rank {rank} of {world} with {} units; \
                     this is rank {} of {} with {} units",
                    units.len(),
                    self.comm.rank(),
                    self.comm.world_size(),
                    mine.len()
                ),
            )
            .with_fix("resume at the world size the checkpoint was written with"));
        }
        let mut inner = state.clone();
        inner.values.retain(|k, _| !k.starts_with("zero."));
        self.opt.load_state_dict(&inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(spec: &[(&str, usize)]) -> Vec<(String, usize)> {
        spec.iter().map(|(n, s)| (n.to_string(), *s)).collect()
    }

    #[test]
    fn units_follow_the_policy_and_pad_to_the_world() {
        let p = params(&[
            ("fc1.weight", 10),
            ("fc1.bias", 3),
            ("fc2.weight", 5),
            ("fc2.bias", 1),
        ]);
        let plan = ShardPlan::new(&p, &WrapPolicy::Depth(1), 4).unwrap();
        let names: Vec<_> = plan.units().iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["fc1", "fc2"]);
        assert_eq!((plan.units()[0].numel, plan.units()[0].padded), (13, 16));
        assert_eq!((plan.units()[1].numel, plan.units()[1].padded), (6, 8));
        assert_eq!(plan.units()[0].slots[1].offset, 10);
        assert_eq!(plan.shard_range(0, 3), 12..16);
        assert_eq!(plan.shard_numel(), 4 + 2);
        assert_eq!(plan.numel(), 19);
        let whole = ShardPlan::new(&p, &WrapPolicy::Whole, 3).unwrap();
        assert_eq!(whole.units().len(), 1);
        assert_eq!(whole.units()[0].padded, 21);
        let pre = ShardPlan::new(&p, &WrapPolicy::Prefixes(vec!["fc2".into()]), 1).unwrap();
        let names: Vec<_> = pre.units().iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["", "fc2"]);
    }

    #[test]
    fn every_element_has_exactly_one_owner() {
        for world in 1..=5 {
            let p = params(&[("a", 7), ("b.x", 1), ("b.y", 11)]);
            let plan = ShardPlan::new(&p, &WrapPolicy::Depth(1), world).unwrap();
            for (u, unit) in plan.units().iter().enumerate() {
                let mut owned = vec![0; unit.padded];
                for r in 0..world {
                    for i in plan.shard_range(u, r) {
                        owned[i] += 1;
                    }
                }
                assert!(owned.iter().all(|&c| c == 1), "world {world} unit {u}");
            }
        }
    }

    #[test]
    fn bad_plans_and_stages_are_errors_naming_the_fix() {
        let p = params(&[("a", 1), ("a", 2)]);
        let e = ShardPlan::new(&p, &WrapPolicy::Whole, 2).unwrap_err();
        assert!(e.to_string().contains("\"a\" appears twice"), "{e}");
        assert!(ShardPlan::new(&params(&[("a", 1)]), &WrapPolicy::Whole, 0).is_err());
        assert!(ShardPlan::new(&[], &WrapPolicy::Whole, 1).is_err());
        let big = params(&[("a", usize::MAX), ("b", 2)]);
        assert!(ShardPlan::new(&big, &WrapPolicy::Whole, 2).is_err());
        for (s, want) in [
            ("NO_SHARD", Stage::None),
            ("zero1", Stage::Optimizer),
            ("Shard_Grad_Op", Stage::Gradients),
            ("gradients", Stage::Gradients),
        ] {
            assert_eq!(s.parse::<Stage>().unwrap(), want);
            assert_eq!(want.as_str().parse::<Stage>().unwrap(), want);
        }
        let e = "FULL_SHARD".parse::<Stage>().unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::Unsupported);
        let e = "zero9".parse::<Stage>().unwrap_err();
        assert!(e.to_string().contains("zero9"), "{e}");
    }

    use crate::train::{ParamMut, ParamRef};

    struct One(Vec<f32>, Vec<f32>);

    impl Parameters for One {
        fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
            f(ParamRef::host("w", &self.0, &self.1))
        }
        fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
            f(ParamMut::host("w", &mut self.0, &mut self.1))
        }
    }

    #[test]
    fn a_sharded_state_loads_only_into_its_own_layout() {
        let comm: Arc<dyn Communicator> = Arc::new(accel_backend_single::communicator(
            accel_api::Device::CPU,
            std::time::Duration::from_secs(1),
        ));
        let mut m = One(vec![1.0; 5], vec![0.5; 5]);
        let sgd = || ShardedSgd::new(0.1).with_momentum(0.9);
        let mut z = ZeroOptimizer::new(
            comm.clone(),
            &m,
            Stage::Gradients,
            &WrapPolicy::Whole,
            sgd(),
        )
        .unwrap();
        z.step(&mut m).unwrap();
        assert_eq!(m.0, vec![0.95; 5]);
        let state = z.state_dict();
        let mut back = ZeroOptimizer::new(
            comm.clone(),
            &m,
            Stage::Gradients,
            &WrapPolicy::Whole,
            sgd(),
        )
        .unwrap();
        back.load_state_dict(&state).unwrap();
        assert_eq!(back.optimizer(), z.optimizer());
        let mut other = state.clone();
        other.put("zero.world_size", &4usize);
        let e = back.load_state_dict(&other).unwrap_err();
        assert!(e.to_string().contains("rank 0 of 4"), "{e}");
        let mut wrong = One(vec![1.0; 6], vec![0.5; 6]);
        let e = z.step(&mut wrong).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    }

    #[test]
    fn sharded_sgd_equals_the_replicated_sgd_elementwise() {
        use crate::train::{Optimizer, Sgd};
        let w: Vec<f32> = (0..9).map(|i| i as f32 * 0.3 - 1.0).collect();
        let mut whole = One(w.clone(), vec![0.0; 9]);
        let mut full = Sgd::new(0.1).with_momentum(0.9).with_weight_decay(0.01);
        let mut sharded = ShardedSgd::new(0.1)
            .with_momentum(0.9)
            .with_weight_decay(0.01);
        let mut parts = w.clone();
        for step in 0..3 {
            let g: Vec<f32> = (0..9).map(|i| ((i * 7 + step) % 5) as f32 - 2.0).collect();
            whole.1.copy_from_slice(&g);
            full.step(&mut whole).unwrap();
            for (u, r) in [0..4, 4..9].into_iter().enumerate() {
                sharded.step_shard(u, &mut parts[r.clone()], &g[r]).unwrap();
            }
            sharded.finish_step();
        }
        assert_eq!(whole.0, parts);
        assert_eq!(sharded.state_numel(), 9);
        let mut back = ShardedSgd::new(0.0);
        back.load_state_dict(&sharded.state_dict()).unwrap();
        assert_eq!(back, sharded);
    }
}
