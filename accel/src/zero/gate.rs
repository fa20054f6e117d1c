//! [`UnitGate`]: the hooks around each unit of a model run unit by unit,
//! and [`ZeroOptimizer`]'s stage-3 gathers, releases and gradient
//! reductions, with the prefetch of the next unit.

use std::ops::Range;

use accel_api::{Buf, Error, HostBuf, HostBufMut, Result, StartExt};
use accel_sharding::Stage;

use super::optimizer::ShardOptimizer;
use super::plan::{read_unit, visit_unit_mut, write_unit, Part};
use super::step::ZeroOptimizer;
use crate::train::Parameters;

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
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) for a module with no parameters or a
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
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) when a parameter of a unit holds no
    /// gradient (the unit was not gathered before the backward); as
    /// [`gather`](Self::gather).
    fn reduce_grads(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()>;
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

/// Whether parameter `name` belongs to `module` (`""`: every parameter):
/// the module itself or a dotted path below it.
pub(crate) fn is_under(name: &str, module: &str) -> bool {
    module.is_empty()
        || name == module
        || name
            .strip_prefix(module)
            .is_some_and(|r| r.starts_with('.'))
}

impl<O: ShardOptimizer> ZeroOptimizer<O> {
    /// The units holding parameters of `module` (`""`: every unit).
    fn units_of(&self, module: &str) -> Result<Vec<usize>> {
        let under = |name: &str| is_under(name, module);
        let units: Vec<usize> = (self.plan.units().iter().enumerate())
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
        let unit_ref = &self.plan.units()[unit];
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
        for s in &self.plan.units()[unit].slots {
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
        let len = self.plan.shard_len(unit);
        // The previous unit's reduce-scatter ran during this module's
        // backward; one is in flight at most.
        self.drain_reduce()?;
        let unit_ref = &self.plan.units()[unit];
        let mut grads = self.spare.pop().unwrap_or_default();
        read_unit(model, unit_ref, span.start, Part::Grads, &mut grads)?;
        let (op, scale) = self.avg_op();
        if self.plan.world_size() == 1 {
            for (acc, g) in self.shard[at..at + len].iter_mut().zip(&grads) {
                *acc += scale * g;
            }
            self.spare.push(grads);
        } else {
            let work = self
                .comm
                .start_reduce_scatter(grads, vec![0.0f32; len], op)?;
            self.reducing = Some((at, scale, work));
        }
        self.reduced[unit] = true;
        if self.stage == Stage::Full {
            return self.release_one(model, unit);
        }
        // Stage 2: the next backward starts from zero, and the unit's
        // gradients need no memory until then.
        visit_unit_mut(model, &self.plan.units()[unit], span.start, |_, _, g| {
            g.fill(0.0);
            Ok(())
        })?;
        for s in &self.plan.units()[unit].slots {
            model.release_grad(&s.name)?;
        }
        Ok(())
    }
}

impl<O: ShardOptimizer> ZeroOptimizer<O> {
    /// Wait for the reduce-scatter in flight, if any, and add its slice
    /// into the gradient shard.
    ///
    /// # Errors
    /// The reduce-scatter's.
    pub(super) fn drain_reduce(&mut self) -> Result<()> {
        let Some((at, scale, work)) = self.reducing.take() else {
            return Ok(());
        };
        let (send, recv) = work.wait()?;
        for (acc, g) in self.shard[at..at + recv.len()].iter_mut().zip(&recv) {
            *acc += scale * g;
        }
        self.spare.push(send);
        Ok(())
    }

    /// Wait for and drop the prefetch in flight (its values are out of
    /// date or unwanted).
    pub(super) fn drain_prefetch(&mut self) -> Result<()> {
        self.take_prefetched().map(drop)
    }

    /// The prefetch's answer, if a gather is in flight. After an error the
    /// prefetch is turned off, so that no late answer is taken for a later
    /// gather.
    pub(super) fn take_prefetched(&mut self) -> Result<Option<(usize, Vec<f32>)>> {
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
    pub(super) fn end_window(&mut self) -> Result<()> {
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
    pub(super) fn advance(&mut self, unit: usize) -> Result<()> {
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
        let padded = self.plan.units()[next].padded;
        let shard = self.params[at..at + self.plan.shard_len(next)].to_vec();
        match self.prefetch.as_mut() {
            Some(p) => p.issue(next, shard, padded),
            None => Ok(()),
        }
    }

    /// Unit `unit`'s parameter indices (visiting order) and where its
    /// shard starts in `shard`/`params`.
    pub(super) fn unit_span(&self, unit: usize) -> Result<(Range<usize>, usize)> {
        self.plan.unit_span(unit).ok_or_else(|| {
            Error::invalid_argument(
                "sharding",
                format!(
                    "unit {unit} does not exist: the plan has {} units",
                    self.plan.units().len()
                ),
            )
        })
    }

    /// All-gather unit `unit` into `values` (stage 3).
    pub(super) fn gather_unit(&mut self, unit: usize, at: usize) -> Result<()> {
        let padded = self.plan.units()[unit].padded;
        let len = self.plan.shard_len(unit);
        self.values.clear();
        self.values.resize(padded, 0.0);
        let mine = &self.params[at..at + len];
        if self.plan.world_size() == 1 {
            self.values.copy_from_slice(mine);
        } else {
            self.comm.all_gather(
                Buf::Host(HostBuf::from(mine)),
                HostBufMut::from(&mut self.values[..]).into(),
            )?;
        }
        Ok(())
    }
}
