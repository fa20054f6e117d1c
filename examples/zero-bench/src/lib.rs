//! `zero-bench`: per-rank memory and step time of `accel::zero`'s stages
//! (`none`, `optimizer`, `gradients`, `full`) on an MLP written unit by
//! unit ([`Deep`]), every layer a unit under `WrapPolicy::Depth(1)`.
//!
//! For each stage a rank builds the model and a
//! [`ZeroOptimizer`] (SGD with momentum), takes warm-up steps, then times
//! `steps` optimizer steps (each: barrier, forward and backward through the
//! optimizer's [`UnitGate`], `step`, zero the gradients; a step's time is
//! the slowest rank's). Stages run interleaved, `rounds` times, beside
//! `ddp` ([`Run::Ddp`]: the same model and steps through accel's prepared
//! model and optimizer, without `accel::zero`). Memory is
//! what the rank's objects report (the model's resident values and
//! gradients, at their most during a step and between steps; the
//! optimizer's `state_numel` and `buffer_numel`) and what the process's
//! heap holds ([`heap`]: a counting allocator the `zero-bench` binary
//! installs) and its peak resident set (`VmHWM`, reset per stage).
//!
//! ```sh
//! accel launch -n 4 --backend cpu-gloo -- target/release/zero-bench --model large
//! ```
//!
//! `scripts/zero_bench.sh` builds it, runs both models and prints the
//! tables of docs/benchmarks.md.

#![deny(unsafe_code)]

#[allow(unsafe_code)]
pub mod heap;
mod model;

use std::time::Instant;

use accel::train::{Optimizer, Parameters, PreparedModel, PreparedOptimizer, Sgd};
use accel::zero::{NoGate, ShardedSgd, Stage, UnitGate, WrapPolicy, ZeroOptimizer};
use accel::{Accelerator, CommunicatorExt, Error, ReduceOp, Result};
use serde::Serialize;

pub use model::{uniform, Deep};

/// One configuration the benchmark measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Run {
    /// accel's data-parallel training loop without `accel::zero`:
    /// `prepare_model` (bucketed gradient all-reduce) and a prepared
    /// [`Sgd`] with momentum, the model run through [`NoGate`].
    Ddp,
    /// A [`ZeroOptimizer`] at this stage.
    Zero(Stage),
}

impl Run {
    /// `ddp`, or the stage's name.
    pub fn name(self) -> &'static str {
        match self {
            Run::Ddp => "ddp",
            Run::Zero(s) => s.as_str(),
        }
    }
}

impl std::str::FromStr for Run {
    type Err = Error;

    /// `ddp`, or a stage as [`Stage`] reads it.
    fn from_str(s: &str) -> Result<Run> {
        if s.trim().eq_ignore_ascii_case("ddp") {
            Ok(Run::Ddp)
        } else {
            s.parse().map(Run::Zero)
        }
    }
}

/// What to run.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The model's widths, `[in, hidden..., out]`.
    pub widths: Vec<usize>,
    /// Samples per rank per step.
    pub batch: usize,
    /// Untimed steps before the timed ones (at least 1: the momentum
    /// buffers exist after the first).
    pub warmup: usize,
    /// Timed steps per stage per round.
    pub steps: usize,
    /// Rounds over the stages.
    pub rounds: usize,
    /// The configurations, in the order each round runs them.
    pub stages: Vec<Run>,
}

/// One rank's memory figures for one stage (elements are `f32`s).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Memory {
    /// Parameter elements of the model.
    pub numel: usize,
    /// Elements of one rank's shard (`ShardPlan::shard_numel`).
    pub shard_numel: usize,
    /// Elements of the largest unit.
    pub largest_unit: usize,
    /// Parameter values the model holds between steps.
    pub model_values_between: usize,
    /// The most parameter values the model held at once during a step
    /// (after each gate call).
    pub model_values_peak: usize,
    /// Gradients the model holds between steps.
    pub model_grads_between: usize,
    /// The most gradient elements the model held at once during a step.
    pub model_grads_peak: usize,
    /// `ZeroOptimizer::state_numel()` between steps.
    pub opt_state: usize,
    /// `ZeroOptimizer::buffer_numel()` between steps (its flat copies,
    /// shards and scratch).
    pub zero_buffers: usize,
    /// Heap bytes the stage's objects hold between steps.
    pub heap_between: usize,
    /// The most heap bytes held during the timed steps, above what was
    /// held before the stage's model was built.
    pub heap_peak: usize,
    /// Peak resident set during the timed steps (kB, `VmHWM` after a
    /// reset), 0 where `/proc` does not offer it.
    pub rss_peak_kb: usize,
}

