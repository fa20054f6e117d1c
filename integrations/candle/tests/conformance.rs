//! The conformance suite's model scenarios with a candle model, on every
//! CPU column of the matrix (single, the vendor plugin, cpu-gloo and its
//! plugin at 1-4 ranks, mpi at 1-4 ranks under mpirun): accumulation
//! cadence, W×k equivalence with one process, the fp16 skip agreed by
//! every rank, bf16 equivalence, clipping, and ZeRO stages 0-3
//! (equivalence, clipping, the fp16 skip, HSDP), and accel-candle's
//! tensor-parallel layers on every tensor-parallel mesh of the world size
//! (column- then row-parallel, forward and gradients). The oracle is the suite's own:
//! the fixture MLP with hand-derived gradients on one process, so candle's
//! autograd is checked against it too.
//!
//! This binary is its own conformance worker (no libtest harness): started
//! by the harness (`ACCEL_CONFORMANCE_OUT` set) it runs one rank of the
//! candle scenarios; started by `cargo test` it runs the columns, each
//! world under the harness's hard timeout (300 s), and fails on any
//! failure (one test, `candle_conformance_matrix`, for libtest's `--list`
//! and name filters). The suite itself does not depend on candle, so no other
//! backend's tests compile it.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use accel::train::MixedPrecision;
use accel::zero::UnitGate;
use accel_api::Communicator;
use accel_candle::tp::{ColumnParallelLinear, RowParallelLinear};
use accel_candle::{compute_var_builder, sequential_loss_and_grad, CandleModel, Link};
use accel_conformance::fixtures::{Mlp, Sample, FEATURES, NAMES};
use accel_conformance::{worker, ScenarioModel, TpCase, TpGrads};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Linear, Module, VarBuilder, VarMap};

/// The fixture MLP in candle: candle-nn `Linear` layers `fc1`
/// (`FEATURES → hidden`, tanh) and `fc2` (`hidden → 1`) over a `VarMap`,
/// trained through [`CandleModel`].
struct CandleMlp {
    varmap: VarMap,
    model: CandleModel,
    hidden: usize,
}

fn layers(vb: &VarBuilder<'_>, hidden: usize) -> candle_core::Result<(Linear, Linear)> {
    Ok((
        candle_nn::linear(FEATURES, hidden, vb.pp("fc1"))?,
        candle_nn::linear(hidden, 1, vb.pp("fc2"))?,
    ))
}

fn candle(e: candle_core::Error) -> accel::Error {
    accel::Error::new(accel_api::ErrorKind::Backend, format!("candle: {e}"))
}

impl ScenarioModel for CandleMlp {
    const PREFIX: &'static str = "candle_";

    fn build(hidden: usize, seed: u64) -> CandleMlp {
        let mut varmap = VarMap::new();
        layers(
            &VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            hidden,
        )
        .expect("candle-nn builds the layers");
        // The fixture's initial values (fc1.weight is hidden × FEATURES,
        // row-major: candle-nn's (out, in) layout).
        let fixture = Mlp::new(hidden, seed);
        let shapes = [
            vec![hidden, FEATURES],
            vec![hidden],
            vec![1, hidden],
            vec![1],
        ];
        for ((name, values), shape) in NAMES.iter().zip(fixture.values).zip(shapes) {
            let t = Tensor::from_vec(values, shape, &Device::Cpu).expect("fixture values");
            varmap.set_one(name, t).expect("the layer's variable");
        }
        let model = CandleModel::new(&varmap).expect("a CPU f32 VarMap");
        CandleMlp {
            varmap,
            model,
            hidden,
        }
    }

