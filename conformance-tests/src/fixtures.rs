//! The training fixtures the scenarios use, shipped here so that a vendor
//! depending on this crate gets them too: a deterministic synthetic
//! regression dataset and a small MLP with hand-derived gradients (the
//! pure-Rust demo, `examples/train`, trains the same model).

use accel::train::{try_visit_params_mut, Dataset, MixedPrecision, ParamMut, ParamRef, Parameters};
use accel::zero::{resize_host_storage, NoGate, UnitGate};
use accel_api::{Communicator, CommunicatorExt, ReduceOp};

/// Input features per sample.
pub const FEATURES: usize = 8;

/// One sample: features and target.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Inputs in `[-1, 1)`.
    pub x: [f32; FEATURES],
    /// Target.
    pub y: f32,
}

/// Add Gaussian noise of standard deviation `std` to every input feature
/// of `batch` (augmentation), drawn from `rng` sample by sample, feature
/// by feature.
pub fn add_noise(batch: &mut [Sample], std: f32, rng: &mut accel::train::Rng) {
    for v in batch.iter_mut().flat_map(|s| s.x.iter_mut()) {
        *v += std * rng.normal();
    }
}

/// SplitMix64 finaliser: a fixed hash, so the dataset is the same on every
/// rank, platform and run.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unit(seed: u64, a: u64, b: u64) -> f32 {
    let h = mix(seed ^ mix(a.wrapping_mul(0x1000_0000_01b3) ^ mix(b)));
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A deterministic regression dataset: sample `i` is a pure function of
/// `(seed, i)`. The target is a smooth non-linear function of the inputs
/// plus a little noise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Synthetic {
    /// Number of samples.
    pub len: usize,
    /// Which draw of the data (training and evaluation sets use different
    /// seeds).
    pub seed: u64,
}

impl Dataset for Synthetic {
    type Item = Sample;
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, i: usize) -> Sample {
        let mut x = [0.0f32; FEATURES];
        for (j, v) in x.iter_mut().enumerate() {
            *v = unit(self.seed, i as u64, j as u64);
        }
        let lin: f32 = x
            .iter()
            .enumerate()
            .map(|(j, v)| v * (j as f32 - 3.5) / 4.0)
            .sum();
        let y = lin.sin() + 0.5 * x[0] * x[1] + 0.05 * unit(self.seed, i as u64, 99);
        Sample { x, y }
    }
}

/// `FEATURES → hidden (tanh) → 1` with gradient buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct Mlp {
    /// Hidden width.
    pub hidden: usize,
    /// Values: `fc1.weight` (hidden × FEATURES), `fc1.bias`, `fc2.weight`,
    /// `fc2.bias`.
    pub values: [Vec<f32>; 4],
    /// Gradients, same shapes.
    pub grads: [Vec<f32>; 4],
}

/// The fixture MLP's parameter names, in its visiting order.
pub const NAMES: [&str; 4] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];

/// A model the training and sharding scenarios can train: the fixture
/// [`Mlp`] (`FEATURES → hidden (tanh) → 1`, mean squared error) written in
/// some framework, with parameters named as [`NAMES`] (in any visiting
/// order) and starting from [`Mlp::new`]'s values. The scenarios compare
/// what it trains against the fixture [`Mlp`] on one process (the oracle),
/// so a framework's model is checked against accel's hand-derived
/// gradients. [`model_scenarios`](crate::model_scenarios) gives the
/// scenarios for a model type; a framework's integration runs them on
/// every column through [`worker::main_with`](crate::worker::main_with)
/// (accel-candle's `tests/conformance.rs` does).
pub trait ScenarioModel: Parameters + Send + 'static {
    /// Prefix of the scenario names for this model (`"candle_"`; the
    /// fixture itself has none).
    const PREFIX: &'static str;

    /// The model with [`Mlp::new(hidden, seed)`](Mlp::new)'s initial values.
    fn build(hidden: usize, seed: u64) -> Self;

    /// Mean squared error over `batch`: add `scale ×` its gradient to the
    /// model's gradients, computed module by module (`fc1`, `fc2`;
    /// backward in reverse) with the [`UnitGate`] calls around each, the
    /// forward pass in `precision`'s compute type where the model has one
    /// (the fixture computes in f32). Returns the unscaled loss.
    ///
    /// # Errors
    /// The gate's; the framework's.
    fn loss_and_grad_gated(
        &mut self,
        batch: &[Sample],
        scale: f32,
        precision: MixedPrecision,
        gate: &mut dyn UnitGate,
    ) -> accel_api::Result<f32>;

    /// The `tensor_parallel` scenario in this framework (issue 39):
    /// `y = relu(x · w1ᵀ) · w2ᵀ` for `case` and its backward for `dy`, with
    /// the framework's column-parallel layer for `w1` and row-parallel
    /// layer for `w2` over `group` (each cut from the case's whole weights
    /// by the layer, as a user's model would be), returning `y`, `x`'s
    /// gradient, and this rank's rows of `w1`'s gradient and columns of
    /// `w2`'s. `None` (the default) when the framework has no
    /// tensor-parallel layers: the scenario is then skipped, saying so.
    ///
    /// # Errors
    /// The framework's; the group's collectives'.
    fn tensor_parallel(
        case: &TpCase,
        group: &std::sync::Arc<dyn Communicator>,
    ) -> Option<accel_api::Result<TpGrads>> {
        let _ = (case, group);
        None
    }
}

