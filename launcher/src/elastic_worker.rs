//! `accel elastic-worker` (hidden): a small real training run for elastic
//! launches (the tests of `--num-machines MIN:MAX` and `make
//! elastic-demo`). It resumes from the newest checkpoint in its folder
//! whenever there is one (at whatever world size the round has), saves every
//! `--save-every` steps, and logs the samples of every step per rank and
//! attempt, so that a test can check that every sample of an epoch was
//! trained on exactly once across the restarts.
//!
//! Sample log (`--sample-log DIR`): `DIR/a{attempt}-rank{rank}.log`, one
//! line per step: `step S epoch E i,j,...`; and `DIR/a{attempt}.resumed`,
//! the step the attempt resumed after (0: started fresh). The steps of
//! attempt `a` that count are those up to the step attempt `a + 1`
//! resumed after (the rest were computed again).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use accel::train::{DataLoader, Sgd, StateDict, Stateful, TrainConfig};
use accel_api::{Error, Result};
use accel_conformance::fixtures::{Mlp, Synthetic};

/// Arguments of `accel elastic-worker`.
#[derive(Debug, clap::Args)]
pub struct ElasticWorkerArgs {
    /// Folder of the run's `checkpoint_N` directories (shared by all machines).
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: PathBuf,
    /// Folder of the per-rank sample logs.
    #[arg(long, value_name = "DIR")]
    sample_log: Option<PathBuf>,
    /// Training samples.
    #[arg(long, default_value_t = 96)]
    train_len: usize,
    /// Samples per batch per rank.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Epochs.
    #[arg(long, default_value_t = 2)]
    epochs: u64,
    /// Save every this many optimizer steps.
    #[arg(long, default_value_t = 2)]
    save_every: u64,
    /// Sleep this long after each step (time for a test to kill a machine).
    #[arg(long, default_value_t = 0)]
    step_delay_ms: u64,
    /// Seed of the data order, the weights and the input noise.
    #[arg(long, default_value_t = 3)]
    seed: u64,
}

#[derive(Debug, Default)]
struct Steps(u64);

impl Stateful for Steps {
    fn state_dict(&self) -> Result<StateDict> {
        let mut s = StateDict::default();
        s.put("steps", &self.0);
        Ok(s)
    }
    fn load_state_dict(&mut self, state: StateDict) -> Result<()> {
        self.0 = state.get("steps")?;
        Ok(())
    }
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |e| Error::io(what, e)
}

/// Run the worker.
///
/// # Errors
/// Whatever accel reports (communication, checkpoints), and the logs' I/O.
pub fn run(a: ElasticWorkerArgs) -> Result<ExitCode> {
    let acc = accel::Accelerator::new()?;
    acc.set_training_config(TrainConfig {
        total_limit: Some(2),
        ..TrainConfig::default()
    })?;
    acc.set_seed(a.seed, true);
    let (rank, world) = (acc.rank(), acc.world_size());
    let attempt: u32 = std::env::var("ACCEL_RESTART_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let main = acc.is_main_process();
    let mut model = acc.prepare_model(Mlp::new(8, a.seed))?;
    let mut opt = acc.prepare_optimizer(Sgd::new(0.05).with_momentum(0.9))?;
    let data = Synthetic {
        len: a.train_len,
        seed: a.seed,
    };
    let mut loader = acc.prepare_loader(DataLoader::new(data, a.batch_size).shuffle(a.seed))?;
    let steps = Arc::new(Mutex::new(Steps::default()));
    acc.register_for_checkpointing(steps.clone());
    let step_now = || steps.lock().map(|s| s.0).unwrap_or(0);
    if acc.latest_checkpoint(&a.checkpoint_dir)?.is_some() {
        let dir = acc.load_state(&a.checkpoint_dir, &mut [&mut model, &mut opt, &mut loader])?;
        if main {
            println!(
                "resumed from {} at step {} at world size {world}: epoch {}, sample {} of the epoch",
                dir.display(),
                step_now(),
                loader.epoch(),
                loader.sampler_state().epoch_offset
            );
        }
    } else if main {
        println!("started fresh at world size {world}");
    }
    let mut log = match &a.sample_log {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(io(format!("creating {}", d.display())))?;
            if main {
                let p = d.join(format!("a{attempt}.resumed"));
                std::fs::write(&p, step_now().to_string())
                    .map_err(io(format!("writing {}", p.display())))?;
            }
            let p = d.join(format!("a{attempt}-rank{rank}.log"));
            Some(std::fs::File::create(&p).map_err(io(format!("creating {}", p.display())))?)
        }
        None => None,
    };
    while loader.epoch() < a.epochs {
        let epoch = loader.epoch();
        while let Some(b) = loader.next_batch() {
            let step = step_now() + 1;
            if let Some(f) = log.as_mut() {
                let idx: Vec<String> = b.indices.iter().map(|i| i.to_string()).collect();
                writeln!(f, "step {step} epoch {epoch} {}", idx.join(","))
                    .and_then(|()| f.flush())
                    .map_err(io("writing the sample log".into()))?;
            }
            let mut items = b.items.clone();
            {
                let mut rng = acc.rng()?;
                for v in items.iter_mut().flat_map(|s| s.x.iter_mut()) {
                    *v += 0.01 * rng.normal();
                }
            }
            let loss = acc.backward(&mut model, |m, scale| m.loss_and_grad(&items, scale))?;
            opt.step(&mut model)?;
            opt.zero_grad(&mut model);
            let mean = acc.reduce(&[loss], "mean")?[0];
            if let Ok(mut s) = steps.lock() {
                s.0 = step;
            }
            if main {
                println!("step {step:>3}  epoch {epoch}  world {world}  loss {mean:.6}");
            }
            if a.save_every > 0 && step.is_multiple_of(a.save_every) {
                acc.save_state(&a.checkpoint_dir, &[&model, &opt, &loader])?;
            }
            if a.step_delay_ms > 0 {
                std::thread::sleep(std::time::Duration::from_millis(a.step_delay_ms));
            }
        }
    }
    if main {
        // The loss over the whole training set, with the final weights.
        let mut sum = 0.0f64;
        for i in 0..data.len {
            let s = accel::train::Dataset::get(&data, i);
            sum += f64::from((model.forward(&s.x) - s.y).powi(2));
        }
        println!(
            "final: {} steps, world size {world}, loss {:.6} over {} samples",
            step_now(),
            sum / data.len as f64,
            data.len
        );
    }
    acc.wait_for_everyone()?;
    Ok(ExitCode::SUCCESS)
}
