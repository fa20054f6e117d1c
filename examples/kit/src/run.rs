//! The pieces of a demo's training loop that are not its engine's: the
//! optimizer-step counter that checkpoints carry, resume-or-start-fresh,
//! the parameter checksum, the digits demos' common settings, their log
//! lines and their final report.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use accel::train::{
    Checkpointed, Dataset, LinearSchedule, MixedPrecision, Parameters, PreparedLoader, StateDict,
    Stateful, TrainConfig,
};
use accel::{Accelerator, Error, Result};

use crate::cli::Flags;
use crate::digits::Digits;

/// FNV-1a 64 over the little-endian bytes of `values`: the checksum the
/// demos print so two runs can be compared bit for bit (equal checksums
/// mean bit-identical parameters).
pub fn checksum(values: &[f32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in values.iter().flat_map(|v| v.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Every parameter value in visiting order.
///
/// # Panics
/// When a parameter is not an f32 host tensor (the demos' are).
pub fn flat_params(model: &impl Parameters) -> Vec<f32> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| {
        out.extend_from_slice(
            p.value_f32()
                .expect("the demo's variables are f32 CPU tensors"),
        )
    });
    out
}

#[derive(Debug, Default)]
struct Progress {
    steps: u64,
}

impl Stateful for Progress {
    fn state_dict(&self) -> Result<StateDict> {
        let mut s = StateDict::default();
        s.put("steps", &self.steps);
        Ok(s)
    }
    fn load_state_dict(&mut self, state: StateDict) -> Result<()> {
        self.steps = state.get("steps")?;
        Ok(())
    }
}

/// Optimizer steps taken, including those before a resume: registered
/// for checkpointing, so `save_state` keeps it and `load_state` restores
/// it.
#[derive(Clone, Debug)]
pub struct Steps(Arc<Mutex<Progress>>);

impl Steps {
    /// A counter at 0, registered with `acc` for checkpointing.
    pub fn register(acc: &Accelerator) -> Steps {
        let progress = Arc::new(Mutex::new(Progress::default()));
        acc.register_for_checkpointing(progress.clone());
        Steps(progress)
    }

    /// Steps taken so far.
    pub fn get(&self) -> u64 {
        self.0.lock().expect("progress").steps
    }

    /// Count one more step; the new count.
    pub fn advance(&self) -> u64 {
        let mut p = self.0.lock().expect("progress");
        p.steps += 1;
        p.steps
    }
}

/// With `resume`, load the newest checkpoint under `dir` into `objects`
/// (and the registered ones), or say that there is none; without, the main
/// process deletes `dir` (a fresh run owns its checkpoint folder). Every
/// rank then waits for the others. The checkpoint loaded, if any: say it
/// with [`resumed_line`] once the objects are free again.
///
/// # Errors
/// `load_state`'s; [`accel::ErrorKind::Io`] when `dir` cannot be removed.
pub fn resume_or_start_fresh(
    acc: &Accelerator,
    resume: bool,
    dir: &Path,
    objects: &mut [&mut dyn Checkpointed],
    say: &mut dyn FnMut(String),
) -> Result<Option<PathBuf>> {
    let mut loaded = None;
    if resume {
        match acc.latest_checkpoint(dir)? {
            Some(_) => loaded = Some(acc.load_state(dir, objects)?),
            None => say(format!(
                "no checkpoint in {}: starting fresh",
                dir.display()
            )),
        }
    } else if acc.is_main_process() && dir.exists() {
        std::fs::remove_dir_all(dir)
            .map_err(|e| Error::io(format!("removing {}", dir.display()), e))?;
    }
    acc.wait_for_everyone()?;
    Ok(loaded)
}

/// "resumed from DIR at step N (epoch E, batch B)", the position `loader`
/// was restored to.
pub fn resumed_line<D: Dataset>(dir: &Path, steps: &Steps, loader: &PreparedLoader<D>) -> String {
    format!(
        "resumed from {} at step {} (epoch {}, batch {})",
        dir.display(),
        steps.get(),
        loader.epoch(),
        loader.sampler_state().batches_consumed
    )
}

/// The line a demo says when it stops at `--stop-after`.
pub fn stopping_line(steps: u64) -> String {
    format!("stopping after step {steps} without saving (as if killed); rerun with --resume")
}

/// A digits demo's own settings (beside [`RunOptions`] and its optimizer
/// choice), and its name: the binary's, and its folder under `target/`.
pub trait Demo {
    /// `candle-digits`, `tch-digits`.
    const NAME: &'static str;
}

/// A digits demo's settings (its binary's flags): the common ones, its
/// optimizer choice `O` and its own settings `X`.
#[derive(Clone, Debug, PartialEq)]
pub struct DemoOptions<O, X> {
    /// The settings every digits demo has.
    pub run: RunOptions,
    /// Optimizer.
    pub optimizer: O,
    /// The demo's own.
    pub own: X,
}

impl<O: std::fmt::Debug, X: Demo> DemoOptions<O, X> {
    /// The line the demo starts with: ranks, engine, batch and
    /// accumulation, and its optimizer.
    pub fn banner(&self, acc: &Accelerator) -> String {
        format!(
            "{}: {} ranks on {}, batch {} x {} ranks x {} accumulation steps, {:?}",
            X::NAME,
            acc.world_size(),
            acc.backend_name(),
            self.run.batch_size,
            acc.world_size(),
            self.run.accumulation,
            self.optimizer,
        )
    }
}

impl<O: Default, X: Default + Demo> Default for DemoOptions<O, X> {
    fn default() -> Self {
        DemoOptions {
            run: RunOptions::new(X::NAME),
            optimizer: O::default(),
            own: X::default(),
        }
    }
}

/// The settings both digits demos share (the engine's own, such as its
/// optimizers, sit beside them in each demo's `Options`).
#[derive(Clone, Debug, PartialEq)]
pub struct RunOptions {
    /// The digits.csv.gz file.
    pub data: PathBuf,
    /// Epochs over the training split.
    pub epochs: u64,
    /// Use only the first N training images (all when `None`).
    pub train_len: Option<usize>,
    /// Images per batch per rank.
    pub batch_size: usize,
    /// Gradient accumulation steps.
    pub accumulation: usize,
    /// Peak learning rate (linear decay to 0, 5% warm-up).
    pub lr: f64,
    /// Hidden width.
    pub hidden: usize,
    /// Seed of the initial weights and the data order.
    pub seed: u64,
    /// Shuffle the training data every epoch.
    pub shuffle: bool,
    /// Save a checkpoint every this many optimizer steps (0: never).
    pub save_every: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// Folder of `checkpoint_N` directories.
    pub checkpoint_dir: PathBuf,
    /// Continue from the newest checkpoint in `checkpoint_dir`.
    pub resume: bool,
    /// Exit, without saving, right after this optimizer step.
    pub stop_after: Option<u64>,
    /// Skip the evaluation passes (for benchmarks and tests).
    pub no_eval: bool,
    /// Clip the gradients' total 2-norm to this on every optimizer step.
    pub max_grad_norm: Option<f64>,
    /// Mixed precision (`--mixed-precision no|bf16|fp16`); `None` takes
    /// what `accel launch --mixed-precision` set.
    pub mixed_precision: Option<MixedPrecision>,
    /// Reduce gradient buckets while the backward runs (default; `--no-overlap`
    /// reduces them all after it: the same results).
    pub overlap: bool,
}

impl RunOptions {
    /// The defaults, with checkpoints under `target/<demo>/checkpoints`.
    pub fn new(demo: &str) -> RunOptions {
        RunOptions {
            data: Digits::default_path(),
            epochs: 10,
            train_len: None,
            batch_size: 16,
            accumulation: 2,
            lr: 0.01,
            hidden: 64,
            seed: 42,
            shuffle: true,
            save_every: 20,
            keep: 2,
            checkpoint_dir: PathBuf::from(format!("target/{demo}/checkpoints")),
            resume: false,
            stop_after: None,
            no_eval: false,
            max_grad_norm: None,
            mixed_precision: None,
            overlap: true,
        }
    }

    /// Read `flag` (and its value from `flags`) when it is one of these
    /// settings' flags: `Ok(false)` when it is not.
    ///
    /// # Errors
    /// A missing or malformed value, naming the flag.
    pub fn read_flag(&mut self, flag: &str, flags: &mut Flags<'_>) -> Result<bool, String> {
        match flag {
            "--data" => self.data = flags.path(flag)?,
            "--epochs" => self.epochs = flags.num(flag)?,
            "--train-len" => self.train_len = Some(flags.num(flag)?),
            "--batch-size" => self.batch_size = flags.num(flag)?,
            "--accumulation" => self.accumulation = flags.num(flag)?,
            "--lr" => self.lr = flags.num(flag)?,
            "--hidden" => self.hidden = flags.num(flag)?,
            "--seed" => self.seed = flags.num(flag)?,
            "--no-shuffle" => self.shuffle = false,
            "--no-eval" => self.no_eval = true,
            "--no-overlap" => self.overlap = false,
            "--save-every" => self.save_every = flags.num(flag)?,
            "--keep" => self.keep = flags.num(flag)?,
            "--checkpoint-dir" => self.checkpoint_dir = flags.path(flag)?,
            "--resume" => self.resume = true,
            "--stop-after" => self.stop_after = Some(flags.num(flag)?),
            "--max-grad-norm" => self.max_grad_norm = Some(flags.num(flag)?),
            "--mixed-precision" => self.mixed_precision = Some(flags.parsed(flag)?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The accelerator's training configuration for these settings.
    pub fn train_config(&self) -> TrainConfig {
        TrainConfig {
            gradient_accumulation_steps: self.accumulation,
            total_limit: Some(self.keep),
            mixed_precision: self.mixed_precision,
            overlap_grad_sync: self.overlap,
            ..TrainConfig::default()
        }
    }

    /// The learning-rate schedule over the whole run: a linear decay from
    /// `lr` to 0 after a 5% warm-up, counted the way a prepared scheduler
    /// steps (once per rank per optimizer step), for a prepared loader of
    /// `batches` batches per epoch on `world` ranks.
    pub fn schedule(&self, batches: usize, world: usize) -> LinearSchedule {
        let steps_per_epoch = batches.div_ceil(self.accumulation) as u64;
        let total = steps_per_epoch * self.epochs * world as u64;
        LinearSchedule::new(self.lr, total / 20, total)
    }
}

/// The line a digits demo logs every 10 optimizer steps.
pub fn step_line(steps: u64, epoch: u64, loss: f64, lr: f64) -> String {
    format!("step {steps:>4}  epoch {epoch}  loss {loss:.4}  lr {lr:.5}")
}

/// The line a digits demo logs after an epoch's evaluation.
pub fn accuracy_line(epoch: u64, correct: u64, count: usize) -> String {
    let accuracy = correct as f64 / count.max(1) as f64;
    format!(
        "epoch {epoch} done: accuracy {:.2}% ({correct}/{count} held-out images, gather_for_metrics)",
        100.0 * accuracy
    )
}

/// What a digits run ends with.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Optimizer steps in total (including those before a resume).
    pub steps: u64,
    /// Final parameter values, in visiting order.
    pub params: Vec<f32>,
    /// [`checksum`] of `params`.
    pub checksum: String,
    /// Accuracy on the held-out images after the last epoch (NaN when no
    /// evaluation ran: check `eval_samples`).
    pub accuracy: f64,
    /// Held-out images the last evaluation gathered (all 360; 0 with
    /// `no_eval`).
    pub eval_samples: usize,
    /// Mean training loss of the last optimizer step, across ranks.
    pub last_loss: f64,
    /// The run stopped at `stop_after`.
    pub stopped: bool,
    /// Mean wall time of an optimizer step, in seconds.
    pub step_time: f64,
    /// Seconds per optimizer step spent averaging gradients after the
    /// backward pass ended (from its end to the end of
    /// `Accelerator::backward_overlapped`): the synchronisation the
    /// backward did not hide.
    pub sync_time: f64,
    /// Synchronising batches on which some gradient bucket started its
    /// all-reduce before the backward returned
    /// (`PreparedModel::last_sync_started_early`): 0 with `--no-overlap`,
    /// on one rank, or for an engine that reports its gradients only at
    /// the end of the backward.
    pub early_syncs: u64,
}

impl Report {
    /// Print the run's last line on stdout (the step it stopped at, or
    /// the steps, loss, accuracy, time per step with `time_note` after it,
    /// and the checksum), then write the parameters to `dump` (f32,
    /// little-endian, visiting order) when set.
    ///
    /// # Errors
    /// [`accel::ErrorKind::Io`] when `dump` cannot be written.
    pub fn print(&self, time_note: &str, dump: Option<&Path>) -> Result<()> {
        if self.stopped {
            println!(
                "stopped at step {}: params checksum {}",
                self.steps, self.checksum
            );
        } else {
            let accuracy = if self.eval_samples == 0 {
                "no held-out evaluation (--no-eval)".to_string()
            } else {
                format!(
                    "accuracy {:.2}% over {} held-out images",
                    100.0 * self.accuracy,
                    self.eval_samples
                )
            };
            println!(
                "final: {} steps, loss {:.4}, {accuracy}, {:.2} ms/step ({:.2} ms exposed sync){time_note}, params checksum {}",
                self.steps,
                self.last_loss,
                1e3 * self.step_time,
                1e3 * self.sync_time,
                self.checksum
            );
        }
        if let Some(path) = dump {
            let bytes: Vec<u8> = self.params.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(path, bytes)
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_is_fnv1a_over_the_bytes() {
        assert_eq!(checksum(&[]), "cbf29ce484222325");
        assert_ne!(checksum(&[0.0]), checksum(&[-0.0]));
    }

    #[test]
    fn common_flags_are_read_and_others_left() {
        let args: Vec<String> = ["--epochs", "4", "--no-eval", "--mixed-precision", "bf16"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let mut o = RunOptions::new("demo");
        let mut f = Flags::new(&args);
        while let Some(flag) = f.next_flag() {
            assert!(o.read_flag(flag, &mut f).expect("valid"), "{flag}");
        }
        assert_eq!((o.epochs, o.no_eval), (4, true));
        assert_eq!(o.mixed_precision, Some(MixedPrecision::Bf16));
        assert_eq!(o.checkpoint_dir, PathBuf::from("target/demo/checkpoints"));
        assert!(!o.read_flag("--optimizer", &mut f).expect("not ours"));
    }

    #[derive(Debug, Default, PartialEq)]
    struct Own(u8);

    impl Demo for Own {
        const NAME: &'static str = "some-demo";
    }

    #[test]
    fn demo_options_default_to_the_demo_s_folder() {
        let o = DemoOptions::<bool, Own>::default();
        let want = PathBuf::from("target/some-demo/checkpoints");
        assert_eq!(
            (o.run.checkpoint_dir, o.optimizer, o.own),
            (want, false, Own(0))
        );
    }
}
