//! `candle-digits`: a candle MLP trained on the 8x8 digits data set on N
//! ranks.
//!
//! ```sh
//! scripts/digits_data.sh            # the data set alone (or make tch-setup)
//! cargo build --release -p accel-launcher -p accel-example-candle-digits
//! target/release/accel launch -n 2 --backend cpu-gloo -- target/release/candle-digits
//! target/release/accel launch -n 2 --backend cpu-gloo -- target/release/candle-digits --stop-after 60
//! target/release/accel launch -n 2 --backend cpu-gloo -- target/release/candle-digits --resume
//! ```
//!
//! The main process prints the loss every 10 optimizer steps, the held-out
//! accuracy after every epoch (gathered with `gather_for_metrics`) and a
//! checksum of the final parameters, so a stopped-and-resumed run can be
//! compared bit for bit with an uninterrupted one.

use std::path::PathBuf;
use std::process::ExitCode;

use accel_example_candle_digits::{train, OptimizerChoice, Options};
use accel_example_kit::cli;

const USAGE: &str =
    "usage: candle-digits [--data FILE] [--epochs N] [--train-len N] [--batch-size N]
                     [--accumulation K] [--lr X] [--hidden N] [--seed N]
                     [--optimizer adamw|candle-adamw|sgd] [--no-shuffle] [--no-eval]
                     [--save-every N] [--keep N] [--checkpoint-dir DIR]
                     [--resume] [--stop-after STEP] [--dump-params FILE]
                     [--max-grad-norm X] [--save-model DIR]
                     [--mixed-precision no|bf16|fp16] [--plain]";

/// The flags, the parameters' dump file, and `--plain`: the same training
/// in plain candle without accel (one process; for the integration's cost).
type Parsed = (Options, Option<PathBuf>, bool);

fn parse(args: &[String]) -> Result<Parsed, String> {
    let mut o = Options::default();
    let mut dump = None;
    let mut plain = false;
    cli::read_flags(args, USAGE, |flag, flags| {
        match flag {
            "--plain" => plain = true,
            "--optimizer" => o.optimizer = optimizer(&flags.value(flag)?)?,
            "--dump-params" => dump = Some(flags.path(flag)?),
            "--save-model" => o.own.save_model = Some(flags.path(flag)?),
            _ => return o.run.read_flag(flag, flags),
        }
        Ok(true)
    })?;
    if o.run.batch_size == 0 || o.run.accumulation == 0 {
        return Err("--batch-size and --accumulation must be at least 1".into());
    }
    Ok((o, dump, plain))
}

fn optimizer(v: &str) -> Result<OptimizerChoice, String> {
    Ok(match v {
        "adamw" => OptimizerChoice::AdamW,
        "candle-adamw" => OptimizerChoice::CandleAdamW,
        "sgd" => OptimizerChoice::Sgd,
        v => {
            return Err(format!(
                "--optimizer: {v:?} is not adamw, candle-adamw or sgd"
            ))
        }
    })
}

fn main() -> ExitCode {
    cli::main("candle-digits", parse, |(opts, dump, plain)| {
        if plain {
            let r = accel_example_candle_digits::plain::train_plain(&opts.run)?;
            println!("{}", r.line("candle"));
            return Ok(());
        }
        let acc = accel::Accelerator::new()?;
        if acc.is_main_process() {
            // candle's CPU kernels use rayon's pool (RAYON_NUM_THREADS,
            // which accel launch sets to each worker's share of the cores).
            println!(
                "{}, {} rayon threads per rank",
                opts.banner(&acc),
                candle_core::utils::get_num_threads()
            );
        }
        let report = train(&acc, &opts, |line| println!("{line}"))?;
        if acc.is_main_process() {
            report.print("", dump.as_deref())?;
        }
        acc.wait_for_everyone()
    })
}
