//! burn optimizers as the training loop's [`Optimizer`] and ZeRO's
//! [`ShardOptimizer`].

use std::collections::BTreeMap;

use accel::train::{
    host_from_f32, host_to_f32, try_visit_params_mut, Optimizer, Parameters, StateDict,
};
use accel::zero::ShardOptimizer;
use accel_api::{BufMut, Error, ErrorKind, Result};
use burn::optim::{Optimizer as BurnOpt, RecordState, StateSink, StateSource};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_pack::Scalar;
use serde::{Deserialize, Serialize};

/// A burn optimizer's scalar, as checkpoints store it.
#[derive(Serialize, Deserialize)]
enum ScalarValue {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
}

impl From<Scalar> for ScalarValue {
    fn from(s: Scalar) -> ScalarValue {
        match s {
            Scalar::Int(v) => ScalarValue::Int(v),
            Scalar::UInt(v) => ScalarValue::UInt(v),
            Scalar::Float(v) => ScalarValue::Float(v),
            Scalar::Bool(v) => ScalarValue::Bool(v),
        }
    }
}

impl From<ScalarValue> for Scalar {
    fn from(s: ScalarValue) -> Scalar {
        match s {
            ScalarValue::Int(v) => Scalar::Int(v),
            ScalarValue::UInt(v) => Scalar::UInt(v),
            ScalarValue::Float(v) => Scalar::Float(v),
            ScalarValue::Bool(v) => Scalar::Bool(v),
        }
    }
}

/// A burn optimizer (`burn::optim::Sgd`, `Adam`, `AdamW`, ... built with
/// its config's `build()`) as the training loop's [`Optimizer`] and as
/// [`accel::zero`]'s [`ShardOptimizer`].
///
/// # Behavior
/// burn's per-parameter [`Optimizer::step`](burn::optim::Optimizer::step)
/// runs on each parameter's values and gradient (averaged, unscaled and
/// clipped by accel), as flat (1-D) f32 tensors: the same arithmetic as
/// burn's `ModuleOptimizer` for element-wise optimizers (SGD, Adam,
/// AdamW, RMSProp, ...). Its state is kept per parameter name (or ZeRO
/// unit). Per step and parameter: values and gradient copied into burn,
/// the new values copied back (then written into the module before its
/// next forward pass).
///
/// # Checkpoints
/// The learning rate, the step count and every parameter's state, through
/// burn's own [`RecordState`] flattening (moments as f32 tensors,
/// scalars as they are): a resume is exact.
///
/// # Requires
/// Float parameter values and gradients on the host; f32 ones step in
/// place, others (f16, bf16, f64) in f32 with the values rounded once
/// back (keep f32 master weights for mixed precision).
pub struct BurnOptimizer<O: BurnOpt> {
    inner: O,
    lr: f64,
    device: Device,
    states: BTreeMap<String, O::State<1>>,
    steps: u64,
}

impl<O: BurnOpt> std::fmt::Debug for BurnOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BurnOptimizer")
            .field("optimizer", &std::any::type_name::<O>())
            .field("lr", &self.lr)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

fn burn_vec(op: &str, data: TensorData) -> Result<Vec<f32>> {
    data.try_into_vec::<f32>()
        .map_err(|e| Error::new(ErrorKind::Backend, format!("burn: {op}: {e:?}")))
}

impl<O: BurnOpt> BurnOptimizer<O> {
    /// `inner` at learning rate `lr`, computing on burn's default device.
    pub fn new(inner: O, lr: f64) -> BurnOptimizer<O> {
        BurnOptimizer {
            inner,
            lr,
            device: Device::default(),
            states: BTreeMap::new(),
            steps: 0,
        }
    }

    /// Compute on `device` (a host device: the values come from host
    /// memory and go back to it).
    pub fn on_device(mut self, device: Device) -> BurnOptimizer<O> {
        self.device = device;
        self
    }