    /// Through [`sequential_loss_and_grad`]: fc1's forward, release; fc2's
    /// forward and backward, its gradient reduction; then fc1's backward
    /// from the gradient its output received (the module order a ZeRO-3
    /// gate needs, candle's autograd doing each module's backward). The
    /// layers on compute copies in bf16 or f16 under mixed precision; the
    /// masters and their gradients stay f32.
    fn loss_and_grad_gated(
        &mut self,
        batch: &[Sample],
        scale: f32,
        precision: MixedPrecision,
        gate: &mut dyn UnitGate,
    ) -> accel::Result<f32> {
        let dt = match precision {
            MixedPrecision::Bf16 => DType::BF16,
            MixedPrecision::Fp16 => DType::F16,
            MixedPrecision::No => DType::F32,
        };
        let n = batch.len();
        let x: Vec<f32> = batch.iter().flat_map(|s| s.x).collect();
        let y: Vec<f32> = batch.iter().map(|s| s.y).collect();
        let x = Tensor::from_vec(x, (n, FEATURES), &Device::Cpu).map_err(candle)?;
        let y = Tensor::from_vec(y, (n, 1), &Device::Cpu).map_err(candle)?;
        let vb = compute_var_builder(&self.varmap, dt);
        let hidden = self.hidden;
        let fc1 = |x: &Tensor| {
            let layer = candle_nn::linear(FEATURES, hidden, vb.pp("fc1"))?;
            layer
                .forward(&x.to_dtype(dt)?)?
                .tanh()?
                .to_dtype(DType::F32)
        };
        let fc2 = |h: &Tensor| {
            let layer = candle_nn::linear(hidden, 1, vb.pp("fc2"))?;
            layer.forward(&h.to_dtype(dt)?)?.to_dtype(DType::F32)
        };
        let mse = |p: &Tensor| (p - &y)?.sqr()?.mean_all();
        let links = [
            Link {
                module: "fc1",
                forward: &fc1,
            },
            Link {
                module: "fc2",
                forward: &fc2,
            },
        ];
        sequential_loss_and_grad(&mut self.model, gate, &x, &links, &mse, scale)
    }

    /// accel-candle's `ColumnParallelLinear` then `RowParallelLinear`, cut
    /// from the whole weights; candle's autograd for the gradients.
    fn tensor_parallel(
        case: &TpCase,
        group: &Arc<dyn Communicator>,
    ) -> Option<accel::Result<TpGrads>> {
        Some((|| {
            let t = |v: &[f32], r: usize, c: usize| {
                Tensor::from_vec(v.to_vec(), (r, c), &Device::Cpu).map_err(candle)
            };
            let (b, h) = (case.batch, case.hidden);
            let w1 = t(&case.w1, h, case.inputs)?;
            let w2 = t(&case.w2, case.outputs, h)?;
            let up = ColumnParallelLinear::from_full(&w1, None, group.clone(), false)?;
            let down = RowParallelLinear::from_full(&w2, None, group.clone())?;
            let x = Var::from_tensor(&t(&case.x, b, case.inputs)?).map_err(candle)?;
            let act = up.forward(x.as_tensor())?.relu().map_err(candle)?;
            let y = down.forward(&act)?;
            let dy = t(&case.dy, b, case.outputs)?;
            let grads = (&y * &dy)
                .and_then(|p| p.sum_all())
                .and_then(|l| l.backward())
                .map_err(candle)?;
            let flat = |v: &Tensor| -> accel::Result<Vec<f32>> {
                let g = grads.get(v).ok_or_else(|| {
                    accel::Error::new(accel_api::ErrorKind::Backend, "candle: no gradient")
                })?;
                g.flatten_all().and_then(|g| g.to_vec1()).map_err(candle)
            };
            Ok(TpGrads {
                y: y.flatten_all().and_then(|y| y.to_vec1()).map_err(candle)?,
                dx: flat(x.as_tensor())?,
                dw1: flat(up.vars()[0].as_tensor())?,
                dw2: flat(down.vars()[0].as_tensor())?,
            })
        })())
    }
}

// The forward pass computes in the mixed precision's type.
accel_conformance::delegate_parameters!(CandleMlp => model, uses_mixed_precision: true);

fn main() -> ExitCode {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root");
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir");
    worker::framework_main::<CandleMlp>("candle", &workspace, target)
}
