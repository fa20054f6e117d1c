//! The conformance suite's model scenarios with a burn model, on every
//! CPU column of the matrix (single, the vendor plugin, cpu-gloo and its
//! plugin at 1-4 ranks, mpi at 1-4 ranks under mpirun): accumulation
//! cadence, W×k equivalence with one process, the fp16 skip agreed by
//! every rank, bf16 equivalence, clipping, and ZeRO stages 0-3
//! (equivalence, clipping, the fp16 skip). The oracle is the suite's own:
//! the fixture MLP with hand-derived gradients on one process, so burn's
//! autodiff is checked against it too.
//!
//! This binary is its own conformance worker (no libtest harness): started
//! by the harness (`ACCEL_CONFORMANCE_OUT` set) it runs one rank of the
//! burn scenarios; started by `cargo test` it runs the columns, each world
//! under the harness's hard timeout (300 s), and fails on any failure (one
//! test, `burn_conformance_matrix`, for libtest's `--list` and name
//! filters).

use std::path::Path;
use std::process::ExitCode;

use accel::train::MixedPrecision;
use accel::zero::UnitGate;
use accel_burn::BurnModel;
use accel_conformance::fixtures::{Mlp, Sample, FEATURES};
use accel_conformance::{worker, ScenarioModel};
use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

/// A dense layer with its weight stored (out, in), as the fixture (and
/// PyTorch) store it: `y = x wᵀ + b`.
#[derive(Module, Debug)]
struct Dense {
    weight: Param<Tensor<2>>,
    bias: Param<Tensor<1>>,
}

impl Dense {
    fn new(weight: Vec<f32>, out: usize, inp: usize, bias: Vec<f32>, device: &Device) -> Dense {
        Dense {
            weight: Param::from_data(TensorData::new(weight, [out, inp]), device),
            bias: Param::from_data(TensorData::new(bias, [out]), device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.matmul(self.weight.val().transpose()) + self.bias.val().unsqueeze::<2>()
    }
}

/// The fixture MLP: `fc1` (`FEATURES → hidden`, tanh), `fc2` (`hidden → 1`).
#[derive(Module, Debug)]
struct Fixture {
    fc1: Dense,
    fc2: Dense,
}

/// The fixture MLP in burn, trained through [`BurnModel`].
struct BurnMlp {
    model: BurnModel<Fixture>,
}

fn device() -> Device {
    Device::default().autodiff()
}

impl ScenarioModel for BurnMlp {
    const PREFIX: &'static str = "burn_";

    fn build(hidden: usize, seed: u64) -> BurnMlp {
        let [w1, b1, w2, b2] = Mlp::new(hidden, seed).values;
        let d = device();
        let net = Fixture {
            fc1: Dense::new(w1, hidden, FEATURES, b1, &d),
            fc2: Dense::new(w2, 1, hidden, b2, &d),
        };
        BurnMlp {
            model: BurnModel::new(net).expect("an f32 burn module"),
        }
    }

    /// `fc1`'s forward, release; `fc2`'s forward and the loss; one burn
    /// backward; then fc2's gradients added and reduced, fc1 gathered
    /// again, its gradients added and reduced (the module order a ZeRO-3
    /// gate needs). burn's NdArray backend has f32 and f64 floats only
    /// (no f16 or bf16 kernels), so the layers compute in f32 under every
    /// precision: the mixed-precision scenarios check accel's side (the
    /// loss scaler, the skip agreed by every rank) with burn's gradients.
    fn loss_and_grad_gated(
        &mut self,
        batch: &[Sample],
        scale: f32,
        _: MixedPrecision,
        gate: &mut dyn UnitGate,
    ) -> accel::Result<f32> {
        let n = batch.len();
        let d = device();
        let x: Vec<f32> = batch.iter().flat_map(|s| s.x).collect();
        let y: Vec<f32> = batch.iter().map(|s| s.y).collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [n, FEATURES]), &d);
        let y = Tensor::<2>::from_data(TensorData::new(y, [n, 1]), &d);

        gate.gather(self, "fc1")?;
        let first = self.model.module().clone();
        let h = first.fc1.forward(x).tanh();
        gate.release(self, "fc1")?;
        gate.gather(self, "fc2")?;
        let second = self.model.module().clone();
        let loss = (second.fc2.forward(h) - y).powi_scalar(2).mean();
        let value: f32 = loss.to_data().as_slice::<f32>().expect("an f32 loss")[0];
        let mut grads = loss.mul_scalar(scale).backward();
        // Each layer's gradients from the module copy its forward ran on.
        let g2 = GradientsParams::from_module(&mut grads, &second.fc2);
        let g1 = GradientsParams::from_module(&mut grads, &first.fc1);
        self.model.add_module_grads(&g2, "fc2")?;
        gate.reduce_grads(self, "fc2")?;
        gate.gather(self, "fc1")?;
        self.model.add_module_grads(&g1, "fc1")?;
        gate.reduce_grads(self, "fc1")?;
        Ok(value)
    }
}

accel_conformance::delegate_parameters!(BurnMlp => model);

fn main() -> ExitCode {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root");
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir");
    worker::framework_main::<BurnMlp>("burn", &workspace, target)
}
