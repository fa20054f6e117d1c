//! `accel bench`: time one collective over a range of sizes on N local
//! ranks of any backend, and print an nccl-tests-style table.
//!
//! | module | does |
//! |---|---|
//! | [`workload`] | the shared flags, sizes, bus factors, the result row |
//! | [`worker`] | the hidden `accel bench-worker`: one rank's timing loop |
//!
//! `accel bench` starts the ranks through the launch library, exactly as
//! `accel launch -n N [--backend B] -- <this accel> bench-worker ...` does
//! (in this process: same supervisor, same worker environment), so the
//! workers see what every launched program sees and connect with
//! [`accel::Accelerator::new`]. Rank 0 appends one JSON line per size to a
//! scratch file; a thread follows the file for the progress bar, then this
//! process prints the table (or `--json`) on stdout. The workers' own
//! output goes to stderr, so stdout holds only the result.
//!
//! # Method
//!
//! Per size: `--warmup` untimed calls, then `--iters` times { barrier;
//! time the call }. An iteration's time is the slowest rank's; the table
//! shows the median over iterations. `algbw = size / time` and `busbw =
//! algbw × factor` with nccl-tests' factors: all_reduce `2(n-1)/n`,
//! all_gather, reduce_scatter and all_to_all `(n-1)/n`, broadcast 1. The
//! size is the largest buffer of the call: the gathered buffer of
//! all_gather, the buffer before scattering of reduce_scatter; for those
//! and all_to_all it is rounded down to a multiple of `n` elements.

pub mod worker;
pub mod workload;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use accel_api::{Error, ErrorKind, Result};

use workload::{Row, Workload};

/// Arguments of `accel bench`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  accel bench --backend cpu-gloo -n 2 --op all_reduce --sizes 4K:64M\n  \
                  accel bench -n 4 --op all_gather --sizes 1M --iters 50 --json\n\n\
                  time = median over iterations of the slowest rank's time (barrier before each \
                  iteration); busbw uses nccl-tests' bus factors."
)]
pub struct BenchArgs {
    /// Number of ranks (processes on this machine).
    #[arg(short = 'n', long = "num-processes", default_value_t = 2, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    nproc: u32,

    /// Backend(s) to use, in order of preference [default: probe order, or
    /// ACCEL_BACKEND].
    #[arg(long, value_name = "NAME[,NAME]")]
    backend: Option<String>,

    /// Bound of every collective call (passed to `accel launch --timeout`).
    #[arg(long, value_name = "DUR")]
    timeout: Option<String>,

    #[command(flatten)]
    workload: Workload,

    /// Print the result as one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// One line of the worker's result file.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Line {
    /// Written first, once connected.
    Header {
        /// The backend the workers connected with.
        backend: String,
        /// Number of ranks.
        world_size: usize,
    },
    /// One size.
    Row(Row),
}

/// The whole result, as `--json` prints it.
#[derive(Debug, serde::Serialize)]
struct Report<'a> {
    op: &'a str,
    backend: &'a str,
    world_size: usize,
    dtype: &'a str,
    iters: u32,
    warmup: u32,
    bus_factor: f64,
    time: &'static str,
    rows: &'a [Row],
}

fn scratch_file() -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "accel-bench-{}-{nanos:x}.jsonl",
        std::process::id()
    ))
}

/// Read the worker's result file (missing = nothing yet).
fn read_lines(path: &Path) -> Result<Vec<Line>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(format!("cannot read {}", path.display()), e)),
    };
    // Only whole lines: the last may still be being written.
    let whole = text.rfind('\n').map_or("", |i| &text[..i]);
    whole
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l).map_err(|e| {
                Error::new(
                    ErrorKind::Corrupt,
                    format!("bad line in {}: {e}: {l}", path.display()),
                )
            })
        })
        .collect()
}