/// The case of the `tensor_parallel` scenario: whole values, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct TpCase {
    /// Rows of `x`.
    pub batch: usize,
    /// Input features.
    pub inputs: usize,
    /// Hidden units (split over the `tp` group; every size the scenario
    /// tries divides it).
    pub hidden: usize,
    /// Output features.
    pub outputs: usize,
    /// The input, `batch × inputs`.
    pub x: Vec<f32>,
    /// The column-parallel layer's whole weight, `hidden × inputs`.
    pub w1: Vec<f32>,
    /// The row-parallel layer's whole weight, `outputs × hidden`.
    pub w2: Vec<f32>,
    /// The output's gradient, `batch × outputs`.
    pub dy: Vec<f32>,
}

/// What [`ScenarioModel::tensor_parallel`] returns, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct TpGrads {
    /// The output, `batch × outputs` (whole on every rank).
    pub y: Vec<f32>,
    /// `x`'s gradient, `batch × inputs` (summed over the group).
    pub dx: Vec<f32>,
    /// This rank's rows of `w1`'s gradient.
    pub dw1: Vec<f32>,
    /// This rank's columns of `w2`'s gradient.
    pub dw2: Vec<f32>,
}

impl ScenarioModel for Mlp {
    const PREFIX: &'static str = "";

    fn build(hidden: usize, seed: u64) -> Mlp {
        Mlp::new(hidden, seed)
    }

    fn loss_and_grad_gated(
        &mut self,
        batch: &[Sample],
        scale: f32,
        _: MixedPrecision,
        gate: &mut dyn UnitGate,
    ) -> accel_api::Result<f32> {
        self.loss_and_grad_units(batch, scale, gate)
    }

    /// The two layers written out by hand (the scenario's oracle, cut by
    /// rows of the hidden units).
    fn tensor_parallel(
        case: &TpCase,
        group: &std::sync::Arc<dyn Communicator>,
    ) -> Option<accel_api::Result<TpGrads>> {
        let rows = accel_sharding::placement::chunk(case.hidden, group.world_size(), group.rank());
        let reduce = |v: Vec<f32>| group.all_reduce_vec(&v, ReduceOp::Sum);
        Some(two_layers(case, &rows, &reduce))
    }
}

/// A model's `f32` parameter values, flattened in the fixture's order
/// ([`NAMES`]; names it does not know after them, in visiting order):
/// [`Mlp::flat_values`] for any [`ScenarioModel`].
///
/// # Panics
/// When a parameter is not `f32` host memory.
pub fn fixture_values(model: &dyn Parameters) -> Vec<f32> {
    let mut named: Vec<(usize, Vec<f32>)> = Vec::new();
    model.visit_params(&mut |p| {
        let rank = NAMES
            .iter()
            .position(|n| *n == p.name)
            .unwrap_or(NAMES.len());
        let v = p.value_f32().expect("scenario models hold f32 host values");
        named.push((rank, v.to_vec()));
    });
    named.sort_by_key(|(r, _)| *r);
    named.into_iter().flat_map(|(_, v)| v).collect()
}

/// Elements of parameter values and gradients `model` holds now (its views'
/// lengths): [`Mlp::resident_numel`] for any model.
pub fn resident_numel(model: &dyn Parameters) -> usize {
    let mut n = 0;
    model.visit_params(&mut |p| n += p.value.len() + p.grad.len());
    n
}

/// Elements of gradient `model` holds now.
pub fn grad_numel(model: &dyn Parameters) -> usize {
    let mut n = 0;
    model.visit_params(&mut |p| n += p.grad.len());
    n
}

