use std::sync::{Arc, Mutex};

use accel::train::*;

/// `y = w·x + b`, with the gradient of the mean squared error by hand.
struct Linear {
    w: Vec<f32>,
    b: Vec<f32>,
    gw: Vec<f32>,
    gb: Vec<f32>,
}

impl Linear {
    fn new(d: usize) -> Linear {
        Linear {
            w: vec![0.0; d],
            b: vec![0.0],
            gw: vec![0.0; d],
            gb: vec![0.0],
        }
    }
    fn forward(&self, x: &[f32]) -> f32 {
        self.b[0] + x.iter().zip(&self.w).map(|(a, b)| a * b).sum::<f32>()
    }
    /// Adds `scale ×` the gradient of the batch's mean squared error.
    fn loss_and_grad(&mut self, batch: &[Sample], scale: f32) -> f32 {
        let n = batch.len() as f32;
        let mut loss = 0.0;
        for s in batch {
            let e = self.forward(&s.x) - s.y;
            loss += e * e / n;
            self.gb[0] += scale * 2.0 * e / n;
            for (g, x) in self.gw.iter_mut().zip(&s.x) {
                *g += scale * 2.0 * e * x / n;
            }
        }
        loss
    }
}

impl Parameters for Linear {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        f(ParamRef::host("w", &self.w, &self.gw));
        f(ParamRef::host("b", &self.b, &self.gb));
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        f(ParamMut::host("w", &mut self.w, &mut self.gw));
        f(ParamMut::host("b", &mut self.b, &mut self.gb));
    }
}

#[derive(Clone)]
struct Sample {
    x: Vec<f32>,
    y: f32,
}

/// `len` samples of a fixed linear target, the same on every rank.
struct Synthetic {
    len: usize,
}

impl Dataset for Synthetic {
    type Item = Sample;
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, i: usize) -> Sample {
        let x: Vec<f32> = (0..4)
            .map(|j| ((i * 7 + j * 3) % 11) as f32 / 11.0 - 0.5)
            .collect();
        let y = 0.5 + x.iter().enumerate().map(|(j, v)| v * j as f32).sum::<f32>();
        Sample { x, y }
    }
}

/// Optimizer steps so far, saved with every checkpoint.
#[derive(Default)]
struct Counter(u64);
impl Stateful for Counter {
    fn state_dict(&self) -> accel::Result<StateDict> {
        let mut s = StateDict::default();
        s.put("n", &self.0);
        Ok(s)
    }
    fn load_state_dict(&mut self, s: StateDict) -> accel::Result<()> {
        self.0 = s.get("n")?;
        Ok(())
    }
}

fn main() -> accel::Result<()> {
    let acc = accel::Accelerator::new()?.with_training(TrainConfig {
        gradient_accumulation_steps: 2,
        total_limit: Some(3),     // keep the 3 newest checkpoints
        ..TrainConfig::default()  // even_batches, 25 MiB buckets, ...
    })?;
    acc.set_seed(42, true); // per-rank RNG: seed + rank
    acc.init_trackers(
        "guide",
        "runs",
        &["jsonl", "tensorboard"],
        &acc.training_config(),
    )?;

    let mut model = acc.prepare_model(Linear::new(4))?; // rank 0's weights everywhere
    let mut opt = acc.prepare_optimizer(Sgd::new(0.1).with_momentum(0.9))?;
    let mut sched = acc.prepare_scheduler(LinearSchedule::new(0.1, 10, 200))?;
    let mut train = acc.prepare_loader(DataLoader::new(Synthetic { len: 1000 }, 16).shuffle(42))?;
    let mut eval = acc.prepare_loader(DataLoader::new(Synthetic { len: 203 }, 16))?;

    // Anything else that must survive a restart.
    let steps = Arc::new(Mutex::new(Counter::default())); // impl Stateful
    acc.register_for_checkpointing(steps.clone());

    if acc.latest_checkpoint("ckpt")?.is_some() {
        // The newest intact checkpoint (a damaged newer one is skipped with a warning).
        acc.load_latest_intact(
            "ckpt",
            &mut [&mut model, &mut opt, &mut sched, &mut train, &mut eval],
        )?;
    }

    while train.epoch() < 3 {
        while let Some(batch) = train.next_batch() {
            let step = acc.accumulate(&batch); // the cadence decides
            let loss = acc.backward(&mut model, |m, scale| m.loss_and_grad(&batch.items, scale))?;
            opt.step(&mut model)?; // only on synchronising batches
            sched.step(&mut opt); // num_processes times per optimizer step
            opt.zero_grad(&mut model); // only on synchronising batches
            if step.optimizer_step {
                let mean = acc.reduce(&[loss], "mean")?[0];
                let n = {
                    let mut s = steps.lock().unwrap();
                    s.0 += 1;
                    s.0
                };
                acc.log(&[("loss", f64::from(mean))], n)?; // main process only
                if n % 5 == 0 {
                    acc.save_state("ckpt", &[&model, &opt, &sched, &train, &eval])?;
                }
            }
        }
        let (mut sum, mut n) = (0.0, 0);
        while let Some(b) = eval.next_batch() {
            let errs: Vec<f32> = b
                .items
                .iter()
                .map(|s| (model.forward(&s.x) - s.y).powi(2))
                .collect();
            let all = acc.gather_for_metrics(&errs, &b)?; // every sample exactly once
            n += all.len();
            sum += all.iter().sum::<f32>();
        }
        acc.print(format_args!("eval mse {} over {n} samples", sum / n as f32));
    }
    acc.save_model(&*model, "model", DEFAULT_MAX_SHARD_SIZE)?; // model.safetensors, for any world size
    acc.end_training()
}
