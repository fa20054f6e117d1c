//! The conformance suite's model scenarios with a tch model, on every CPU
//! column of the matrix (single, the vendor plugin, cpu-gloo and its
//! plugin at 1-4 ranks, mpi at 1-4 ranks under mpirun): accumulation
//! cadence, W×k equivalence with one process, the fp16 skip agreed by
//! every rank, bf16 equivalence, clipping, ZeRO stages 0-3 (equivalence,
//! clipping, the fp16 skip, HSDP), and accel-tch's tensor-parallel layers
//! on every tensor-parallel mesh of the world size (column- then
//! row-parallel, forward and gradients, through libtorch's autograd). The
//! oracle is the suite's own: the fixture MLP with hand-derived gradients
//! on one process, so libtorch's autograd is checked against it too.
//!
//! This binary is its own conformance worker (no libtest harness), as
//! accel-candle's and accel-burn's are: started by the harness
//! (`ACCEL_CONFORMANCE_OUT` set) it runs one rank of the tch scenarios;
//! started by `cargo test` it runs the columns, each world under the
//! harness's hard timeout, and fails on any failure (one test,
//! `tch_conformance_matrix`). The plugins the columns load are built into
//! the root workspace's `target/` (where `make test`'s first half has
//! built them already).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use accel::train::MixedPrecision;
use accel::zero::UnitGate;
use accel_api::{Communicator, Error, ErrorKind};
use accel_conformance::fixtures::{Mlp, Sample, FEATURES, NAMES};
use accel_conformance::{worker, ScenarioModel, TpCase, TpGrads};
use accel_tch::tp::{ColumnParallelLinear, RowParallelLinear};
use accel_tch::{autocast_with, TchModel, Zero3TchModel};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// The fixture MLP in tch: `nn::Linear` layers `fc1` (`FEATURES →
/// hidden`, tanh) and `fc2` (`hidden → 1`) over a `VarStore`, trained
/// through [`Zero3TchModel`] (which frees released units at stage 3).
struct TchMlp {
    model: Zero3TchModel,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

fn torch(e: tch::TchError) -> Error {
    Error::new(ErrorKind::Backend, format!("libtorch: {e}"))
}

fn flat(t: &Tensor) -> accel::Result<Vec<f32>> {
    Vec::<f32>::try_from(t.flatten(0, -1).to_kind(Kind::Float)).map_err(torch)
}

impl ScenarioModel for TchMlp {
    const PREFIX: &'static str = "tch_";

    fn build(hidden: usize, seed: u64) -> TchMlp {
        let vs = nn::VarStore::new(Device::Cpu);
        let (f, h) = (FEATURES as i64, hidden as i64);
        let fc1 = nn::linear(vs.root() / "fc1", f, h, Default::default());
        let fc2 = nn::linear(vs.root() / "fc2", h, 1, Default::default());
        // The fixture's initial values (fc1.weight is hidden × FEATURES,
        // row-major: nn::Linear's (out, in) layout).
        let vars = vs.variables();
        tch::no_grad(|| {
            for (name, values) in NAMES.iter().zip(Mlp::new(hidden, seed).values) {
                let mut v = vars[*name].shallow_clone();
                let shape = v.size();
                v.copy_(&Tensor::from_slice(&values).reshape(shape));
            }
        });
        let model = TchModel::new(vs).expect("a CPU f32 VarStore");
        TchMlp {
            model: Zero3TchModel::new(model),
            fc1,
            fc2,
        }
    }

    /// fc1's forward, release; fc2's forward and the loss; both gathered
    /// again (autograd saved their weights) for the one libtorch backward;
    /// then each layer's gradients reduced, fc2 first (the order of
    /// accel-tch's ZeRO-3 tests). The forward runs under libtorch's
    /// autocast in the mixed precision's type (bf16 on the CPU; libtorch
    /// 2.13 autocasts f16 on the CPU too); masters and gradients stay f32.
    fn loss_and_grad_gated(
        &mut self,
        batch: &[Sample],
        scale: f32,
        precision: MixedPrecision,
        gate: &mut dyn UnitGate,
    ) -> accel::Result<f32> {
        let n = batch.len() as i64;
        let x: Vec<f32> = batch.iter().flat_map(|s| s.x).collect();
        let y: Vec<f32> = batch.iter().map(|s| s.y).collect();
        let x = Tensor::from_slice(&x).reshape([n, FEATURES as i64]);
        let y = Tensor::from_slice(&y).reshape([n, 1]);
        gate.gather(self, "fc1")?;
        let h = autocast_with(precision, Device::Cpu, || {
            self.fc1.forward(&x).tanh().to_kind(Kind::Float)
        })?;
        gate.release(self, "fc1")?;
        gate.gather(self, "fc2")?;
        let p = autocast_with(precision, Device::Cpu, || {
            self.fc2.forward(&h).to_kind(Kind::Float)
        })?;
        let loss = (p - y).square().mean(Kind::Float);
        gate.release(self, "fc2")?;
        gate.gather(self, "fc2")?;
        gate.gather(self, "fc1")?;
        (&loss * f64::from(scale)).f_backward().map_err(torch)?;
        gate.reduce_grads(self, "fc2")?;
        gate.reduce_grads(self, "fc1")?;
        Ok(loss.double_value(&[]) as f32)
    }

    /// accel-tch's `ColumnParallelLinear` then `RowParallelLinear`, cut
    /// from the whole weights; libtorch's autograd (through accel-tch's
    /// autograd functions for the sums) for the gradients.
    fn tensor_parallel(
        case: &TpCase,
        group: &Arc<dyn Communicator>,
    ) -> Option<accel::Result<TpGrads>> {
        Some((|| {
            let t =
                |v: &[f32], r: usize, c: usize| Tensor::from_slice(v).reshape([r as i64, c as i64]);
            let (b, h) = (case.batch, case.hidden);
            let vs = nn::VarStore::new(Device::Cpu);
            let p = vs.root();
            let w1 = t(&case.w1, h, case.inputs);
            let w2 = t(&case.w2, case.outputs, h);
            let up = ColumnParallelLinear::from_full(&(&p / "up"), &w1, None, group.clone())?;
            let down = RowParallelLinear::from_full(&(&p / "down"), &w2, None, group.clone())?;
            let x = t(&case.x, b, case.inputs).set_requires_grad(true);
            let y = down.forward(&up.forward(&x)?.relu())?;
            let dy = t(&case.dy, b, case.outputs);
            (&y * dy).sum(Kind::Float).f_backward().map_err(torch)?;
            Ok(TpGrads {
                y: flat(&y)?,
                dx: flat(&x.grad())?,
                dw1: flat(&up.weight.grad())?,
                dw2: flat(&down.weight.grad())?,
            })
        })())
    }
}

// The forward pass computes in the mixed precision's type.
accel_conformance::delegate_parameters!(TchMlp => model, uses_mixed_precision: true);

fn main() -> ExitCode {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root");
    let target = workspace.join("target");
    worker::framework_main::<TchMlp>("tch", &workspace, &target)
}