/// Set every gradient element to 0.
///
/// # Errors
/// A gradient that is not `f32` host memory.
pub fn zero_grads(model: &mut dyn Parameters) -> accel_api::Result<()> {
    try_visit_params_mut(model, |_, mut p| {
        p.f32_mut()?.1.fill(0.0);
        Ok(())
    })
}

impl Mlp {
    /// A model with deterministic small initial weights from `seed`.
    pub fn new(hidden: usize, seed: u64) -> Mlp {
        let scale1 = 1.0 / (FEATURES as f32).sqrt();
        let scale2 = 1.0 / (hidden as f32).sqrt();
        let w1 = (0..hidden * FEATURES)
            .map(|i| unit(seed, 1, i as u64) * scale1)
            .collect();
        let w2 = (0..hidden)
            .map(|i| unit(seed, 2, i as u64) * scale2)
            .collect();
        let values = [w1, vec![0.0; hidden], w2, vec![0.0; 1]];
        let grads = values.clone().map(|v| vec![0.0; v.len()]);
        Mlp {
            hidden,
            values,
            grads,
        }
    }

    fn hidden_act(&self, x: &[f32; FEATURES]) -> Vec<f32> {
        let [w1, b1, _, _] = &self.values;
        (0..self.hidden)
            .map(|k| {
                let z: f32 = b1[k]
                    + w1[k * FEATURES..(k + 1) * FEATURES]
                        .iter()
                        .zip(x)
                        .map(|(w, v)| w * v)
                        .sum::<f32>();
                z.tanh()
            })
            .collect()
    }

    /// The prediction for one input.
    pub fn forward(&self, x: &[f32; FEATURES]) -> f32 {
        let h = self.hidden_act(x);
        self.values[3][0]
            + h.iter()
                .zip(&self.values[2])
                .map(|(a, w)| a * w)
                .sum::<f32>()
    }

    /// Each sample's squared error, in order.
    pub fn squared_errors(&self, batch: &[Sample]) -> Vec<f32> {
        batch
            .iter()
            .map(|s| (self.forward(&s.x) - s.y).powi(2))
            .collect()
    }

    /// Mean squared error over `batch`; adds `scale ×` its gradient to the
    /// gradient buffers (hand-derived backpropagation). Returns the
    /// unscaled mean loss.
    pub fn loss_and_grad(&mut self, batch: &[Sample], scale: f32) -> f32 {
        self.loss_and_grad_units(batch, scale, &mut NoGate)
            .expect("the unsharded gate does nothing that can fail")
    }

    /// As [`loss_and_grad`](Self::loss_and_grad), computed module by
    /// module (`fc1`, then `fc2`; backward in reverse) with the calls a
    /// ZeRO stage-3 [`UnitGate`] needs around each module.
    ///
    /// # Errors
    /// The gate's.
    pub fn loss_and_grad_units(
        &mut self,
        batch: &[Sample],
        scale: f32,
        gate: &mut dyn UnitGate,
    ) -> accel_api::Result<f32> {
        let n = batch.len().max(1) as f32;
        gate.gather(self, "fc1")?;
        let hs: Vec<Vec<f32>> = batch.iter().map(|s| self.hidden_act(&s.x)).collect();
        gate.release(self, "fc1")?;
        gate.gather(self, "fc2")?;
        // Gradients freed by a ZeRO-2 gate come back as the backward
        // writes them (as autograd allocates `.grad`).
        self.grad_storage(&[2, 3]);
        let mut loss = 0.0;
        let mut dzs = Vec::with_capacity(batch.len());
        for (s, h) in batch.iter().zip(&hs) {
            let pred = self.values[3][0]
                + h.iter()
                    .zip(&self.values[2])
                    .map(|(a, w)| a * w)
                    .sum::<f32>();
            let e = pred - s.y;
            loss += e * e / n;
            let dy = scale * 2.0 * e / n;
            self.grads[3][0] += dy;
            let dz: Vec<f32> = (0..self.hidden)
                .map(|k| {
                    self.grads[2][k] += dy * h[k];
                    dy * self.values[2][k] * (1.0 - h[k] * h[k])
                })
                .collect();
            dzs.push(dz);
        }
        gate.reduce_grads(self, "fc2")?;
        gate.gather(self, "fc1")?;
        self.grad_storage(&[0, 1]);
        for (s, dz) in batch.iter().zip(&dzs) {
            let [g1, gb1, _, _] = &mut self.grads;
            for k in 0..self.hidden {
                gb1[k] += dz[k];
                for (g, v) in g1[k * FEATURES..(k + 1) * FEATURES].iter_mut().zip(&s.x) {
                    *g += dz[k] * v;
                }
            }
        }
        gate.reduce_grads(self, "fc1")?;
        Ok(loss)
    }

