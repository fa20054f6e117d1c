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

use accel_example_tch_digits::{train, OptimizerChoice, Options};

const USAGE: &str = "usage: tch-digits [--data FILE] [--epochs N] [--train-len N] [--batch-size N]
                  [--accumulation K] [--lr X] [--hidden N] [--seed N]
                  [--optimizer adamw|torch-sgd] [--no-shuffle] [--no-eval]
                  [--save-every N] [--keep N] [--checkpoint-dir DIR]
                  [--resume] [--stop-after STEP] [--threads N]
                  [--log-dir DIR | --no-log] [--dump-params FILE]
                  [--mixed-precision no|bf16|fp16] [--max-grad-norm X]";

struct Extra {
    threads: Option<i32>,
    /// Write the final parameters (little-endian f32, visiting order) here.
    dump_params: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<(Options, Extra), String> {
    let mut o = Options::default();
    let mut x = Extra {
        threads: None,
        dump_params: None,
    };
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
            "--data" => o.data = PathBuf::from(value()?),
            "--epochs" => o.epochs = num(flag, value()?)?,
            "--train-len" => o.train_len = Some(num(flag, value()?)?),
            "--batch-size" => o.batch_size = num(flag, value()?)?,
            "--accumulation" => o.accumulation = num(flag, value()?)?,
            "--lr" => o.lr = num(flag, value()?)?,
            "--hidden" => o.hidden = num(flag, value()?)?,
            "--seed" => o.seed = num(flag, value()?)?,
            "--optimizer" => {
                o.optimizer = match value()?.as_str() {
                    "adamw" => OptimizerChoice::AdamW,
                    "torch-sgd" => OptimizerChoice::TorchSgd,
                    v => return Err(format!("--optimizer: {v:?} is not adamw or torch-sgd")),
                }
            }
            "--no-shuffle" => o.shuffle = false,
            "--no-eval" => o.no_eval = true,
            "--log-dir" => o.log_dir = Some(PathBuf::from(value()?)),
            "--no-log" => o.log_dir = None,
            "--save-every" => o.save_every = num(flag, value()?)?,
            "--keep" => o.keep = num(flag, value()?)?,
            "--checkpoint-dir" => o.checkpoint_dir = PathBuf::from(value()?),
            "--resume" => o.resume = true,
            "--stop-after" => o.stop_after = Some(num(flag, value()?)?),
            "--threads" => x.threads = Some(num(flag, value()?)?),
            "--dump-params" => x.dump_params = Some(PathBuf::from(value()?)),
            "--mixed-precision" => {
                o.mixed_precision = Some(value()?.parse().map_err(|e| format!("{flag}: {e}"))?)
            }
            "--max-grad-norm" => o.max_grad_norm = Some(num(flag, value()?)?),
            "-h" | "--help" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok((o, x))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (opts, extra) = match parse(&args) {
        Ok(o) => o,
        Err(m) => {
            eprintln!("{m}");
            return ExitCode::from(2);
        }
    };
    let run = || -> accel::Result<()> {
        let acc = accel::Accelerator::new()?;
        let threads = match extra.threads {
            Some(n) => {
                tch::set_num_threads(n);
                n as usize
            }
            None => accel_tch::set_threads_per_rank(&acc),
        };
        if acc.is_main_process() {
            println!(
                "tch-digits: {} ranks on {}, batch {} x {} ranks x {} accumulation steps, {:?}, {threads} libtorch threads per rank",
                acc.world_size(),
                acc.backend_name(),
                opts.batch_size,
                acc.world_size(),
                opts.accumulation,
                opts.optimizer,
            );
        }
        let report = train(&acc, &opts, |line| println!("{line}"))?;
        if acc.is_main_process() {
            if report.stopped {
                println!(
                    "stopped at step {}: params checksum {}",
                    report.steps, report.checksum
                );
            } else {
                let accuracy = if report.eval_samples == 0 {
                    "no held-out evaluation (--no-eval)".to_string()
                } else {
                    format!(
                        "accuracy {:.2}% over {} held-out images",
                        100.0 * report.accuracy,
                        report.eval_samples
                    )
                };
                println!(
                    "final: {} steps, loss {:.4}, {accuracy}, {:.2} ms/step ({:.2} ms gradient sync), params checksum {}",
                    report.steps,
                    report.last_loss,
                    1e3 * report.step_time,
                    1e3 * report.sync_time,
                    report.checksum
                );
            }
            if let Some(path) = &extra.dump_params {
                let bytes: Vec<u8> = report.params.iter().flat_map(|v| v.to_le_bytes()).collect();
                std::fs::write(path, bytes)
                    .map_err(|e| accel::Error::io(format!("writing {}", path.display()), e))?;
            }
        }
        acc.wait_for_everyone()
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tch-digits: {e}");
            ExitCode::FAILURE
        }
    }
}