impl Memory {
    fn to_vec(self) -> Vec<f64> {
        [
            self.numel,
            self.shard_numel,
            self.largest_unit,
            self.model_values_between,
            self.model_values_peak,
            self.model_grads_between,
            self.model_grads_peak,
            self.opt_state,
            self.zero_buffers,
            self.heap_between,
            self.heap_peak,
            self.rss_peak_kb,
        ]
        .map(|v| v as f64)
        .to_vec()
    }

    fn from_slice(v: &[f64]) -> Memory {
        let u = |i: usize| v[i] as usize;
        Memory {
            numel: u(0),
            shard_numel: u(1),
            largest_unit: u(2),
            model_values_between: u(3),
            model_values_peak: u(4),
            model_grads_between: u(5),
            model_grads_peak: u(6),
            opt_state: u(7),
            zero_buffers: u(8),
            heap_between: u(9),
            heap_peak: u(10),
            rss_peak_kb: u(11),
        }
    }

    /// The field-wise maximum.
    fn max(self, o: Memory) -> Memory {
        let (a, b) = (self.to_vec(), o.to_vec());
        Memory::from_slice(&a.iter().zip(&b).map(|(x, y)| x.max(*y)).collect::<Vec<_>>())
    }
}

/// One stage in one round, as rank 0 reports it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sample {
    /// The stage.
    pub stage: String,
    /// The round (from 0).
    pub round: usize,
    /// Each timed step's time in seconds (the slowest rank's).
    pub step_s: Vec<f64>,
    /// Each rank's memory figures.
    pub ranks: Vec<Memory>,
    /// The loss of the last step on rank 0 (the ranks' data differ).
    pub loss: f32,
}

/// A gate that forwards to the optimizer and notes the model's largest
/// resident values and gradients after every call.
struct Probe<'a, G> {
    inner: &'a mut G,
    values: usize,
    grads: usize,
}

impl<G: UnitGate> Probe<'_, G> {
    fn note(&mut self, model: &dyn Parameters) {
        let (mut v, mut g) = (0, 0);
        model.visit_params(&mut |p| {
            v += p.value.len();
            g += p.grad.len();
        });
        self.values = self.values.max(v);
        self.grads = self.grads.max(g);
    }
}

