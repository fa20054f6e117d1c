//! `accel top [DIR]`: a live view of a running job on this machine. Per
//! rank: the section and step it is in, the phase, the collective it is in
//! and since when, the last one it completed, its straggler score. Reads
//! the status files every rank writes every few seconds into the run's
//! dump folder (`accel::watch`; files rather than the run's store, whose
//! token only the workers hold).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use accel::watch::{RankStatus, STATUS_DIR};
use accel_api::{Error, Result};

/// Show what every rank of a running job is doing (refreshed until
/// interrupted).
#[derive(Debug, clap::Args)]
pub struct TopArgs {
    /// The run's dump folder (`ACCEL_DUMP_DIR`; default: the newest run
    /// under `<temp>/accel-dumps` with status files).
    pub dir: Option<PathBuf>,
    /// Print once and exit.
    #[arg(long)]
    pub once: bool,
    /// Print the records as JSON lines, once.
    #[arg(long)]
    pub json: bool,
    /// Refresh interval (`2s`, `500ms`).
    #[arg(long, default_value = "2s", value_name = "DURATION")]
    pub every: String,
}

/// The newest run folder under `root` that has status files.
fn newest_run(root: &Path) -> Option<PathBuf> {
    std::fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join(STATUS_DIR))
        .filter_map(|p| {
            let t = std::fs::metadata(&p).and_then(|m| m.modified()).ok()?;
            Some((t, p))
        })
        .max()
        .map(|(_, p)| p)
}

fn status_dir(arg: Option<&Path>) -> Result<PathBuf> {
    if let Some(d) = arg {
        let s = d.join(STATUS_DIR);
        return Ok(if s.is_dir() { s } else { d.to_path_buf() });
    }
    if let Some(d) = std::env::var_os(accel::flight::DUMP_DIR_ENV).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d).join(STATUS_DIR));
    }
    let root = std::env::temp_dir().join("accel-dumps");
    newest_run(&root).ok_or_else(|| {
        Error::invalid_argument(
            "accel top",
            format!("no run with status files under {}", root.display()),
        )
        .with_fix(
            "name the run's dump folder: accel top DIR (accel launch --dump-dir, ACCEL_DUMP_DIR)",
        )
    })
}

/// Every rank's record in `dir`, by rank (unreadable files are skipped:
/// one may be mid-rename).
pub fn read_statuses(dir: &Path) -> Vec<RankStatus> {
    let mut v: Vec<RankStatus> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            n.starts_with("rank") && n.ends_with(".json")
        })
        .filter_map(|p| serde_json::from_slice(&std::fs::read(p).ok()?).ok())
        .collect();
    v.sort_by_key(|s| s.rank);
    v
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn secs(us: u64) -> String {
    format!("{:.1}s", us as f64 / 1e6)
}

/// The table `accel top` prints.
pub fn table(statuses: &[RankStatus], now_us: u64) -> String {
    let mut out = format!(
        "{:>4}  {:<10} {:>6}  {:<10} {:<28} {:<24} {:<16} {}\n",
        "rank",
        "section",
        "step",
        "phase",
        "in collective (since)",
        "last completed",
        "straggler",
        "age"
    );
    for s in statuses {
        let in_op = s.in_op.as_ref().map_or("-".to_string(), |o| {
            format!(
                "{}{} ({})",
                o.op,
                o.seq.map_or(String::new(), |n| format!(" #{n}")),
                secs(now_us.saturating_sub(o.time_us))
            )
        });
        let last = s.last_op.as_ref().map_or("-".to_string(), |o| {
            format!(
                "{}{} {} ago",
                o.op,
                o.seq.map_or(String::new(), |n| format!(" #{n}")),
                secs(now_us.saturating_sub(o.time_us))
            )
        });
        let straggler = s.straggler.map_or("-".to_string(), |m| {
            format!("{:.2} {}", m.score, m.phase.name())
        });
        let age = now_us.saturating_sub(s.time_us);
        out.push_str(&format!(
            "{:>4}  {:<10} {:>6}  {:<10} {:<28} {:<24} {:<16} {}\n",
            s.rank,
            format!(
                "{} {}",
                s.section.name(),
                secs((s.section_ms * 1000.0) as u64)
            ),
            s.step,
            s.phase.map_or("-", |p| p.name()),
            in_op,
            last,
            straggler,
            secs(age),
        ));
    }
    out
}

/// Run `accel top`.
///
/// # Errors
/// No run found; a malformed `--every`.
pub fn run(args: TopArgs) -> Result<ExitCode> {
    let every = accel_api::worker::parse_duration("--every", &args.every)?;
    let dir = status_dir(args.dir.as_deref())?;
    loop {
        let statuses = read_statuses(&dir);
        if args.json {
            for s in &statuses {
                outln!("{}", serde_json::to_string(s).unwrap_or_default());
            }
            return Ok(ExitCode::SUCCESS);
        }
        if !args.once {
            // Clear the screen and go home, as top does.
            out!("\x1b[2J\x1b[H");
        }
        outln!("accel top: {} ({} ranks)", dir.display(), statuses.len());
        out!("{}", table(&statuses, now_us()));
        if args.once {
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(every.max(Duration::from_millis(100)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel::watch::{Reporting, SectionTimeouts, Watch};

    #[test]
    fn top_reads_the_status_files_ranks_write() {
        let dir = tempfile::tempdir().unwrap();
        let w = Watch::new(3, 4, SectionTimeouts::default(), Reporting::default());
        w.begin_step(false);
        accel::watch::write_status(&w, dir.path()).unwrap();
        std::fs::write(dir.path().join("rank9.json"), "half a rec").unwrap();
        let got = read_statuses(dir.path());
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!((got[0].rank, got[0].step), (3, 1));
        let t = table(&got, got[0].time_us);
        assert!(t.lines().nth(1).unwrap().contains("step"), "{t}");
        assert_eq!(
            status_dir(Some(dir.path())).unwrap(),
            dir.path().to_path_buf()
        );
    }
}
