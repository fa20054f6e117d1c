//! `zero-bench`: memory and step time of ZeRO stages none / optimizer /
//! gradients / full on N ranks (see the library's docs for the method).
//!
//! ```sh
//! accel launch -n 4 --backend cpu-gloo -- target/release/zero-bench --model small
//! accel launch -n 4 --backend cpu-gloo -- target/release/zero-bench --model large --json
//! ```

#![forbid(unsafe_code)]

use std::process::ExitCode;

use accel_example_zero_bench::{
    heap, median, memory_table, run, save_stall, summarize, time_table, Config, Run,
};
use clap::{Parser, ValueEnum};

#[global_allocator]
static ALLOC: heap::Counting = heap::Counting;

/// The models the benchmark knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Model {
    /// The digits demo's classifier shape (examples/tch-digits):
    /// 64 → 64 → 64 → 10, 8,970 parameters.
    Small,
    /// 1024 → 1024 ×6 → 16: 6.3 M parameters (25.2 MB of f32), 7 units.
    Large,
    /// 8 → 16 → 16 → 1: for smoke tests.
    Tiny,
}

impl Model {
    fn widths(self) -> Vec<usize> {
        match self {
            Model::Small => vec![64, 64, 64, 10],
            Model::Large => vec![1024, 1024, 1024, 1024, 1024, 1024, 1024, 16],
            Model::Tiny => vec![8, 16, 16, 1],
        }
    }
}

/// Which tables to print.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Tables {
    /// Memory and step time.
    Both,
    /// Memory only.
    Memory,
    /// Step time only.
    Time,
}

/// Per-rank memory and step time of accel::zero's sharding stages.
#[derive(Debug, Parser)]
#[command(name = "zero-bench")]
struct Args {
    /// The model.
    #[arg(long, value_enum, default_value = "small")]
    model: Model,
    /// Layer widths `in,h1,...,out` instead of a named model.
    #[arg(long, value_delimiter = ',')]
    widths: Option<Vec<usize>>,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Untimed steps per stage and round (at least 1).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Timed steps per stage and round.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Rounds over the stages.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// What to run, in the order of each round: `ddp` (accel's prepared
    /// model and optimizer, no accel::zero) and ZeRO stages.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ddp,none,optimizer,gradients,full"
    )]
    stages: Vec<String>,
    /// The tables to print (Markdown).
    #[arg(long, value_enum, default_value = "both")]
    tables: Tables,
    /// Print the summaries and every sample as one JSON object instead.
    #[arg(long)]
    json: bool,
    /// Instead of the tables: how long one save of a stage-3 run stops
    /// training, save_state against save_state_async, checkpoints under DIR.
    #[arg(long, value_name = "DIR")]
    save_stall: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let stages: Result<Vec<Run>, _> = args.stages.iter().map(|s| s.parse()).collect();
    let stages = match stages {
        Ok(s) => s,
        Err(e) => {
            eprintln!("zero-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let cfg = Config {
        widths: args.widths.clone().unwrap_or_else(|| args.model.widths()),
        batch: args.batch,
        warmup: args.warmup,
        steps: args.steps,
        rounds: args.rounds,
        stages,
    };
    let result = accel::run(|acc| {
        if let Some(dir) = &args.save_stall {
            let (sync, background) = save_stall(acc, &cfg, dir)?;
            if acc.is_main_process() {
                let (ms, mb) = (median(&sync), median(&background));
                let best = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
                println!(
                    "save stall, {} ranks, stage 3, widths {:?}: save_state median {:.1} ms (best {:.1}), save_state_async median {:.1} ms (best {:.1}): {:.1}x median, {:.1}x best-vs-best",
                    acc.world_size(),
                    cfg.widths,
                    ms * 1e3,
                    best(&sync) * 1e3,
                    mb * 1e3,
                    best(&background) * 1e3,
                    ms / mb,
                    best(&sync) / best(&background)
                );
            }
            return acc.wait_for_everyone();
        }
        let samples = run(acc, &cfg)?;
        if acc.is_main_process() {
            let sums = summarize(&samples, &cfg.stages);
            let numel = sums.first().map_or(0, |s| s.memory.numel);
            if args.json {
                let v = serde_json::json!({
                    "world_size": acc.world_size(),
                    "backend": acc.backend_name(),
                    "widths": cfg.widths,
                    "numel": numel,
                    "batch": cfg.batch,
                    "steps": cfg.steps,
                    "rounds": cfg.rounds,
                    "summaries": sums,
                    "samples": samples,
                });
                println!("{v}");
            } else {
                let title = format!(
                    "{} ranks on {}, widths {:?} ({} parameters, {:.2} MiB), batch {} per rank, {} timed steps x {} rounds",
                    acc.world_size(),
                    acc.backend_name(),
                    cfg.widths,
                    numel,
                    numel as f64 * 4.0 / (1024.0 * 1024.0),
                    cfg.batch,
                    cfg.steps,
                    cfg.rounds
                );
                println!("{title}\n");
                if args.tables != Tables::Time {
                    println!("{}", memory_table(&sums));
                }
                if args.tables != Tables::Memory {
                    println!("{}", time_table(&sums));
                }
            }
        }
        acc.wait_for_everyone()
    });
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("zero-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