impl<G: UnitGate> UnitGate for Probe<'_, G> {
    fn gather(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()> {
        self.note(model);
        self.inner.gather(model, module)?;
        self.note(model);
        Ok(())
    }
    fn release(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()> {
        self.note(model);
        self.inner.release(model, module)?;
        self.note(model);
        Ok(())
    }
    fn reduce_grads(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()> {
        self.note(model);
        self.inner.reduce_grads(model, module)?;
        self.note(model);
        Ok(())
    }
}

/// Reset the process's peak resident set (Linux: `5` into
/// `/proc/self/clear_refs`); `false` where that is not possible.
fn reset_rss_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// `VmHWM` in kB, 0 where `/proc` does not offer it.
fn rss_peak_kb() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// This rank's inputs and targets for one step.
fn batch_of(acc: &Accelerator, widths: &[usize], batch: usize) -> (Vec<f32>, Vec<f32>) {
    let (din, dout) = (widths[0], widths[widths.len() - 1]);
    let r = acc.rank() as u64;
    let x = (0..batch * din)
        .map(|i| uniform(1000 + r, i as u64))
        .collect();
    let y = (0..batch * dout)
        .map(|i| uniform(2000 + r, i as u64))
        .collect();
    (x, y)
}

/// The benchmark's model and its ZeRO optimizer (SGD with momentum, a
/// unit per layer) at `stage`.
fn model_and_zero(
    acc: &Accelerator,
    cfg: &Config,
    stage: Stage,
) -> Result<(Deep, ZeroOptimizer<ShardedSgd>)> {
    let model = Deep::new(&cfg.widths)?;
    let sgd = ShardedSgd::new(1e-3).with_momentum(0.9);
    let zero = ZeroOptimizer::new(
        acc.comm().clone(),
        &model,
        stage,
        &WrapPolicy::Depth(1),
        sgd,
    )?;
    Ok((model, zero))
}

/// One stage: build, warm up, time; this rank's step times and memory.
fn run_stage(acc: &Accelerator, cfg: &Config, stage: Stage) -> Result<(Vec<f64>, Memory, f32)> {
    let base = heap::current();
    let (x, y) = batch_of(acc, &cfg.widths, cfg.batch);
    let (mut model, mut zero) = model_and_zero(acc, cfg, stage)?;
    let mut loss = 0.0;
    // One step; the model's largest resident values and gradients in it.
    let mut one_step =
        |model: &mut Deep, zero: &mut ZeroOptimizer<ShardedSgd>| -> Result<(usize, usize)> {
            let mut probe = Probe {
                inner: zero,
                values: 0,
                grads: 0,
            };
            loss = model.loss_and_grad_units(&x, &y, cfg.batch, 1.0, &mut probe)?;
            let seen = (probe.values, probe.grads);
            zero.step(model)?;
            model.zero_grad();
            Ok(seen)
        };
    // Stage 3 frees each unit at its first use: the warm-up is where the
    // model still holds everything it was built with.
    for _ in 0..cfg.warmup.max(1) {
        one_step(&mut model, &mut zero)?;
    }
    acc.comm().barrier()?;
    reset_rss_peak();
    heap::reset_peak();
    let (mut probe_values, mut probe_grads) = (0, 0);
    let mut times = Vec::with_capacity(cfg.steps);
    for _ in 0..cfg.steps {
        acc.comm().barrier()?;
        let t0 = Instant::now();
        let (v, g) = one_step(&mut model, &mut zero)?;
        times.push(t0.elapsed().as_secs_f64());
        probe_values = probe_values.max(v);
        probe_grads = probe_grads.max(g);
    }
    let mem = Memory {
        numel: zero.plan().numel(),
        shard_numel: zero.plan().shard_numel(),
        largest_unit: zero
            .plan()
            .units()
            .iter()
            .map(|u| u.numel)
            .max()
            .unwrap_or(0),
        model_values_between: model.resident_values(),
        model_values_peak: probe_values,
        model_grads_between: model.resident_grads(),
        model_grads_peak: probe_grads,
        opt_state: zero.state_numel(),
        zero_buffers: zero.buffer_numel(),
        heap_between: heap::current().saturating_sub(base),
        heap_peak: heap::peak().saturating_sub(base),
        rss_peak_kb: rss_peak_kb(),
    };
    Ok((times, mem, loss))
}

/// `ddp`: the same steps through accel's prepared model and optimizer.
fn run_ddp(acc: &Accelerator, cfg: &Config) -> Result<(Vec<f64>, Memory, f32)> {
    let base = heap::current();
    let (x, y) = batch_of(acc, &cfg.widths, cfg.batch);
    let mut model = acc.prepare_model(Deep::new(&cfg.widths)?)?;
    let mut opt = acc.prepare_optimizer(Sgd::new(1e-3).with_momentum(0.9))?;
    let mut loss = 0.0;
    let mut one_step =
        |model: &mut PreparedModel<Deep>, opt: &mut PreparedOptimizer<Sgd>| -> Result<()> {
            acc.accumulate_step(false);
            loss = acc.backward(model, |m, scale| {
                m.loss_and_grad_units(&x, &y, cfg.batch, scale, &mut NoGate)
            })??;
            opt.step(model)?;
            opt.zero_grad(model);
            Ok(())
        };
    for _ in 0..cfg.warmup.max(1) {
        one_step(&mut model, &mut opt)?;
    }
    acc.comm().barrier()?;
    reset_rss_peak();
    heap::reset_peak();
    let mut times = Vec::with_capacity(cfg.steps);
    for _ in 0..cfg.steps {
        acc.comm().barrier()?;
        let t0 = Instant::now();
        one_step(&mut model, &mut opt)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    let (heap_between, heap_peak) = (heap::current(), heap::peak());
    let numel = model.numel();
    // After the heap figures: the state dict is a copy.
    let opt_state = opt
        .state_dict()
        .tensors
        .values()
        .map(|t| t.data.len())
        .sum();
    let mem = Memory {
        numel,
        shard_numel: numel,
        largest_unit: 0,
        model_values_between: model.resident_values(),
        model_values_peak: model.resident_values(),
        model_grads_between: model.resident_grads(),
        model_grads_peak: model.resident_grads(),
        opt_state,
        zero_buffers: 0,
        heap_between: heap_between.saturating_sub(base),
        heap_peak: heap_peak.saturating_sub(base),
        rss_peak_kb: rss_peak_kb(),
    };
    Ok((times, mem, loss))
}

/// Run every stage `cfg.rounds` times, interleaved. Collective: every rank
/// calls it with the same `cfg`; every rank gets the same samples back.
///
/// # Errors
/// The model's, the optimizer's and the communicator's.
pub fn run(acc: &Accelerator, cfg: &Config) -> Result<Vec<Sample>> {
    let comm = acc.comm();
    let mut out = Vec::new();
    for round in 0..cfg.rounds {
        for &stage in &cfg.stages {
            let (times, mem, loss) = match stage {
                Run::Ddp => run_ddp(acc, cfg)?,
                Run::Zero(st) => run_stage(acc, cfg, st)?,
            };
            let step_s = comm.all_reduce_vec(&times, ReduceOp::Max)?;
            let all = comm.all_gather_vec(&mem.to_vec())?;
            let ranks = all
                .chunks(mem.to_vec().len())
                .map(Memory::from_slice)
                .collect();
            let loss = comm.all_gather_vec(&[loss])?[0];
            out.push(Sample {
                stage: stage.name().to_string(),
                round,
                step_s,
                ranks,
                loss,
            });
        }
    }
    Ok(out)
}

/// The median of `v` (the mean of the middle two for an even count); 0
/// for none.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// One stage's summary over rounds and ranks.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// The stage.
    pub stage: String,
    /// The field-wise maximum over ranks and rounds.
    pub memory: Memory,
    /// Median step time over every timed step of every round (s).
    pub median_s: f64,
    /// The fastest step (s).
    pub best_s: f64,
    /// Each round's median (s).
    pub round_medians_s: Vec<f64>,
}

/// Summaries per stage, in `stages` order.
pub fn summarize(samples: &[Sample], stages: &[Run]) -> Vec<Summary> {
    stages
        .iter()
        .map(|st| {
            let mine: Vec<&Sample> = samples.iter().filter(|s| s.stage == st.name()).collect();
            let all: Vec<f64> = mine.iter().flat_map(|s| s.step_s.iter().copied()).collect();
            let memory = mine
                .iter()
                .flat_map(|s| s.ranks.iter().copied())
                .fold(Memory::default(), Memory::max);
            Summary {
                stage: st.name().to_string(),
                memory,
                median_s: median(&all),
                best_s: all.iter().copied().fold(f64::INFINITY, f64::min),
                round_medians_s: mine.iter().map(|s| median(&s.step_s)).collect(),
            }
        })
        .collect()
}

/// Bytes in the table's unit: KiB for models under 4 MiB, else MiB.
fn in_unit(bytes: f64, kib: bool) -> String {
    if kib {
        format!("{:.1}", bytes / 1024.0)
    } else {
        format!("{:.2}", bytes / (1024.0 * 1024.0))
    }
}

/// The memory table of docs/benchmarks.md: per rank (the maximum over
/// ranks and rounds), ratios against `none` in brackets. KiB for a model
/// under 4 MiB, else MiB (the first line says which).
pub fn memory_table(sums: &[Summary]) -> String {
    use std::fmt::Write;
    let kib = sums.first().is_some_and(|s| s.memory.numel * 4 < 4 << 20);
    let mib = |bytes: f64| in_unit(bytes, kib);
    let el = |n: usize| mib(n as f64 * 4.0);
    let none = sums.iter().find(|s| s.stage == "none").map(|n| n.memory);
    let ratio = |x: usize, base: Option<usize>| match base {
        Some(b) if b > 0 => format!(" ({:.3})", x as f64 / b as f64),
        _ => String::new(),
    };
    let mut t = String::new();
    let _ = writeln!(
        t,
        "Memory per rank in {}:\n",
        if kib { "KiB" } else { "MiB" }
    );
    let _ = writeln!(
        t,
        "| stage | params in model, peak in step | params shard (plan) | grads in model, peak in step | grad shard (plan) | optimizer state | zero buffers | heap between steps | heap peak in step | RSS peak |"
    );
    let _ = writeln!(t, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for s in sums {
        let m = &s.memory;
        let pshard = if s.stage == "full" { m.shard_numel } else { 0 };
        let gshard = if s.stage == "none" {
            m.numel
        } else {
            m.shard_numel
        };
        // ddp has no optimizer-side copies: its gradients are averaged in
        // the model's own buffers.
        let (pshard, gshard, zbuf) = if s.stage == "ddp" {
            ("-".to_string(), "-".to_string(), "-".to_string())
        } else {
            (el(pshard), el(gshard), el(m.zero_buffers))
        };
        let _ = writeln!(
            t,
            "| {} | {}{} | {} | {}{} | {} | {}{} | {} | {}{} | {}{} | {} |",
            s.stage,
            el(m.model_values_peak),
            ratio(m.model_values_peak, none.map(|n| n.model_values_peak)),
            pshard,
            el(m.model_grads_peak),
            ratio(m.model_grads_peak, none.map(|n| n.model_grads_peak)),
            gshard,
            el(m.opt_state),
            ratio(m.opt_state, none.map(|n| n.opt_state)),
            zbuf,
            mib(m.heap_between as f64),
            ratio(m.heap_between, none.map(|n| n.heap_between)),
            mib(m.heap_peak as f64),
            ratio(m.heap_peak, none.map(|n| n.heap_peak)),
            mib(m.rss_peak_kb as f64 * 1024.0),
        );
    }
    t
}

/// The step-time table of docs/benchmarks.md: median and best over every
/// timed step of every round, each round's median, against `none`.
pub fn time_table(sums: &[Summary]) -> String {
    use std::fmt::Write;
    let none = sums.iter().find(|s| s.stage == "none");
    let vs = |x: f64, base: Option<f64>| match base {
        Some(b) if b > 0.0 => format!("{:+.1} %", (x / b - 1.0) * 100.0),
        _ => String::new(),
    };
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| stage | step median (ms) | best (ms) | round medians (ms) | median vs none | best vs none |"
    );
    let _ = writeln!(t, "|---|---:|---:|---|---:|---:|");
    for s in sums {
        let rounds: Vec<String> = s
            .round_medians_s
            .iter()
            .map(|r| format!("{:.1}", r * 1e3))
            .collect();
        let _ = writeln!(
            t,
            "| {} | {:.1} | {:.1} | {} | {} | {} |",
            s.stage,
            s.median_s * 1e3,
            s.best_s * 1e3,
            rounds.join(", "),
            vs(s.median_s, none.map(|n| n.median_s)),
            vs(s.best_s, none.map(|n| n.best_s)),
        );
    }
    t
}

/// How long one save stops training at stage 3, `save_state` against
/// `save_state_async` (issue 41), interleaved over `cfg.rounds`: per round,
/// the slowest rank's seconds in each call (the async one returns once
/// the state is in memory; the training step after it and the wait for
/// its commit are not counted), under `dir` (the two oldest checkpoints
/// are pruned as it goes).
///
/// # Errors
/// The saves', the steps'.
pub fn save_stall(
    acc: &Accelerator,
    cfg: &Config,
    dir: &std::path::Path,
) -> Result<(Vec<f64>, Vec<f64>)> {
    acc.set_training_config(accel::train::TrainConfig {
        total_limit: Some(2),
        ..accel::train::TrainConfig::default()
    })?;
    let (x, y) = batch_of(acc, &cfg.widths, cfg.batch);
    let (mut model, mut zero) = model_and_zero(acc, cfg, Stage::Full)?;
    let step = |model: &mut Deep, zero: &mut ZeroOptimizer<ShardedSgd>| -> Result<()> {
        model.loss_and_grad_units(&x, &y, cfg.batch, 1.0, zero)?;
        zero.step(model)?;
        model.zero_grad();
        Ok(())
    };
    for _ in 0..cfg.warmup.max(1) {
        step(&mut model, &mut zero)?;
    }
    let slowest =
        |t: f64| -> Result<f64> { Ok(acc.comm().all_reduce_vec(&[t], ReduceOp::Max)?[0]) };
    let (mut sync, mut background) = (Vec::new(), Vec::new());
    for _ in 0..cfg.rounds {
        acc.comm().barrier()?;
        let t0 = Instant::now();
        acc.save_state(dir.join("sync"), &[&zero])?;
        sync.push(slowest(t0.elapsed().as_secs_f64())?);
        step(&mut model, &mut zero)?;
        acc.comm().barrier()?;
        let t0 = Instant::now();
        acc.save_state_async(dir.join("async"), &[&zero])?;
        background.push(slowest(t0.elapsed().as_secs_f64())?);
        step(&mut model, &mut zero)?;
        acc.wait_for_save()?;
    }
    Ok((sync, background))
}