fn progress_bar(len: usize, what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::with_draw_target(
        Some(len as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} {msg} [{bar:30}] {pos}/{len} sizes {elapsed}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(what.to_string());
    pb
}

/// Run `accel bench`.
///
/// # Errors
/// Invalid flags (exit code 2), a launcher that cannot start, a result file
/// that cannot be read. A failed worker is reported by the launcher on
/// stderr and becomes this command's exit code.
pub fn run(args: BenchArgs) -> Result<ExitCode> {
    let world = args.nproc as usize;
    let w = &args.workload;
    let expected = w.rows(world).len();
    if expected == 0 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "sizes {} hold no whole {} element{} for {} ranks",
                w.sizes,
                w.dtype,
                if w.op.chunked() { " per rank" } else { "" },
                world
            ),
        ));
    }
    if w.outstanding.is_some() && w.op != workload::BenchOp::AllReduce {
        return Err(Error::invalid_config(
            "--async",
            &w.op.to_string(),
            "--async times started all-reduces; use --op all_reduce",
        ));
    }
    let me =
        std::env::current_exe().map_err(|e| Error::io("cannot find the accel executable", e))?;
    let out = scratch_file();
    let mut command: Vec<std::ffi::OsString> = vec![me.clone().into(), "bench-worker".into()];
    command.extend(w.to_args().into_iter().map(Into::into));
    command.push("--out".into());
    command.push(out.clone().into());
    let options = crate::launch_cmd::options::Options {
        num_processes: Some(world),
        backend: match &args.backend {
            Some(b) => Some(
                b.parse()
                    .map_err(|why: String| Error::invalid_config("--backend", b, why))?,
            ),
            None => None,
        },
        timeout: match &args.timeout {
            Some(t) => Some(
                crate::launch_cmd::options::parse_dur(t)
                    .map_err(|why| Error::invalid_config("--timeout", t, why))?,
            ),
            None => None,
        },
        ..Default::default()
    };
    let mut launch = crate::launch_cmd::LaunchArgs::new(options, command);
    // Keep stdout for the result: the workers' lines go to stderr.
    launch.workers_stdout_to_stderr = true;

    let pb = progress_bar(expected, w.op.name());
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let follower = {
        let (pb, out, done) = (pb.clone(), out.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if !pb.is_hidden() {
                    if let Ok(lines) = read_lines(&out) {
                        let n = lines.iter().filter(|l| matches!(l, Line::Row(_))).count();
                        pb.set_position(n as u64);
                    }
                    pb.tick();
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    // On this (the main) thread: the workers are tied to it.
    let code = crate::launch_cmd::run_code(&launch);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = follower.join();
    pb.finish_and_clear();
    let code = code?;
    let lines = read_lines(&out);
    let _ = std::fs::remove_file(&out);
    if code != 0 {
        eprintln!("accel: bench: the benchmark run failed (exit code {code})");
        return Ok(ExitCode::from(code));
    }
    let lines = lines?;
    let mut backend = String::from("?");
    let mut world_size = world;
    let mut rows = Vec::new();
    for l in lines {
        match l {
            Line::Header {
                backend: b,
                world_size: n,
            } => {
                backend = b;
                world_size = n;
            }
            Line::Row(r) => rows.push(r),
        }
    }
    if rows.len() != expected {
        return Err(Error::new(
            ErrorKind::Corrupt,
            format!(
                "the workers exited successfully but reported {} of {expected} sizes",
                rows.len()
            ),
        ));
    }
    let report = Report {
        op: w.op.name(),
        backend: &backend,
        world_size,
        dtype: w.dtype.name(),
        iters: w.iters,
        warmup: w.warmup,
        bus_factor: w.op.bus_factor(world_size),
        time: "median over iterations of the slowest rank, microseconds",
        rows: &rows,
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).unwrap_or_default()
        );
    } else {
        out!("{}", table(&report));
    }
    Ok(ExitCode::SUCCESS)
}

/// The nccl-tests-style table.
fn table(r: &Report<'_>) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# accel bench: {} on {} ranks, backend {}, {} iterations after {} warm-up",
        r.op, r.world_size, r.backend, r.iters, r.warmup
    );
    let _ = writeln!(
        s,
        "# time: median over iterations of the slowest rank (barrier before each); \
         busbw = algbw x {:.3}",
        r.bus_factor
    );
    let started = r.rows.iter().any(|row| row.blocking_us.is_some());
    if started {
        let _ = writeln!(
            s,
            "# --async: time is per call of N all-reduces in flight together; blocking(us) per call of N in a row"
        );
    }
    let _ = write!(
        s,
        "#{:>13} {:>12} {:>6} {:>12} {:>12} {:>12}",
        "size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)"
    );
    let _ = if started {
        writeln!(s, " {:>12} {:>8}", "blocking(us)", "ratio")
    } else {
        writeln!(s)
    };
    for row in r.rows {
        let _ = write!(
            s,
            " {:>13} {:>12} {:>6} {:>12.1} {:>12.3} {:>12.3}",
            row.size, row.count, row.dtype, row.time_us, row.algbw_gbs, row.busbw_gbs
        );
        let _ = match row.blocking_us {
            Some(b) if row.time_us > 0.0 => writeln!(s, " {:>12.1} {:>8.2}", b, b / row.time_us),
            _ => writeln!(s),
        };
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip_and_partial_lines_wait() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("r.jsonl");
        let row = Row::new(
            workload::BenchOp::Broadcast,
            2,
            accel_api::DType::F32,
            4096,
            1024,
            &[10.0],
        );
        let a = serde_json::to_string(&Line::Header {
            backend: "x".into(),
            world_size: 2,
        })
        .unwrap();
        let b = serde_json::to_string(&Line::Row(row.clone())).unwrap();
        std::fs::write(&p, format!("{a}\n{b}\n{{\"kind\":")).unwrap();
        let lines = read_lines(&p).unwrap();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1], Line::Row(row));
        assert!(read_lines(&dir.path().join("none")).unwrap().is_empty());
    }

    #[test]
    fn table_has_one_line_per_row() {
        let row = |bytes, elems, us| {
            Row::new(
                workload::BenchOp::AllReduce,
                2,
                accel_api::DType::F32,
                bytes,
                elems,
                &[us],
            )
        };
        let rows = vec![row(4096, 1024, 250.0), row(8192, 2048, 260.0)];
        let r = Report {
            op: "all_reduce",
            backend: "cpu-gloo",
            world_size: 2,
            dtype: "f32",
            iters: 1,
            warmup: 0,
            bus_factor: 1.0,
            time: "",
            rows: &rows,
        };
        let t = table(&r);
        let data: Vec<&str> = t.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(data.len(), 2);
        assert!(data[0]
            .split_whitespace()
            .eq(["4096", "1024", "f32", "250.0", "0.016", "0.016"]));
    }
}
