//! `tch-digits`: a tch MLP trained on the 8x8 digits data set on N ranks.
//!
//! ```sh
//! make tch-setup && source .accel-cache/tch/env.sh
//! accel launch -n 2 --backend cpu-gloo -- target-tch/release/tch-digits
//! accel launch -n 2 --backend cpu-gloo -- target-tch/release/tch-digits --stop-after 60
//! accel launch -n 2 --backend cpu-gloo -- target-tch/release/tch-digits --resume
//! ```
//!
//! The main process prints the loss every 10 optimizer steps, the held-out
//! accuracy after every epoch (gathered with `gather_for_metrics`) and a
//! checksum of the final parameters, so a stopped-and-resumed run can be
//! compared bit for bit with an uninterrupted one. Loss, learning rate and
//! accuracy also go to two trackers under `--log-dir` (default
//! `target/tch-digits/runs`): `tch-digits/metrics.jsonl` and a TensorBoard
//! event file (`tensorboard --logdir target/tch-digits/runs`).

use std::path::PathBuf;
use std::process::ExitCode;

use accel_example_kit::cli;
use accel_example_tch_digits::{train, OptimizerChoice, Options};

const USAGE: &str = "usage: tch-digits [--data FILE] [--epochs N] [--train-len N] [--batch-size N]
                  [--accumulation K] [--lr X] [--hidden N] [--seed N]
                  [--optimizer adamw|torch-sgd] [--no-shuffle] [--no-eval]
                  [--save-every N] [--keep N] [--checkpoint-dir DIR]
                  [--resume] [--stop-after STEP] [--threads N]
                  [--log-dir DIR | --no-log] [--dump-params FILE]
                  [--mixed-precision no|bf16|fp16] [--max-grad-norm X] [--plain]";

struct Extra {
    threads: Option<i32>,
    /// Write the final parameters (little-endian f32, visiting order) here.
    dump_params: Option<PathBuf>,
    /// The same training in plain tch without accel (one process; for the
    /// integration's cost).
    plain: bool,
}

fn parse(args: &[String]) -> Result<(Options, Extra), String> {
    let mut o = Options::default();
    let mut x = Extra {
        threads: None,
        dump_params: None,
        plain: false,
    };
    cli::read_flags(args, USAGE, |flag, flags| {
        match flag {
            "--optimizer" => o.optimizer = optimizer(&flags.value(flag)?)?,
            "--log-dir" => o.own.log_dir = Some(flags.path(flag)?),
            "--no-log" => o.own.log_dir = None,
            "--threads" => x.threads = Some(flags.num(flag)?),
            "--dump-params" => x.dump_params = Some(flags.path(flag)?),
            "--plain" => x.plain = true,
            _ => return o.run.read_flag(flag, flags),
        }
        Ok(true)
    })?;
    Ok((o, x))
}

fn optimizer(v: &str) -> Result<OptimizerChoice, String> {
    match v {
        "adamw" => Ok(OptimizerChoice::AdamW),
        "torch-sgd" => Ok(OptimizerChoice::TorchSgd),
        v => Err(format!("--optimizer: {v:?} is not adamw or torch-sgd")),
    }
}

fn main() -> ExitCode {
    cli::main("tch-digits", parse, |(opts, extra)| {
        if extra.plain {
            if let Some(n) = extra.threads {
                tch::set_num_threads(n);
            }
            let r = accel_example_tch_digits::plain::train_plain(&opts.run)?;
            println!("{}", r.line("tch"));
            return Ok(());
        }
        let acc = accel::Accelerator::new()?;
        let threads = match extra.threads {
            Some(n) => {
                tch::set_num_threads(n);
                n as usize
            }
            None => accel_tch::set_threads_per_rank(&acc),
        };
        if acc.is_main_process() {
            let banner = opts.banner(&acc);
            println!("{banner}, {threads} libtorch threads per rank");
        }
        let report = train(&acc, &opts, |line| println!("{line}"))?;
        if acc.is_main_process() {
            report.print("", extra.dump_params.as_deref())?;
        }
        acc.wait_for_everyone()
    })
}
