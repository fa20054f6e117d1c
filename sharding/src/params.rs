//! Parameter sharding (ZeRO): the stage, and the layout of a model's
//! parameters in units, each flattened and padded to a multiple of the
//! world size, rank `r` owning the `r`-th equal slice of every unit.
//!
//! Pure index arithmetic over `(name, element count)` pairs: `accel`'s
//! `zero` module moves the data and runs the collectives.

use std::ops::Range;

use accel_api::{Error, Result};

/// The environment variable the training loop's sharding setting (`accel`'s
/// `TrainConfig::sharding`) falls back to (`none|optimizer|gradients|full`, or any spelling
/// [`Stage`]'s `FromStr` reads).
pub const SHARDING_ENV: &str = accel_api::worker::keys::ACCEL_SHARDING;

/// What each rank keeps of the training state: a protocol value of the
/// worker environment (`accel_api::worker`), re-exported here where the
/// layout uses it.
pub use accel_api::worker::Stage;

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
    /// The unit key of parameter `name`: consecutive parameters with the
    /// same key form one unit.
    pub fn key(&self, name: &str) -> String {
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
    /// [`accel_api::ErrorKind::InvalidArgument`] for a world of 0, no parameters, a
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

    /// Elements of unit `unit` that one rank owns (padding included).
    ///
    /// # Panics
    /// If `unit` is out of range.
    pub fn shard_len(&self, unit: usize) -> usize {
        self.units[unit].padded / self.world
    }

    /// One rank's slice length of every unit, in order.
    pub fn shard_lens(&self) -> Vec<usize> {
        (0..self.units.len()).map(|u| self.shard_len(u)).collect()
    }

    /// Unit `unit`'s parameters as indices in visiting order, and where
    /// its slice starts in one rank's shard (the slices of all units, one
    /// after another); `None` for a unit out of range.
    pub fn unit_span(&self, unit: usize) -> Option<(Range<usize>, usize)> {
        let u = self.units.get(unit)?;
        let before = &self.units[..unit];
        let first: usize = before.iter().map(|u| u.slots.len()).sum();
        let at = before.iter().map(|u| u.padded / self.world).sum();
        Some((first..first + u.slots.len(), at))
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
    pub fn params(&self) -> impl Iterator<Item = (&str, usize)> {
        self.units
            .iter()
            .flat_map(|u| u.slots.iter().map(|s| (s.name.as_str(), s.numel)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_api::ErrorKind;

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
    fn spans_and_slice_lengths_follow_the_padding() {
        let p = params(&[("a.x", 3), ("a.y", 2), ("b", 7)]);
        let plan = ShardPlan::new(&p, &WrapPolicy::Depth(1), 2).unwrap();
        assert_eq!(plan.shard_lens(), [3, 4]);
        assert_eq!(plan.unit_span(0), Some((0..2, 0)));
        assert_eq!(plan.unit_span(1), Some((2..3, 3)));
        assert_eq!(plan.unit_span(2), None);
        assert_eq!(plan.shard_numel(), plan.shard_lens().iter().sum::<usize>());
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
}
