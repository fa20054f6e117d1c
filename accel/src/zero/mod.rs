//! Sharded data parallelism: ZeRO stage 1 (optimizer state), stage 2
//! (gradients) and stage 3 (parameters) over any communicator that
//! declares the collectives.
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
//! | [`Stage::Full`] (ZeRO-3, FSDP `FULL_SHARD`) | reduce-scattered per unit right after its backward, then freed | 1/W | 1/W; a unit is all-gathered just before its use and freed after |
//!
//! [`ZeroOptimizer::step`] replaces both the gradient all-reduce and the
//! optimizer step, so use it on a model whose gradients are *not* already
//! synchronised (accumulate micro-batches locally, then step once).
//!
//! At stage 3 the model runs unit by unit through a [`UnitGate`] (the
//! optimizer is one): [`UnitGate::gather`] before a unit's forward and
//! again before its backward, [`UnitGate::release`] after its forward,
//! [`UnitGate::reduce_grads`] after its backward. At the other stages
//! those calls do nothing, so one model code path serves every stage.

use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;

mod prefetch;

use accel_api::{
    Buf, Communicator, CommunicatorExt, DType, Error, ErrorKind, HostBuf, HostBufMut, Op, ReduceOp,
    Result,
};

use crate::train::{
    try_visit_params, try_visit_params_mut, Checkpointed, GradScaler, ParamMut, ParamRef,
    Parameters, StateDict,
};

/// The environment variable [`TrainConfig::sharding`](crate::train::TrainConfig::sharding)
/// falls back to (`none|optimizer|gradients|full`, or any spelling
/// [`Stage`]'s `FromStr` reads).
pub const SHARDING_ENV: &str = "ACCEL_SHARDING";

/// What each rank keeps of the training state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// Everything replicated (DDP).
    #[default]
    None,
    /// ZeRO-1: optimizer state sharded.
    Optimizer,
    /// ZeRO-2: optimizer state and gradients sharded.
    Gradients,
    /// ZeRO-3: optimizer state, gradients and parameters sharded.
    Full,
}

impl Stage {
    /// The spelling [`FromStr`] reads back.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::None => "none",
            Stage::Optimizer => "optimizer",
            Stage::Gradients => "gradients",
            Stage::Full => "full",
        }
    }
}

impl Stage {
    /// The stage [`SHARDING_ENV`] names; `None` when it is unset or empty.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the variable for an unknown
    /// stage.
    pub fn from_env() -> Result<Option<Stage>> {
        Stage::from_env_value(std::env::var(SHARDING_ENV).ok().as_deref())
    }

    /// A value of [`SHARDING_ENV`] (read from the process environment or
    /// from a worker's); `None` when absent or empty.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_env_value(value: Option<&str>) -> Result<Option<Stage>> {
        match value {
            Some(v) if !v.trim().is_empty() => v.parse().map(Some).map_err(|e: Error| {
                Error::invalid_config(SHARDING_ENV, v, e.message().to_string())
                    .with_fix("set it to none, optimizer, gradients or full")
            }),
            _ => Ok(None),
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

    /// `none|optimizer|gradients|full`, also DeepSpeed's stage numbers
    /// (`0`-`3`, `zero1`-`zero3`) and FSDP's `NO_SHARD`, `SHARD_GRAD_OP`
    /// and `FULL_SHARD`, case-insensitive.
    fn from_str(s: &str) -> Result<Stage> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "no" | "0" | "zero0" | "no_shard" => Ok(Stage::None),
            "optimizer" | "1" | "zero1" => Ok(Stage::Optimizer),
            "gradients" | "2" | "zero2" | "shard_grad_op" => Ok(Stage::Gradients),
            "full" | "3" | "zero3" | "full_shard" => Ok(Stage::Full),
            other => Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("unknown sharding stage {other:?}"),
            )
            .with_fix("use one of none, optimizer, gradients, full")),
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

    /// Check the state just loaded against the lengths of this rank's
    /// slices, one per unit (what [`step_shard`](Self::step_shard) will
    /// be given), so that a checkpoint of another layout fails at load
    /// rather than at the next step. The default accepts any state.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] naming the unit, the state entry and both
    /// lengths.
    fn check_shards(&self, lens: &[usize]) -> Result<()> {
        let _ = lens;
        Ok(())
    }
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
            crate::train::optim::sgd_update(params, grads, lr, wd, None);
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
                    "unit {unit}: the momentum buffer holds {} elements, this rank's slice {}",
                    b.len(),
                    params.len()
                ),
            ));
        }
        crate::train::optim::sgd_update(params, grads, lr, wd, Some((mom, b, first)));
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

    fn check_shards(&self, lens: &[usize]) -> Result<()> {
        for (u, b) in self.buffers.iter().enumerate() {
            let Some(b) = b else { continue };
            let want = lens.get(u).copied();
            if want != Some(b.len()) {
                let slice = want.map_or("this run has no such unit".to_string(), |n| {
                    format!("this rank's slice of unit {u} has {n}")
                });
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!(
                        "sharded SGD state `momentum_buffer.unit{u}` holds {} elements; {slice}",
                        b.len()
                    ),
                )
                .with_fix("resume from a checkpoint written by this model, stage and world size"));
            }
        }
        Ok(())
    }
}

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

