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
//! | [`Stage::Optimizer`] (ZeRO-1) | full in the model; reduce-scattered into the optimizer's 1/W (all-reduced where the engine cannot reduce-scatter) | 1/W per rank | full, all-gathered after the step |
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

mod accelerator;
mod checkpoint;
pub(crate) mod gate;
mod optimizer;
mod plan;
mod prefetch;
mod step;

pub use accel_sharding::params::{ShardPlan, Slot, Stage, Unit, WrapPolicy, SHARDING_ENV};
pub use checkpoint::FullParameters;
pub use gate::{resize_host_storage, NoGate, UnitGate};
pub use optimizer::{ShardOptimizer, ShardedSgd};
pub use plan::plan_of_model;
pub use step::{StepOptions, StepReport, ZeroOptimizer};

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use accel_api::{Communicator, ErrorKind};

    use super::*;
    use crate::train::{ParamMut, ParamRef, Parameters};

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
