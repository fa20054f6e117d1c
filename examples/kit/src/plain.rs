//! The digits training without accel, for the benchmark of what the
//! integrations cost (`scripts/bench_integration.sh`): the loop, its data
//! order and its timing; the framework brings one optimizer step.

use std::time::Instant;

use accel::train::Dataset;
use accel::Result;

use crate::digits::{Digits, Split};
use crate::run::RunOptions;

/// What a plain run measured.
#[derive(Debug, Clone, Copy)]
pub struct PlainReport {
    /// Optimizer steps.
    pub steps: u64,
    /// The last step's mean loss.
    pub loss: f64,
    /// Milliseconds per optimizer step (its micro-batches' forward and
    /// backward and the optimizer's step).
    pub ms_per_step: f64,
}

impl PlainReport {
    /// The line the benchmark reads: `plain {name}: N steps, loss L, X ms/step`.
    pub fn line(&self, name: &str) -> String {
        format!(
            "plain {name}: {} steps, loss {:.4}, {:.2} ms/step",
            self.steps, self.loss, self.ms_per_step
        )
    }
}

/// Train as `o` says (epochs, train length, batch size, accumulation,
/// seed; no schedule, no evaluation) in one process: `step` takes the
/// training split and one optimizer step's micro-batches (positions in the
/// split) and returns their mean loss. Only `step` is timed.
///
/// # Errors
/// The data file's; `step`'s.
pub fn train_plain(
    o: &RunOptions,
    mut step: impl FnMut(&Split, &[&[usize]]) -> Result<f64>,
) -> Result<PlainReport> {
    let data = std::sync::Arc::new(Digits::load(&o.data)?);
    let (train, _) = data.split();
    let train = train.truncate_to(o.train_len);
    let n = train.len();
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = o.seed | 1;
    let (mut steps, mut time, mut loss) = (0u64, 0.0f64, f64::NAN);
    for _ in 0..o.epochs {
        if o.shuffle {
            // Fisher-Yates with xorshift: any fixed order does for timing.
            for i in (1..n).rev() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                order.swap(i, (rng % (i as u64 + 1)) as usize);
            }
        }
        let batches: Vec<&[usize]> = order.chunks(o.batch_size).collect();
        for group in batches.chunks(o.accumulation) {
            let start = Instant::now();
            loss = step(&train, group)?;
            time += start.elapsed().as_secs_f64();
            steps += 1;
        }
    }
    Ok(PlainReport {
        steps,
        loss,
        ms_per_step: time * 1000.0 / steps.max(1) as f64,
    })
}