    /// The burn optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One burn step of the state under `key` on `values` from `grads`.
    fn step_flat(&mut self, key: &str, values: &mut [f32], grads: &[f32]) -> Result<()> {
        let n = values.len();
        if grads.len() != n {
            return Err(Error::invalid_argument(
                "BurnOptimizer::step",
                format!(
                    "parameter {key:?} has {n} values and {} gradients",
                    grads.len()
                ),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let t = Tensor::<1>::from_data(
            TensorData::new(values.to_vec(), [n]),
            (&self.device, DType::F32),
        );
        let g = Tensor::<1>::from_data(
            TensorData::new(grads.to_vec(), [n]),
            (&self.device, DType::F32),
        );
        let state = self.states.remove(key);
        let (t, state) = self.inner.step(self.lr, t, g, state);
        if let Some(s) = state {
            self.states.insert(key.to_string(), s);
        }
        values.copy_from_slice(&burn_vec("optimizer step", t.into_data())?);
        Ok(())
    }

    fn save(&self, out: &mut StateDict) {
        out.put("lr", &self.lr);
        out.put("steps", &self.steps);
        let mut sink = StateSink::default();
        for (key, s) in &self.states {
            s.state_flatten(key, &mut sink);
        }
        let mut tensors = Vec::new();
        for (name, data) in sink.tensors {
            match burn_vec("optimizer state", data.convert::<f32>()) {
                Ok(v) => {
                    out.put_tensor(format!("burn.{name}"), v);
                    tensors.push(name);
                }
                Err(e) => tracing::error!("accel-burn: optimizer state {name:?} not saved: {e}"),
            }
        }
        let scalars: Vec<(String, ScalarValue)> = sink
            .scalars
            .into_iter()
            .map(|(k, v)| (k, v.into()))
            .collect();
        out.put("burn_states", &self.states.keys().collect::<Vec<_>>());
        out.put("burn_tensors", &tensors);
        out.put("burn_scalars", &scalars);
    }

    fn load(&mut self, state: &StateDict) -> Result<()> {
        self.lr = state.get("lr")?;
        self.steps = state.get("steps")?;
        let keys: Vec<String> = state.get("burn_states")?;
        let tensors: Vec<String> = state.get("burn_tensors")?;
        let scalars: Vec<(String, ScalarValue)> = state.get("burn_scalars")?;
        let mut src = StateSource::new(scalars.into_iter().map(|(k, v)| (k, v.into())).collect());
        for name in tensors {
            let t = state.tensor(&format!("burn.{name}"))?;
            let n = t.data.len();
            src.insert_tensor(name, TensorData::new(t.data.clone(), [n]));
        }
        self.states.clear();
        for key in keys {
            let s = <O::State<1> as RecordState>::state_unflatten(&key, &mut src, &self.device)
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::Corrupt,
                        format!(
                            "the burn optimizer state of {key:?} does not fit {}",
                            std::any::type_name::<O>()
                        ),
                    )
                })?;
            self.states.insert(key, s);
        }
        Ok(())
    }
}

impl<O: BurnOpt> Optimizer for BurnOptimizer<O> {
    fn step(&mut self, params: &mut dyn Parameters) -> Result<()> {
        try_visit_params_mut(params, |_, mut p| {
            let name = p.name;
            if let Ok((v, g)) = p.f32_mut() {
                return self.step_flat(name, v, g);
            }
            // Another float type (f16, bf16, f64): stepped in f32, the
            // values rounded once back.
            let (BufMut::Host(v), BufMut::Host(g)) = (&mut p.value, &p.grad) else {
                return Err(Error::invalid_argument(
                    "BurnOptimizer::step",
                    format!(
                        "parameter {name:?} is in device memory; accel-burn steps host parameters"
                    ),
                ));
            };
            let g = host_to_f32(g.as_buf())?.into_owned();
            let mut vals = host_to_f32(v.as_buf())?.into_owned();
            self.step_flat(name, &mut vals, &g)?;
            host_from_f32(v, &vals)
        })?;
        self.steps += 1;
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn state_dict(&self) -> StateDict {
        let mut s = StateDict::default();
        self.save(&mut s);
        s
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.load(state)
    }
}

/// ZeRO: the state is kept per unit (this rank's slice of it).
impl<O: BurnOpt> ShardOptimizer for BurnOptimizer<O> {
    fn step_shard(&mut self, unit: usize, params: &mut [f32], grads: &[f32]) -> Result<()> {
        self.step_flat(&format!("unit{unit}"), params, grads)
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
        let mut sink = StateSink::default();
        for (key, s) in &self.states {
            s.state_flatten(key, &mut sink);
        }
        sink.tensors.iter().map(|(_, d)| d.num_elements()).sum()
    }

    fn state_dict(&self) -> StateDict {
        let mut s = StateDict::default();
        self.save(&mut s);
        s
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.load(state)
    }
}
