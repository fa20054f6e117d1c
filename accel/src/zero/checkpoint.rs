//! [`ZeroOptimizer`]'s sharded state: per-rank checkpoints and the full
//! parameters gathered from the shards.

use std::collections::BTreeMap;

use accel_api::{DType, Error, ErrorKind, Result};
use accel_sharding::Stage;

use super::optimizer::ShardOptimizer;
use super::step::ZeroOptimizer;
use crate::train::{
    row_chunk, try_visit_params, Checkpointed, ParamMut, ParamRef, Parameters, StateDict,
};

/// Every parameter's full values, gathered from the shards: what
/// [`Accelerator::save_model`](crate::Accelerator::save_model) writes
/// (it is a [`Parameters`] whose gradients are empty), in the model's
/// shapes where the model gives them ([`Parameters::param_shape`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FullParameters {
    /// `(name, values)` in the model's order.
    pub params: Vec<(String, Vec<f32>)>,
    /// Each parameter's shape as the model gives it
    /// ([`Parameters::param_shape`]); a parameter without one is saved 1-D.
    pub shapes: BTreeMap<String, Vec<usize>>,
}

impl Parameters for FullParameters {
    /// The model's shape, recorded by
    /// [`ZeroOptimizer::full_parameters`].
    fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.shapes.get(name).cloned()
    }

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

