//! The same training in plain candle, without accel: the same model, data,
//! batches and accumulation, candle-nn's AdamW, the micro-batches'
//! gradients summed by hand. `candle-digits --plain` runs it, so that
//! `scripts/bench_integration.sh` can say what accel-candle costs per step.

use accel::Result;
use accel_example_kit::plain::PlainReport;
use accel_example_kit::run::RunOptions;
use candle_core::backprop::GradStore;
use candle_nn::optim::Optimizer as _;
use candle_nn::VarMap;

use crate::{adamw, candle, collate, Mlp};

/// Train as `o` says in plain candle
/// ([`accel_example_kit::plain::train_plain`]).
///
/// # Errors
/// The data file's; candle's, as [`accel::ErrorKind::Backend`].
pub fn train_plain(o: &RunOptions) -> Result<PlainReport> {
    let varmap = VarMap::new();
    let net = Mlp::new(&varmap, o.hidden)?;
    accel_candle::init_uniform(&varmap, o.seed)?;
    let vars = varmap.all_vars();
    let mut opt = candle_nn::AdamW::new(vars.clone(), adamw(o.lr)).map_err(candle)?;
    let scale = 1.0 / o.accumulation as f64;
    accel_example_kit::plain::train_plain(o, |train, group| {
        let mut sum: Option<GradStore> = None;
        let mut total = 0.0;
        for items in group {
            let (x, y) = collate(train.batch(items))?;
            let l = candle_nn::loss::cross_entropy(&net.forward(&x)?, &y).map_err(candle)?;
            total += f64::from(l.to_scalar::<f32>().map_err(candle)?);
            let grads = (&l * scale).and_then(|s| s.backward()).map_err(candle)?;
            sum = Some(match sum {
                None => grads,
                Some(mut acc) => {
                    for v in &vars {
                        if let (Some(a), Some(g)) = (acc.get(v), grads.get(v)) {
                            let s = (a + g).map_err(candle)?;
                            acc.insert(v, s);
                        }
                    }
                    acc
                }
            });
        }
        if let Some(g) = &sum {
            opt.step(g).map_err(candle)?;
        }
        Ok(total / group.len() as f64)
    })
}
