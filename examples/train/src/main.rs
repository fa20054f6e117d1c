//! `train`: accel's main demo. Run it on two ranks with
//!
//! ```sh
//! accel launch -n 2 --backend cpu-gloo -- target/release/train
//! accel launch -n 2 --backend cpu-gloo -- target/release/train --stop-after 12   # "crash"
//! accel launch -n 2 --backend cpu-gloo -- target/release/train --resume          # exact resume
//! accel launch -n 2 --backend xla -- target/release/train                        # ranks as threads
//! ```
//!
//! The main process prints the loss of every optimizer step, the evaluation
//! metric of every epoch (gathered with `gather_for_metrics`) and a checksum
//! of the final parameters, so an interrupted-and-resumed run can be
//! compared bit for bit with an uninterrupted one.

use std::path::PathBuf;
use std::process::ExitCode;

use accel_example_train::{train, Options};

const USAGE: &str = "usage: train [--epochs N] [--train-len N] [--eval-len N] [--batch-size N]
             [--accumulation K] [--lr X] [--hidden N] [--seed N] [--noise X]
             [--save-every N] [--keep N] [--checkpoint-dir DIR]
             [--resume] [--stop-after STEP] [--step-delay-ms MS]";

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options::default();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{flag}: {v:?} is not a valid number"))
        }
        match flag.as_str() {
            "--epochs" => o.epochs = num(flag, value()?)?,
            "--train-len" => o.train_len = num(flag, value()?)?,
            "--eval-len" => o.eval_len = num(flag, value()?)?,
            "--batch-size" => o.batch_size = num(flag, value()?)?,
            "--accumulation" => o.accumulation = num(flag, value()?)?,
            "--lr" => o.lr = num(flag, value()?)?,
            "--hidden" => o.hidden = num(flag, value()?)?,
            "--seed" => o.seed = num(flag, value()?)?,
            "--noise" => o.noise = num(flag, value()?)?,
            "--save-every" => o.save_every = num(flag, value()?)?,
            "--keep" => o.keep = num(flag, value()?)?,
            "--checkpoint-dir" => o.checkpoint_dir = PathBuf::from(value()?),
            "--resume" => o.resume = true,
            "--stop-after" => o.stop_after = Some(num(flag, value()?)?),
            "--step-delay-ms" => o.step_delay_ms = num(flag, value()?)?,
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(o)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opts = match parse(&args) {
        Ok(o) => o,
        Err(m) => {
            eprintln!("{m}");
            return ExitCode::from(2);
        }
    };
    // `accel::run`: one rank per process, or (`accel launch --backend xla`)
    // this process's rank threads, each calling the closure.
    let run = |acc: &accel::Accelerator| -> accel::Result<()> {
        if acc.is_main_process() {
            println!(
                "train: {} ranks on {}, {} samples, batch {} x {} ranks x {} accumulation steps",
                acc.world_size(),
                acc.backend_name(),
                opts.train_len,
                opts.batch_size,
                acc.world_size(),
                opts.accumulation
            );
        }
        let report = train(acc, &opts, |line| println!("{line}"))?;
        if acc.is_main_process() {
            if report.stopped {
                println!(
                    "stopped at step {}: params checksum {}",
                    report.steps, report.checksum
                );
            } else {
                println!(
                    "final: {} steps, eval mse {:.6} over {} samples, params checksum {}",
                    report.steps, report.eval_mse, report.eval_samples, report.checksum
                );
            }
        }
        acc.wait_for_everyone()
    };
    match accel::run(run) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train: {e}");
            ExitCode::FAILURE
        }
    }
}
