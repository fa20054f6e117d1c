//! Between a model and the [`ShardPlan`]: the plan of a model's
//! parameters, and copies of a unit's values or gradients to and from its
//! padded flat layout.

use accel_api::{Error, Result};
use accel_sharding::{ShardPlan, Slot, Unit, WrapPolicy};

use crate::train::{try_visit_params, try_visit_params_mut, Parameters};

/// The plan of `model`'s parameters (name and element count, in visiting
/// order): [`ShardPlan::new`] over them.
///
/// # Errors
/// As [`ShardPlan::new`].
pub fn plan_of_model(
    model: &dyn Parameters,
    policy: &WrapPolicy,
    world: usize,
) -> Result<ShardPlan> {
    let mut params = Vec::new();
    model.visit_params(&mut |p| params.push((p.name.to_string(), p.value.len())));
    ShardPlan::new(&params, policy, world)
}

/// A parameter's values or its gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Part {
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
pub(super) fn read_unit(
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
pub(super) fn visit_unit_mut(
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
pub(super) fn write_unit(
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
