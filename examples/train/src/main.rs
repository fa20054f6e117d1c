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

use std::process::ExitCode;

use accel_example_kit::cli;
use accel_example_train::{train, Options};

const USAGE: &str = "usage: train [--epochs N] [--train-len N] [--eval-len N] [--batch-size N]
             [--accumulation K] [--lr X] [--hidden N] [--seed N] [--noise X]
             [--save-every N] [--keep N] [--checkpoint-dir DIR]
             [--resume] [--stop-after STEP] [--step-delay-ms MS] [--log-dir DIR]
             [--slow-rank R --slow-ms MS [--slow-at BATCH]] [--async-save]";

fn parse(args: &[String]) -> Result<Options, String> {
    let mut o = Options::default();
    cli::read_flags(args, USAGE, |flag, flags| {
        match flag {
            "--epochs" => o.epochs = flags.num(flag)?,
            "--train-len" => o.train_len = flags.num(flag)?,
            "--eval-len" => o.eval_len = flags.num(flag)?,
            "--batch-size" => o.batch_size = flags.num(flag)?,
            "--accumulation" => o.accumulation = flags.num(flag)?,
            "--lr" => o.lr = flags.num(flag)?,
            "--hidden" => o.hidden = flags.num(flag)?,
            "--seed" => o.seed = flags.num(flag)?,
            "--noise" => o.noise = flags.num(flag)?,
            "--save-every" => o.save_every = flags.num(flag)?,
            "--keep" => o.keep = flags.num(flag)?,
            "--checkpoint-dir" => o.checkpoint_dir = flags.path(flag)?,
            "--resume" => o.resume = true,
            "--stop-after" => o.stop_after = Some(flags.num(flag)?),
            "--step-delay-ms" => o.step_delay_ms = flags.num(flag)?,
            "--log-dir" => o.log_dir = Some(flags.path(flag)?),
            "--slow-rank" => o.slow_rank = Some(flags.num(flag)?),
            "--slow-ms" => o.slow_ms = flags.num(flag)?,
            "--slow-at" => o.slow_at = Some(flags.num(flag)?),
            "--async-save" => o.async_save = true,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(o)
}

fn main() -> ExitCode {
    cli::main("train", parse, |opts| {
        // `accel::run`: one rank per process, or (`accel launch --backend
        // xla`) this process's rank threads, each calling the closure.
        accel::run(|acc: &accel::Accelerator| -> accel::Result<()> {
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
        })
        .map(drop)
    })
}