impl<O: ShardOptimizer> ZeroOptimizer<O> {
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
        model.visit_params(&mut |p| {
            if let Some(shape) = model.param_shape(p.name) {
                out.shapes.insert(p.name.to_string(), shape);
            }
        });
        if self.stage != Stage::Full {
            try_visit_params(model, |_, p| {
                out.params
                    .push((p.name.to_string(), p.value_f32()?.to_vec()));
                Ok(())
            })?;
            return Ok(out);
        }
        for u in 0..self.plan.units().len() {
            let (_, at) = self.unit_span(u)?;
            self.gather_unit(u, at)?;
            for s in &self.plan.units()[u].slots {
                let v = self.values[s.offset..s.offset + s.numel].to_vec();
                out.params.push((s.name.clone(), v));
            }
        }
        Ok(out)
    }

    /// Save the model's weights in torch's distributed-checkpoint layout,
    /// as [`Accelerator::save_model_sharded`](crate::Accelerator::save_model_sharded) writes a replicated model:
    /// each rank's rows (dimension 0 in world-size chunks, as torch's FSDP2
    /// shards it) of every tensor in one file per rank, loadable by torch's
    /// `HuggingFaceStorageReader` and [`Accelerator::load_model`](crate::Accelerator::load_model) at any
    /// world size. At stage 3 the units are gathered one at a time and only
    /// this rank's rows kept: the whole model is never in one rank's memory.
    /// Collective over `acc`'s ranks (the optimizer may shard over a group
    /// of them, as under HSDP), each passing the same folder. For a model
    /// whose parameters are whole tensors: a tensor-parallel model's parts
    /// are chunks of larger tensors, which [`Accelerator::save_shards`](crate::Accelerator::save_shards)
    /// writes with their offsets.
    ///
    /// # Errors
    /// As [`full_parameters`](Self::full_parameters) and
    /// [`Accelerator::save_shards`](crate::Accelerator::save_shards); a failure on any rank fails every rank.
    pub fn save_model_sharded(
        &mut self,
        acc: &crate::Accelerator,
        model: &dyn Parameters,
        dir: impl AsRef<std::path::Path>,
    ) -> Result<std::path::PathBuf> {
        if self.stage != Stage::Full {
            return acc.save_model_sharded(model, dir);
        }
        let at = (acc.rank(), acc.world_size());
        let mut chunks = Vec::new();
        let gathered = (0..self.plan.units().len()).try_for_each(|u| {
            let (_, start) = self.unit_span(u)?;
            self.gather_unit(u, start)?;
            for s in &self.plan.units()[u].slots {
                let v = &self.values[s.offset..s.offset + s.numel];
                let shape = model.param_shape(&s.name).unwrap_or_else(|| vec![s.numel]);
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                chunks.extend(row_chunk(s.name.clone(), &shape, DType::F32, &bytes, at));
            }
            Ok::<_, Error>(())
        });
        acc.write_shards(
            "save_model_sharded",
            gathered.map(|()| chunks),
            dir.as_ref(),
        )
    }

    fn unit_layout(&self) -> Vec<(String, usize)> {
        let units = self.plan.units().iter();
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
            self.drain_reduce()?;
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

    /// The state rank `rank` of this run loads from the shards of `saved`
    /// (ranks `0..W` of a run of another world size `W`): every unit's
    /// slices joined, the old padding cut, the unit padded again for this
    /// world size and this rank's slice taken. Optimizer tensors named
    /// `….unit{U}` are slices of unit `U` (as [`ShardedSgd`](super::ShardedSgd)'s
    /// momentum buffers are); `zero.params` holds every unit's slice in
    /// order. Values (learning rate, steps) are rank 0's.
    fn reshard(&self, saved: &[StateDict], rank: usize) -> Result<StateDict> {
        fn bad<T>(m: String) -> Result<T> {
            Err(Error::new(ErrorKind::Corrupt, m).with_fix(
                "resume from a checkpoint of this model and stage, every rank's shard present",
            ))
        }
        let Some(first) = saved.first() else {
            return bad("the checkpoint holds no ZeRO shard".into());
        };
        let stage: String = first.get("zero.stage")?;
        let units: Vec<(String, usize)> = first.get("zero.units")?;
        let mine = self.unit_layout();
        if stage != self.stage.as_str() || units != mine {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "the sharded state is of stage {stage} with {} units; this is stage {} with {} units",
                    units.len(),
                    self.stage,
                    mine.len()
                ),
            )
            .with_fix("resume with the model and stage the checkpoint was written with"));
        }
        let old_world = saved.len();
        let old_len = |u: usize| units[u].1.div_ceil(old_world);
        let new_len = |u: usize| self.plan.shard_len(u);
        // Unit `u` whole (no padding) from every saved rank's `slice(r)`.
        let whole = |u: usize,
                     slice: &dyn Fn(&StateDict) -> Option<Vec<f32>>|
         -> Result<Vec<f32>> {
            let mut v = Vec::with_capacity(old_len(u) * old_world);
            for (r, st) in saved.iter().enumerate() {
                match slice(st) {
                    Some(x) if x.len() == old_len(u) => v.extend(x),
                    Some(x) => {
                        return bad(format!(
                            "rank {r}'s slice of unit {u} holds {} elements; {old_world} ranks give {} each",
                            x.len(),
                            old_len(u)
                        ))
                    }
                    None => return bad(format!("rank {r}'s shard has no slice of unit {u}")),
                }
            }
            v.truncate(units[u].1);
            Ok(v)
        };
        let mine_of = |u: usize, mut v: Vec<f32>| {
            let n = new_len(u);
            v.resize(n * self.comm.world_size(), 0.0);
            v[rank * n..(rank + 1) * n].to_vec()
        };
        // ZeRO's units and optimizer state are f32: nothing stored narrower.
        let mut out = StateDict {
            values: first.values.clone(),
            ..StateDict::default()
        };
        out.put("zero.world_size", &self.comm.world_size());
        out.put("zero.rank", &rank);
        for name in first.tensors.keys() {
            if name == "zero.params" {
                continue;
            }
            let unit = name
                .rsplit_once(".unit")
                .and_then(|(_, u)| u.parse::<usize>().ok())
                .filter(|u| *u < units.len());
            let Some(u) = unit else {
                return Err(Error::invalid_config(
                    "WORLD_SIZE",
                    &self.comm.world_size().to_string(),
                    format!(
                        "the sharded optimizer state `{name}` is not a slice of a unit (`….unitN`), so it cannot be resharded from {old_world} ranks"
                    ),
                ));
            };
            let v = whole(u, &|st| st.tensors.get(name).map(|t| t.data.clone()))?;
            out.put_tensor(name.clone(), mine_of(u, v));
        }
        if first.tensors.contains_key("zero.params") {
            let starts: Vec<usize> = (0..units.len())
                .scan(0, |at, u| {
                    let s = *at;
                    *at += old_len(u);
                    Some(s)
                })
                .collect();
            let mut params = Vec::with_capacity(self.plan.shard_numel());
            for (u, start) in starts.iter().enumerate() {
                let v = whole(u, &|st| {
                    st.tensors
                        .get("zero.params")
                        .and_then(|t| t.data.get(*start..start + old_len(u)))
                        .map(<[f32]>::to_vec)
                })?;
                params.extend(mine_of(u, v));
            }
            out.put_tensor("zero.params", params);
        }
        Ok(out)
    }

    fn load_opt(&mut self, state: &StateDict) -> Result<()> {
        self.opt.load_state_dict(state)?;
        self.opt.check_shards(&self.plan.shard_lens())
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

    /// The shards of another world size, resharded for this rank (an
    /// elastic restart): see `ZeroOptimizer::reshard`.
    fn reshard_state(&self, saved: &[StateDict], rank: usize, _world: usize) -> Result<StateDict> {
        self.check_rank_states(saved)?;
        self.reshard(saved, rank)
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
