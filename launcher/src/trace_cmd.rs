//! `accel trace DIR`: read the flight-recorder dumps of a run (what
//! `accel launch --dump-dir` collects, or `ACCEL_DUMP_DIR`) and say, per
//! group, where the ranks first part ways, which ranks were inside a
//! collective and since when, and who waits for whom; `--timeline` writes
//! a Chrome / Perfetto trace. The analysis is `accel::flight::trace`'s.

use std::path::PathBuf;
use std::process::ExitCode;

use accel::flight::trace::{analyze, read_dir, timeline, Select};
use accel_api::{Error, Result};

/// Arguments of `accel trace`.
#[derive(Debug, clap::Args)]
pub struct TraceArgs {
    /// The dump folder (`accel launch --dump-dir`, ACCEL_DUMP_DIR; the
    /// launcher's root-cause block names it).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    /// Print the analysis as one JSON object (for programs).
    #[arg(long)]
    json: bool,
    /// Also write a Chrome / Perfetto trace (open it in ui.perfetto.dev or
    /// chrome://tracing): one track per rank and group.
    #[arg(long, value_name = "FILE")]
    timeline: Option<PathBuf>,
    /// The run to read, when the folder holds several [default: the run
    /// of the newest dump].
    #[arg(long = "run-id", value_name = "ID")]
    run_id: Option<String>,
    /// The attempt to read (ACCEL_RESTART_COUNT) [default: the newest].
    #[arg(long, value_name = "N")]
    restart: Option<u32>,
}

/// Run `accel trace`.
///
/// # Errors
/// A folder that cannot be read or holds no dump of the run asked for; a
/// timeline that cannot be written.
pub fn run(a: TraceArgs) -> Result<ExitCode> {
    let (files, skipped) = read_dir(&a.dir)?;
    let select = Select {
        run_id: a.run_id,
        restart: a.restart,
    };
    let trace = analyze(&files, &select)?;
    for s in &skipped {
        eprintln!("accel trace: skipped {s}");
    }
    if let Some(path) = &a.timeline {
        let v = timeline(&trace);
        accel_api::durable::write_atomic(path, |w| {
            serde_json::to_writer(w, &v).map_err(std::io::Error::other)
        })
        .map_err(|e| e.with_op("accel trace --timeline"))?;
        eprintln!(
            "accel trace: timeline written to {} (open it in ui.perfetto.dev or chrome://tracing)",
            path.display()
        );
    }
    if a.json {
        let s = serde_json::to_string_pretty(&trace)
            .map_err(|e| Error::internal("accel trace", e.to_string()))?;
        outln!("{s}");
    } else {
        out!("{}", trace.render());
    }
    Ok(ExitCode::SUCCESS)
}