/// The hooks a model calls around each unit when it runs unit by unit,
/// so that ZeRO stage 3 can hold only this rank's shard of the
/// parameters between uses. [`ZeroOptimizer`] implements it (the calls do
/// nothing below stage 3); [`NoGate`] is the unsharded one.
///
/// A model names its modules (`"fc1"`: the parameters `fc1` and
/// `fc1.*`); each call acts on every unit holding parameters of that
/// module. The order per micro-batch: for each module in forward order
/// `gather`, its forward, `release` (the last may skip it); then for each
/// module in backward order `gather`, its backward, `reduce_grads`. Every
/// rank makes the same calls in the same order (they are collectives at
/// stage 3). Units coarser than the modules stay correct (a unit's
/// gradients may be reduced in parts, which add up) at the cost of extra
/// gathers.
pub trait UnitGate {
    /// Make the full parameter values of the units of `module` present in
    /// `model` (an all-gather of the shards at stage 3, for each unit whose
    /// copy in the model is not current). A unit gathered anew starts with
    /// zero gradients.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a module with no parameters or a
    /// model whose parameters are not the plan's; the communicator's
    /// errors.
    fn gather(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()>;

    /// Free the parameters of the units of `module` in `model` (stage 3,
    /// [`Parameters::set_param_storage`] with 0).
    ///
    /// # Errors
    /// As [`gather`](Self::gather); the model's own.
    fn release(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()>;

    /// After `module`'s backward: at stage 3, reduce-scatter the gradients
    /// of its units (averaged over ranks) into this rank's gradient shard,
    /// added to what is there already, and free the units.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when a parameter of a unit holds no
    /// gradient (the unit was not gathered before the backward); as
    /// [`gather`](Self::gather).
    fn reduce_grads(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()>;
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

/// The gate of an unsharded model: every call does nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoGate;

impl UnitGate for NoGate {
    fn gather(&mut self, _: &mut dyn Parameters, _: &str) -> Result<()> {
        Ok(())
    }
    fn release(&mut self, _: &mut dyn Parameters, _: &str) -> Result<()> {
        Ok(())
    }
    fn reduce_grads(&mut self, _: &mut dyn Parameters, _: &str) -> Result<()> {
        Ok(())
    }
}

/// Every parameter's full values, gathered from the shards: what
/// [`Accelerator::save_model`](crate::Accelerator::save_model) writes
/// (it is a [`Parameters`] whose gradients are empty).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FullParameters {
    /// `(name, values)` in the model's order.
    pub params: Vec<(String, Vec<f32>)>,
}

impl Parameters for FullParameters {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        for (name, v) in &self.params {
            f(ParamRef::host(name, v, &[] as &[f32]));
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        for (name, v) in &mut self.params {
            f(ParamMut::host(name, v, &mut [] as &mut [f32]));
        }
    }
}

/// What [`Parameters::set_param_storage`] does to a model that keeps a
/// buffer in a `Vec<f32>`: free it for `numel == 0`, else resize it to
/// `numel` (zero-filled where it grows, kept where it has them already).
/// A model's backward can give a gradient freed by
/// [`Parameters::release_grad`] back the same way.
pub fn resize_host_storage(v: &mut Vec<f32>, numel: usize) {
    if numel == 0 {
        *v = Vec::new();
    } else {
        v.resize(numel, 0.0);
    }
}

/// A parameter's values or its gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Values,
    Grads,
}

/// Copy `unit`'s values or gradients (its parameters are those from index
/// `first` in visiting order) into `dst`, resized to the unit's padded
/// length with zero padding.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] naming a parameter whose buffer is not
/// `f32` host memory or not of the plan's length (a released unit).
fn read_unit(
    model: &dyn Parameters,
    unit: &Unit,
    first: usize,
    part: Part,
    dst: &mut Vec<f32>,
) -> Result<()> {
    dst.clear();
    dst.resize(unit.padded, 0.0);
    try_visit_params(model, |k, p| {
        let Some(s) = k.checked_sub(first).and_then(|j| unit.slots.get(j)) else {
            return Ok(());
        };
        let src = match part {
            Part::Values => p.value_f32()?,
            Part::Grads => p.grad_f32()?,
        };
        if part == Part::Grads && src.is_empty() {
            // A freed gradient the backward did not write: zeros.
            return Ok(());
        }
        if src.len() != s.numel {
            let (what, fix) = match part {
                Part::Values => ("values", "gather the unit before reading its values"),
                Part::Grads => ("gradients", "gather the unit before its backward"),
            };
            return Err(Error::invalid_argument(
                "sharding",
                format!(
                    "parameter {:?} holds {} {what}; the plan has {}",
                    s.name,
                    src.len(),
                    s.numel
                ),
            )
            .with_fix(fix));
        }
        dst[s.offset..s.offset + s.numel].copy_from_slice(src);
        Ok(())
    })
}

/// Call `f` with each parameter of `unit` (from index `first`): its slot,
/// values and gradient as `f32` host memory.
fn visit_unit_mut(
    model: &mut dyn Parameters,
    unit: &Unit,
    first: usize,
    mut f: impl FnMut(&Slot, &mut [f32], &mut [f32]) -> Result<()>,
) -> Result<()> {
    try_visit_params_mut(model, |k, mut p| {
        let Some(s) = k.checked_sub(first).and_then(|j| unit.slots.get(j)) else {
            return Ok(());
        };
        let (v, g) = p.f32_mut()?;
        f(s, v, g)
    })
}

/// Write `src` (the unit's padded layout) into `unit`'s values; with
/// `zero_grads` also set its gradients to 0.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] naming a parameter without room for its
/// values (or gradients), or not `f32` host memory.
fn write_unit(
    model: &mut dyn Parameters,
    unit: &Unit,
    first: usize,
    src: &[f32],
    zero_grads: bool,
) -> Result<()> {
    visit_unit_mut(model, unit, first, |s, v, g| {
        if v.len() != s.numel || (zero_grads && g.len() != s.numel) {
            return Err(Error::invalid_argument(
                "sharding gather",
                format!(
                    "parameter {:?} has room for {} values and {} gradients; it needs {}",
                    s.name,
                    v.len(),
                    g.len(),
                    s.numel
                ),
            )
            .with_fix("implement Parameters::set_param_storage to give it that room"));
        }
        v.copy_from_slice(&src[s.offset..s.offset + s.numel]);
        if zero_grads {
            g.fill(0.0);
        }
        Ok(())
    })
}

/// Gradient synchronisation and the optimizer step of a sharded run, in
/// one collective call; at stage 3 also the keeper of the parameter
/// shards.
pub struct ZeroOptimizer<O> {
    comm: Arc<dyn Communicator>,
    plan: ShardPlan,
    stage: Stage,
    opt: O,
    key: String,
    /// Scratch for one unit's padded gradients (the unit being reduced).
    grads: Vec<f32>,
    /// Scratch for one unit's padded values (the unit being gathered).
    values: Vec<f32>,
    /// This rank's averaged gradient slices, unit after unit.
    shard: Vec<f32>,
    /// Stage 3: this rank's slices of the parameters, unit after unit.
    params: Vec<f32>,
    /// Stage 3: received reduce-scatter slice.
    recv: Vec<f32>,
    /// Stage 3: the model's copy of the unit is current.
    fresh: Vec<bool>,
    /// Stage 3: the unit's gradients were reduced since the last step.
    reduced: Vec<bool>,
    last_norm: Option<f32>,
    /// Stage 3: the next unit's gather on a thread of its own.
    prefetch: Option<prefetch::Prefetcher>,
    /// Stage 3: the units of the gathers that needed data, in call order,
    /// as recorded over one step.
    order: Vec<usize>,
    /// Stage 3: `order` is being recorded (the first step, or after the
    /// model's calls changed).
    recording: bool,
    /// Stage 3: this step's calls left the recorded order.
    diverged: bool,
    /// Stage 3: gathers that needed data so far this step.
    pos: usize,
    /// Stage 3: gathers served by the prefetch.
    prefetched: u64,
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
    /// chosen by `policy`. At [`Stage::Full`] it keeps this rank's slices
    /// of `model`'s current values (every rank must start from the same
    /// ones) and the model's own copy counts as out of date: the first
    /// [`UnitGate::gather`] of each unit all-gathers it, and
    /// `release(&mut model, "")` frees it at once
    /// ([`Accelerator::prepare_zero`](crate::Accelerator::prepare_zero)
    /// does). Collective at stage 3 (the prefetch's communicator is split
    /// off here).
    ///
    /// # Errors
    /// [`ErrorKind::Unsupported`] when the communicator does not declare a
    /// collective the stage needs (all-gather; all-reduce for `none` and
    /// `optimizer`; reduce-scatter for `gradients` and `full`), naming it
    /// and the backend; the errors of [`ShardPlan::new`];
    /// [`ErrorKind::InvalidArgument`] at stage 3 when a value is not `f32`
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
        let plan = ShardPlan::of_model(model, policy, shares)?;
        let units = plan.units.len();
        let mut z = ZeroOptimizer {
            comm,
            plan,
            stage,
            opt,
            key: "zero_0".into(),
            grads: Vec::new(),
            values: Vec::new(),
            shard: Vec::new(),
            params: Vec::new(),
            recv: Vec::new(),
            fresh: vec![false; units],
            reduced: vec![false; units],
            last_norm: None,
            prefetch: None,
            order: Vec::new(),
            recording: true,
            diverged: false,
            pos: 0,
            prefetched: 0,
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

    /// Wait for and drop the prefetch in flight (its values are out of
    /// date or unwanted).
    fn drain_prefetch(&mut self) -> Result<()> {
        self.take_prefetched().map(drop)
    }

    /// The prefetch's answer, if a gather is in flight. After an error the
    /// prefetch is turned off, so that no late answer is taken for a later
    /// gather.
    fn take_prefetched(&mut self) -> Result<Option<(usize, Vec<f32>)>> {
        let Some(p) = self.prefetch.as_mut() else {
            return Ok(None);
        };
        let r = p.take();
        if r.is_err() {
            self.prefetch = None;
        }
        r
    }

    /// The end of a step's calls: keep the recorded order, or record anew
    /// when this step's calls left it.
    fn end_window(&mut self) -> Result<()> {
        self.drain_prefetch()?;
        if self.diverged {
            self.order.clear();
            self.recording = true;
            self.diverged = false;
        } else if self.recording && !self.order.is_empty() {
            self.recording = false;
        }
        self.pos = 0;
        Ok(())
    }

    /// A gather of `unit` that needed data happened: record it, or check
    /// it against the order and start gathering the next unit.
    fn advance(&mut self, unit: usize) -> Result<()> {
        if self.diverged {
            return Ok(());
        }
        if self.recording {
            self.order.push(unit);
            return Ok(());
        }
        if self.order.get(self.pos) != Some(&unit) {
            self.diverged = true;
            return Ok(());
        }
        self.pos += 1;
        let Some(&next) = self.order.get(self.pos) else {
            return Ok(());
        };
        if self.prefetch.is_none() {
            return Ok(());
        }
        let (_, at) = self.unit_span(next)?;
        let padded = self.plan.units[next].padded;
        let shard = self.params[at..at + padded / self.plan.world].to_vec();
        match self.prefetch.as_mut() {
            Some(p) => p.issue(next, shard, padded),
            None => Ok(()),
        }
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
        [
            &self.grads,
            &self.values,
            &self.shard,
            &self.params,
            &self.recv,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum()
    }

    /// The index of the unit called `name`.
    pub fn unit_named(&self, name: &str) -> Option<usize> {
        self.plan.units.iter().position(|u| u.name == name)
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
    /// [`UnitGate::reduce_grads`] accumulated are stepped and cleared; the
    /// model's copies of the units become out of date (gather before use).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when the model's parameters differ
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
    /// As [`step`](Self::step); [`ErrorKind::InvalidArgument`] for a
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
        let gated = self.stage == Stage::Full
            || (self.stage == Stage::Gradients && self.reduced.iter().any(|r| *r));
        if gated {
            if let Some(u) = self.reduced.iter().position(|r| !r) {
                return Err(Error::invalid_argument(
                    "sharded optimizer step",
                    format!(
                        "unit {u} ({:?}) had no gradients reduced since the last step",
                        self.plan.units[u].name
                    ),
                )
                .with_fix("call reduce_grads(model, module) after every module's backward"));
            }
        } else {
            self.check_model(model)?;
            self.reduce_all(model)?;
        }
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

    /// The reduce op and the factor that make a sum an average.
    fn avg_op(&self) -> (ReduceOp, f32) {
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
    fn share(&self) -> usize {
        if self.plan.world == 1 {
            0
        } else {
            self.comm.rank()
        }
    }

    /// Stages 0-2: this rank's averaged gradient slices into `shard`, one
    /// unit at a time (one unit's scratch, not a copy of the model).
    fn reduce_all(&mut self, model: &dyn Parameters) -> Result<()> {
        let world = self.comm.world_size();
        let rank = self.share();
        let (op, scale) = self.avg_op();
        self.shard.clear();
        self.shard.resize(self.plan.shard_numel(), 0.0);
        let (mut first, mut at) = (0, 0);
        for (u, unit) in self.plan.units.iter().enumerate() {
            read_unit(model, unit, first, Part::Grads, &mut self.grads)?;
            let full = &mut self.grads[..];
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
            first += unit.slots.len();
            at += r.len();
        }
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
        let [sq, bad] = if self.plan.world == 1 {
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
    /// model unit by unit, stage 3 keeps them.
    fn update_params(&mut self, model: &mut dyn Parameters) -> Result<()> {
        let rank = self.share();
        let (mut first, mut at) = (0, 0);
        for (u, unit) in self.plan.units.iter().enumerate() {
            let r = self.plan.shard_range(u, rank);
            let grads = &self.shard[at..at + r.len()];
            if self.stage == Stage::Full {
                self.opt
                    .step_shard(u, &mut self.params[at..at + r.len()], grads)?;
            } else {
                read_unit(model, unit, first, Part::Values, &mut self.values)?;
                let mut mine = self.values[r.clone()].to_vec();
                self.opt.step_shard(u, &mut mine, grads)?;
                if self.plan.world == 1 {
                    self.values.copy_from_slice(&mine);
                } else {
                    self.comm.all_gather(
                        Buf::Host(HostBuf::from(&mine[..])),
                        HostBufMut::from(&mut self.values[..]).into(),
                    )?;
                }
                write_unit(model, unit, first, &self.values, false)?;
            }
            first += unit.slots.len();
            at += r.len();
        }
        if self.stage == Stage::Full {
            self.fresh.fill(false);
        }
        Ok(())
    }

    fn check_model(&self, model: &dyn Parameters) -> Result<()> {
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
    fn slices_of(&self, model: &dyn Parameters) -> Result<Vec<f32>> {
        let rank = self.share();
        let mut mine = Vec::with_capacity(self.plan.shard_numel());
        let (mut first, mut scratch) = (0, Vec::new());
        for (u, unit) in self.plan.units.iter().enumerate() {
            read_unit(model, unit, first, Part::Values, &mut scratch)?;
            mine.extend_from_slice(&scratch[self.plan.shard_range(u, rank)]);
            first += unit.slots.len();
        }
        Ok(mine)
    }

    /// Unit `unit`'s parameter indices (visiting order) and where its
    /// shard starts in `shard`/`params`.
    fn unit_span(&self, unit: usize) -> Result<(Range<usize>, usize)> {
        if unit >= self.plan.units.len() {
            return Err(Error::invalid_argument(
                "sharding",
                format!(
                    "unit {unit} does not exist: the plan has {} units",
                    self.plan.units.len()
                ),
            ));
        }
        let first: usize = self.plan.units[..unit].iter().map(|u| u.slots.len()).sum();
        let at = self.plan.units[..unit]
            .iter()
            .map(|u| u.padded / self.plan.world)
            .sum();
        Ok((first..first + self.plan.units[unit].slots.len(), at))
    }

    /// All-gather unit `unit` into `values` (stage 3).
    fn gather_unit(&mut self, unit: usize, at: usize) -> Result<()> {
        let padded = self.plan.units[unit].padded;
        let len = padded / self.plan.world;
        self.values.clear();
        self.values.resize(padded, 0.0);
        let mine = &self.params[at..at + len];
        if self.plan.world == 1 {
            self.values.copy_from_slice(mine);
        } else {
            self.comm.all_gather(
                Buf::Host(HostBuf::from(mine)),
                HostBufMut::from(&mut self.values[..]).into(),
            )?;
        }
        Ok(())
    }

    /// Every parameter's full current values (collective at stage 3: one
    /// all-gather per unit), e.g. for
    /// [`Accelerator::save_model`](crate::Accelerator::save_model), which
    /// then writes the Hugging Face layout that loads at any world size.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when a value of `model` is not `f32`
    /// host memory (stages 0-2: the model's values are the parameters);
    /// the communicator's errors.
    pub fn full_parameters(&mut self, model: &dyn Parameters) -> Result<FullParameters> {
        let mut out = FullParameters::default();
        if self.stage != Stage::Full {
            try_visit_params(model, |_, p| {
                out.params
                    .push((p.name.to_string(), p.value_f32()?.to_vec()));
                Ok(())
            })?;
            return Ok(out);
        }
        for u in 0..self.plan.units.len() {
            let (_, at) = self.unit_span(u)?;
            self.gather_unit(u, at)?;
            for s in &self.plan.units[u].slots {
                let v = self.values[s.offset..s.offset + s.numel].to_vec();
                out.params.push((s.name.clone(), v));
            }
        }
        Ok(out)
    }

    fn unit_layout(&self) -> Vec<(String, usize)> {
        let units = self.plan.units.iter();
        units.map(|u| (u.name.clone(), u.numel)).collect()
    }

    /// This rank's shard of the optimizer state (and at stage 3 of the
    /// parameters, tensor `zero.params`), with the layout it was made for
    /// (stage, world size, rank, units), for a sharded checkpoint. Take it
    /// between steps: gradients are not part of it.
    pub fn state_dict(&self) -> StateDict {
        let mut s = self.opt.state_dict();
        s.put("zero.stage", &self.stage.as_str());
        s.put("zero.world_size", &self.comm.world_size());
        s.put("zero.rank", &self.comm.rank());
        s.put("zero.units", &self.unit_layout());
        if self.stage == Stage::Full {
            s.put_tensor("zero.params", self.params.clone());
        }
        s
    }

    /// Restore a state written by [`state_dict`](Self::state_dict) on the
    /// same rank of a run with the same stage, world size and units.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] for a state of another stage, world
    /// size, rank or unit layout (naming both); [`ErrorKind::Corrupt`]
    /// for a parameter shard of the wrong size; the optimizer's own.
    pub fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let stage: String = state.get("zero.stage")?;
        let world: usize = state.get("zero.world_size")?;
        let rank: usize = state.get("zero.rank")?;
        let units: Vec<(String, usize)> = state.get("zero.units")?;
        let mine = self.unit_layout();
        if stage != self.stage.as_str()
            || world != self.comm.world_size()
            || rank != self.comm.rank()
            || units != mine
        {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "this sharded optimizer state belongs to stage {stage}, rank {rank} of {world} \
                     with {} units; this is stage {}, rank {} of {} with {} units",
                    units.len(),
                    self.stage,
                    self.comm.rank(),
                    self.comm.world_size(),
                    mine.len()
                ),
            )
            .with_fix("resume at the stage and world size the checkpoint was written with"));
        }
        let mut inner = state.clone();
        inner.values.retain(|k, _| !k.starts_with("zero."));
        let params = inner.tensors.remove("zero.params");
        if self.stage == Stage::Full {
            let p = params.ok_or_else(|| {
                Error::new(
                    ErrorKind::Corrupt,
                    "the stage-3 state holds no parameter shard `zero.params`",
                )
            })?;
            if p.data.len() != self.plan.shard_numel() {
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!(
                        "the parameter shard holds {} elements; this rank's shard has {}",
                        p.data.len(),
                        self.plan.shard_numel()
                    ),
                ));
            }
            self.load_opt(&inner)?;
            self.drain_prefetch()?;
            self.pos = 0;
            self.params = p.data;
            self.fresh.fill(false);
            self.shard.fill(0.0);
            self.reduced.fill(false);
            return Ok(());
        }
        self.load_opt(&inner)
    }

    fn load_opt(&mut self, state: &StateDict) -> Result<()> {
        self.opt.load_state_dict(state)?;
        let lens: Vec<usize> = self
            .plan
            .units
            .iter()
            .map(|u| u.padded / self.plan.world)
            .collect();
        self.opt.check_shards(&lens)
    }
}

impl<O: ShardOptimizer> UnitGate for ZeroOptimizer<O> {
    fn gather(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()> {
        for u in self.units_of(module)? {
            self.gather_one(model, u)?;
        }
        Ok(())
    }

    fn release(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()> {
        for u in self.units_of(module)? {
            self.release_one(model, u)?;
        }
        Ok(())
    }

    fn reduce_grads(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()> {
        for u in self.units_of(module)? {
            self.reduce_one(model, u)?;
        }
        Ok(())
    }
}

impl<O: ShardOptimizer> ZeroOptimizer<O> {
    /// The units holding parameters of `module` (`""`: every unit).
    fn units_of(&self, module: &str) -> Result<Vec<usize>> {
        let under = |name: &str| {
            module.is_empty()
                || name == module
                || name
                    .strip_prefix(module)
                    .is_some_and(|r| r.starts_with('.'))
        };
        let units: Vec<usize> = (self.plan.units.iter().enumerate())
            .filter(|(_, u)| u.slots.iter().any(|s| under(&s.name)))
            .map(|(i, _)| i)
            .collect();
        if units.is_empty() {
            return Err(Error::invalid_argument(
                "sharding",
                format!("the model has no parameters under module {module:?}"),
            )
            .with_fix("name a module by its parameters' prefix (`fc1` for `fc1.weight`)"));
        }
        Ok(units)
    }

    fn gather_one(&mut self, model: &mut dyn Parameters, unit: usize) -> Result<()> {
        let (span, at) = self.unit_span(unit)?;
        if self.stage != Stage::Full {
            return Ok(());
        }
        let in_flight = self.prefetch.as_ref().and_then(|p| p.in_flight());
        if self.fresh[unit] {
            if in_flight == Some(unit) {
                self.drain_prefetch()?;
            }
            return Ok(());
        }
        let prefetched = match self.take_prefetched()? {
            Some((w, v)) if w == unit => Some(v),
            Some(_) => {
                self.diverged = true;
                None
            }
            None => None,
        };
        match prefetched {
            Some(v) => {
                self.values = v;
                self.prefetched += 1;
            }
            None => self.gather_unit(unit, at)?,
        }
        let unit_ref = &self.plan.units[unit];
        for s in &unit_ref.slots {
            model.set_param_storage(&s.name, s.numel)?;
        }
        write_unit(model, unit_ref, span.start, &self.values, true)?;
        self.fresh[unit] = true;
        self.advance(unit)
    }

    fn release_one(&mut self, model: &mut dyn Parameters, unit: usize) -> Result<()> {
        self.unit_span(unit)?;
        if self.stage != Stage::Full {
            return Ok(());
        }
        for s in &self.plan.units[unit].slots {
            model.set_param_storage(&s.name, 0)?;
        }
        self.fresh[unit] = false;
        Ok(())
    }

    fn reduce_one(&mut self, model: &mut dyn Parameters, unit: usize) -> Result<()> {
        let (span, at) = self.unit_span(unit)?;
        if !matches!(self.stage, Stage::Gradients | Stage::Full) {
            return Ok(());
        }
        let len = self.plan.units[unit].padded / self.plan.world;
        let unit_ref = &self.plan.units[unit];
        read_unit(model, unit_ref, span.start, Part::Grads, &mut self.grads)?;
        let (op, scale) = self.avg_op();
        self.recv.clear();
        self.recv.resize(len, 0.0);
        if self.plan.world == 1 {
            self.recv.copy_from_slice(&self.grads);
        } else {
            self.comm.reduce_scatter(
                Buf::Host(HostBuf::from(&self.grads[..])),
                HostBufMut::from(&mut self.recv[..]).into(),
                op,
            )?;
        }
        for (acc, g) in self.shard[at..at + len].iter_mut().zip(&self.recv) {
            *acc += scale * g;
        }
        self.reduced[unit] = true;
        if self.stage == Stage::Full {
            return self.release_one(model, unit);
        }
        // Stage 2: the next backward starts from zero, and the unit's
        // gradients need no memory until then.
        visit_unit_mut(model, &self.plan.units[unit], span.start, |_, _, g| {
            g.fill(0.0);
            Ok(())
        })?;
        for s in &self.plan.units[unit].slots {
            model.release_grad(&s.name)?;
        }
        Ok(())
    }
}

impl<O: ShardOptimizer> Checkpointed for ZeroOptimizer<O> {
    fn checkpoint_key(&self) -> String {
        self.key.clone()
    }

    /// Every rank saves its own shard.
    fn per_rank(&self) -> bool {
        true
    }

    fn checkpoint_state(&self) -> Result<StateDict> {
        Ok(self.state_dict())
    }

    fn restore_checkpoint_state(&mut self, state: StateDict) -> Result<()> {
        self.load_state_dict(&state)
    }

    /// The shards must be ranks `0..W` of one layout, in order.
    fn check_rank_states(&self, states: &[StateDict]) -> Result<()> {
        /// Stage, world size, rank, units.
        type Head = (String, usize, usize, Vec<(String, usize)>);
        let head = |s: &StateDict| -> Result<Head> {
            Ok((
                s.get("zero.stage")?,
                s.get("zero.world_size")?,
                s.get("zero.rank")?,
                s.get("zero.units")?,
            ))
        };
        let first = states.first().map(head).transpose()?;
        for (r, s) in states.iter().enumerate() {
            let (stage, world, rank, units) = head(s)?;
            let same_run = first.as_ref().is_some_and(|f| f.0 == stage && f.3 == units);
            if world != states.len() || rank != r || !same_run {
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!(
                        "the sharded optimizer state loaded by rank {r} is rank {rank} of {world} \
                         (stage {stage}, {} units); {} ranks are loading",
                        units.len(),
                        states.len()
                    ),
                )
                .with_fix("load a checkpoint written by a run of this world size, every rank from the same folder"));
            }
        }
        Ok(())
    }
}

impl crate::Accelerator {
    /// The sharding stage in force: [`TrainConfig::sharding`](crate::train::TrainConfig::sharding),
    /// else [`SHARDING_ENV`], else [`Stage::None`].
    pub fn sharding(&self) -> Stage {
        crate::train::shared(self).lock().sharding
    }

    /// A [`ZeroOptimizer`] for a prepared model at the configured stage
    /// ([`sharding`](Self::sharding)) over this accelerator's
    /// communicator, units by `policy`. From then on
    /// [`backward`](Self::backward) leaves the model's gradients local:
    /// the optimizer reduces them (stages 0-2 in
    /// [`zero_step`](Self::zero_step), stage 3 in
    /// [`UnitGate::reduce_grads`]). The prepared model's values are the
    /// same on every rank (prepare broadcast them), which stage 3 shards.
    ///
    /// # Errors
    /// As [`ZeroOptimizer::new`].
    pub fn prepare_zero<M: Parameters, O: ShardOptimizer>(
        &self,
        model: &mut crate::train::PreparedModel<M>,
        policy: &WrapPolicy,
        opt: O,
    ) -> Result<ZeroOptimizer<O>> {
        let mut zero = ZeroOptimizer::new(
            self.comm().clone(),
            &model.model,
            self.sharding(),
            policy,
            opt,
        )?;
        // Stage 3: the model's own copy is out of date already; free it now.
        zero.release(&mut model.model, "")?;
        model.sharded = true;
        Ok(zero.with_checkpoint_key(format!("zero_{}", model.key)))
    }

    /// The optimizer step of a sharded run on a batch where the
    /// accumulation cadence steps (Accelerate's `optimizer.step()` under
    /// DeepSpeed): `Ok(None)` inside an accumulation group. In fp16 the
    /// accelerator's loss scaler unscales the gradients, an overflow on
    /// any rank skips the step on every rank
    /// ([`optimizer_step_was_skipped`](Self::optimizer_step_was_skipped))
    /// and the scaler is updated. `max_norm` clips the averaged gradients
    /// first. Collective.
    ///
    /// # Errors
    /// As [`ZeroOptimizer::step_with`].
    pub fn zero_step<M: Parameters, O: ShardOptimizer>(
        &self,
        zero: &mut ZeroOptimizer<O>,
        model: &mut crate::train::PreparedModel<M>,
        max_norm: Option<f32>,
    ) -> Result<Option<StepReport>> {
        let shared = crate::train::shared(self);
        if !shared.decision().optimizer_step {
            return Ok(None);
        }
        let mut scaler = shared.lock().amp.scaler;
        let opts = StepOptions {
            max_norm,
            scaler: scaler.as_mut(),
        };
        let report = zero.step_with(&mut model.model, opts)?;
        let mut st = shared.lock();
        st.amp.scaler = scaler;
        st.amp.unscaled = None;
        st.amp.skipped = report.skipped;
        if report.skipped {
            st.amp.skipped_steps += 1;
        }
        Ok(Some(report))
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
            ("full", Stage::Full),
        ] {
            assert_eq!(s.parse::<Stage>().unwrap(), want);
            assert_eq!(want.as_str().parse::<Stage>().unwrap(), want);
        }
        assert_eq!("FULL_SHARD".parse::<Stage>().unwrap(), Stage::Full);
        assert_eq!("zero3".parse::<Stage>().unwrap(), Stage::Full);
        let e = "zero9".parse::<Stage>().unwrap_err();
        assert!(e.to_string().contains("zero9"), "{e}");
        assert_eq!(
            Stage::from_env_value(Some(" 2 ")).unwrap(),
            Some(Stage::Gradients)
        );
        assert_eq!(Stage::from_env_value(Some("  ")).unwrap(), None);
        assert_eq!(Stage::from_env_value(None).unwrap(), None);
        let e = Stage::from_env_value(Some("zero9")).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidConfig, "{e}");
        let text = e.to_string();
        assert!(
            text.contains(SHARDING_ENV) && text.contains("zero9"),
            "{text}"
        );
        assert!(
            text.contains("none, optimizer, gradients or full"),
            "{text}"
        );
    }

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
        let build = |m: &One| {
            let sgd = ShardedSgd::new(0.1).with_momentum(0.9);
            ZeroOptimizer::new(comm.clone(), m, Stage::Gradients, &WrapPolicy::Whole, sgd).unwrap()
        };
        let mut z = build(&m);
        z.step(&mut m).unwrap();
        assert_eq!(m.0, vec![0.95; 5]);
        let state = z.state_dict();
        let mut back = build(&m);
        back.load_state_dict(&state).unwrap();
        assert_eq!(back.optimizer(), z.optimizer());
        let mut short = state.clone();
        let t = short.tensors.get_mut("momentum_buffer.unit0").unwrap();
        t.data.pop();
        let e = back.load_state_dict(&short).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains("momentum_buffer.unit0"), "{e}");
        assert!(e.to_string().contains("has 5"), "{e}");
        back.load_state_dict(&state).unwrap();
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
