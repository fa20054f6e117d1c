//! The same training in plain tch, without accel: the same model, data,
//! batches and accumulation, and libtorch's own AdamW (what a tch user
//! would pick; gradients accumulate in libtorch across micro-batches).
//! `tch-digits --plain` runs it, so that `scripts/bench_integration.sh` can
//! say what accel-tch costs per step.

use accel::{Error, ErrorKind, Result};
use accel_example_kit::plain::PlainReport;
use accel_example_kit::run::RunOptions;
use tch::nn::{self, Module, OptimizerConfig};

use crate::{collate, mlp};

/// Train as `o` says in plain tch
/// ([`accel_example_kit::plain::train_plain`]).
///
/// # Errors
/// The data file's; libtorch's, as [`ErrorKind::Backend`].
pub fn train_plain(o: &RunOptions) -> Result<PlainReport> {
    tch::manual_seed(o.seed as i64);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = mlp(&vs.root(), o.hidden as i64);
    let mut opt = nn::AdamW::default()
        .build(&vs, o.lr)
        .map_err(|e| Error::new(ErrorKind::Backend, format!("tch: {e}")))?;
    let scale = 1.0 / o.accumulation as f64;
    accel_example_kit::plain::train_plain(o, |train, group| {
        opt.zero_grad();
        let mut total = 0.0;
        for items in group {
            let (x, y) = collate(&train.batch(items));
            let l = net.forward(&x).cross_entropy_for_logits(&y);
            total += l.double_value(&[]);
            (&l * scale).backward();
        }
        opt.step();
        Ok(total / group.len() as f64)
    })
}