    /// Zero-filled gradient storage for the parameters `idx` that have none.
    fn grad_storage(&mut self, idx: &[usize]) {
        for &i in idx {
            let n = self.values[i].len();
            resize_host_storage(&mut self.grads[i], n);
        }
    }

    fn index_of(&self, name: &str) -> accel_api::Result<usize> {
        NAMES.iter().position(|n| *n == name).ok_or_else(|| {
            accel_api::Error::invalid_argument(
                "set_param_storage",
                format!("no parameter {name:?}"),
            )
        })
    }

    /// Elements of parameter values and gradients the model holds now.
    pub fn resident_numel(&self) -> usize {
        self.values.iter().chain(&self.grads).map(Vec::len).sum()
    }

    /// All parameter values, flattened in visiting order.
    pub fn flat_values(&self) -> Vec<f32> {
        self.values.concat()
    }
}

impl Parameters for Mlp {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        for (i, name) in NAMES.iter().enumerate() {
            f(ParamRef::host(name, &self.values[i], &self.grads[i]));
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        let (values, grads) = (&mut self.values, &mut self.grads);
        for ((name, value), grad) in NAMES.iter().zip(values.iter_mut()).zip(grads.iter_mut()) {
            f(ParamMut::host(name, value, grad));
        }
    }

    fn set_param_storage(&mut self, name: &str, numel: usize) -> accel_api::Result<()> {
        let i = self.index_of(name)?;
        resize_host_storage(&mut self.values[i], numel);
        resize_host_storage(&mut self.grads[i], numel);
        Ok(())
    }

    fn release_grad(&mut self, name: &str) -> accel_api::Result<()> {
        let i = self.index_of(name)?;
        resize_host_storage(&mut self.grads[i], 0);
        Ok(())
    }
}

/// `a` (`m × k`) times `b` (`n × k`) transposed: `m × n`.
fn mat_bt(a: &[f32], b: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|t| a[i * k + t] * b[j * k + t]).sum();
        }
    }
    out
}

/// The transpose of `a` (`m × n`).
fn transpose(a: &[f32], m: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[j * m + i] = a[i * n + j];
        }
    }
    out
}

/// Columns `c` of `a` (`m × n`), row-major.
pub(crate) fn columns(a: &[f32], n: usize, c: &std::ops::Range<usize>) -> Vec<f32> {
    a.chunks(n)
        .flat_map(|row| row[c.clone()].to_vec())
        .collect()
}

/// `y = relu(x w1ᵀ) w2ᵀ` and its backward for `dy` (the fixture's
/// tensor-parallel layers), with `w1` the rows `rows` of the whole (column
/// parallel: outputs split) and `w2` the matching columns (row parallel:
/// inputs split); `reduce` sums the partial `y` and `dx` over the group
/// (nothing on one rank).
pub(crate) fn two_layers(
    case: &TpCase,
    rows: &std::ops::Range<usize>,
    reduce: &dyn Fn(Vec<f32>) -> accel_api::Result<Vec<f32>>,
) -> accel_api::Result<TpGrads> {
    let (b, i, o) = (case.batch, case.inputs, case.outputs);
    let (x, dy) = (&case.x, &case.dy);
    let hl = rows.len();
    let w1l = case.w1[rows.start * i..rows.end * i].to_vec();
    let w2l = columns(&case.w2, case.hidden, rows);
    let pre = mat_bt(x, &w1l, (b, i, hl));
    let act: Vec<f32> = pre.iter().map(|v| v.max(0.0)).collect();
    let y = reduce(mat_bt(&act, &w2l, (b, hl, o)))?;
    // Backward: dW2's columns, dh's columns, dW1's rows, dx summed.
    let dw2 = mat_bt(&transpose(dy, b, o), &transpose(&act, b, hl), (o, b, hl));
    let dact = mat_bt(dy, &transpose(&w2l, o, hl), (b, o, hl));
    let dpre: Vec<f32> = dact
        .iter()
        .zip(&pre)
        .map(|(g, p)| if *p > 0.0 { *g } else { 0.0 })
        .collect();
    let dw1 = mat_bt(&transpose(&dpre, b, hl), &transpose(x, b, i), (hl, b, i));
    let dx = reduce(mat_bt(&dpre, &transpose(&w1l, hl, i), (b, hl, i)))?;
    Ok(TpGrads { y, dx, dw1, dw2 })
}
