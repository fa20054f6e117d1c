//! The record a running launcher keeps of itself ([`LauncherRecord`]), so
//! that `accel dump` finds it: its pid, its run, the attempt and where the
//! ranks dump their flight recorders. Written atomically at the start of
//! every attempt ([`Supervision::record`](crate::Supervision::record)),
//! removed with the launcher's scratch folder when the run ends.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use accel_api::{Error, Result};

/// The `format` of a launcher record.
pub const RECORD_FORMAT: &str = "accel-launcher/1";

/// The record's file name in the launcher's scratch folder.
pub const RECORD_FILE: &str = "launcher.json";

/// A running launcher, as `accel dump` reads it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LauncherRecord {
    /// [`RECORD_FORMAT`].
    pub format: String,
    /// The launcher's pid: where SIGUSR1 goes.
    pub pid: u32,
    /// The run (`ACCEL_RUN_ID`).
    pub run_id: String,
    /// The attempt running (0 first).
    pub attempt: u32,
    /// Where the ranks dump (`ACCEL_DUMP_DIR`).
    pub dump_dir: PathBuf,
    /// Ranks of this machine's group.
    pub ranks: usize,
    /// `workers`, `mpirun` or `threads`.
    pub group: String,
    /// When the attempt began, in seconds since the Unix epoch.
    pub since_s: u64,
}

impl LauncherRecord {
    /// Write `self` to `path`, atomically.
    ///
    /// # Errors
    /// [`accel_api::ErrorKind::Io`] naming the file.
    pub fn write(&self, path: &Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        }
        accel_api::durable::write_atomic(path, |w| {
            serde_json::to_writer(w, self).map_err(std::io::Error::other)
        })
    }

    /// Read the record at `path`.
    ///
    /// # Errors
    /// I/O errors, and `InvalidArgument` for a file that is no record.
    pub fn read(path: &Path) -> Result<LauncherRecord> {
        let bytes =
            std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let r: LauncherRecord = serde_json::from_slice(&bytes).map_err(|e| {
            Error::invalid_argument(
                "accel dump",
                format!("{} is not a launcher record: {e}", path.display()),
            )
        })?;
        if r.format != RECORD_FORMAT {
            return Err(Error::invalid_argument(
                "accel dump",
                format!(
                    "{}: format {:?}, not {RECORD_FORMAT}",
                    path.display(),
                    r.format
                ),
            ));
        }
        Ok(r)
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The dump files (`*.json`) in `dir` modified at or after `since`.
pub fn dumps_since(dir: &Path, since: SystemTime) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| {
            e.metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t >= since)
        })
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    v.sort();
    v
}

/// The pid in a dump file's name (`rank<R>-pid<P>-<N>.json`).
pub fn dump_pid(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let rest = &name[name.find("-pid")? + 4..];
    rest.split('-').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_and_a_stranger_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let r = LauncherRecord {
            format: RECORD_FORMAT.into(),
            pid: 42,
            run_id: "r".into(),
            attempt: 1,
            dump_dir: "/tmp/d".into(),
            ranks: 2,
            group: "workers".into(),
            since_s: now_s(),
        };
        let p = d.path().join("scratch").join(RECORD_FILE);
        r.write(&p).unwrap();
        assert_eq!(LauncherRecord::read(&p).unwrap(), r);
        std::fs::write(&p, b"{}").unwrap();
        assert!(LauncherRecord::read(&p).is_err());
        let dumps = tempfile::tempdir().unwrap();
        let t0 = SystemTime::now() - std::time::Duration::from_secs(5);
        std::fs::write(dumps.path().join("rank0-pid1-0.json"), b"{}").unwrap();
        std::fs::write(dumps.path().join("notes.txt"), b"").unwrap();
        assert_eq!(dumps_since(dumps.path(), t0).len(), 1);
        assert_eq!(dump_pid(&dumps_since(dumps.path(), t0)[0]), Some(1));
        assert_eq!(dump_pid(Path::new("/d/rankx-pid77-3.json")), Some(77));
        assert_eq!(dump_pid(Path::new("/d/other.json")), None);
        let later = SystemTime::now() + std::time::Duration::from_secs(60);
        assert!(dumps_since(dumps.path(), later).is_empty());
    }
}
