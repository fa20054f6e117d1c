//! The worker protocol: what a launcher and its workers agree on, below
//! every crate that takes part (the launcher, the facade, the backends).
//!
//! * [`keys`]: the environment variables of the contract (accel's and
//!   torchrun's names);
//! * [`ErrorRecord`]: the root cause a failing worker writes to
//!   `ACCEL_ERROR_FILE` (or `TORCHELASTIC_ERROR_FILE`) and the launcher
//!   reads, in accel's format or torch elastic's `@record` format;
//!   [`error_file_from_env`] finds where it goes;
//! * the rank tag ([`tag_line`], [`untag_line`]): how a process whose ranks
//!   are threads marks each output line with its rank for the launcher.

use std::io::Write;
use std::path::{Path, PathBuf};

/// The variable names of the contract.
pub mod keys {
    /// Global rank.
    pub const RANK: &str = "RANK";
    /// Processes in the run.
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    /// Rank on this machine.
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    /// Processes on this machine.
    pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
    /// This machine's rank (torchrun's node rank).
    pub const GROUP_RANK: &str = "GROUP_RANK";
    /// Machines in the run.
    pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
    /// torchrun's role rank (= RANK: accel has one role).
    pub const ROLE_RANK: &str = "ROLE_RANK";
    /// torchrun's role world size (= WORLD_SIZE).
    pub const ROLE_WORLD_SIZE: &str = "ROLE_WORLD_SIZE";
    /// Where the store listens (host).
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    /// Where the store listens (port).
    pub const MASTER_PORT: &str = "MASTER_PORT";
    /// `accel` when `accel launch` started the worker.
    pub const ACCEL_LAUNCHER: &str = "ACCEL_LAUNCHER";
    /// The launcher's pid (the worker ties its life to it).
    pub const ACCEL_LAUNCHER_PID: &str = "ACCEL_LAUNCHER_PID";
    /// The store's URL (`tcp://h:p`, `file:///dir`).
    pub const ACCEL_STORE_URL: &str = "ACCEL_STORE_URL";
    /// The run's name.
    pub const ACCEL_RUN_ID: &str = "ACCEL_RUN_ID";
    /// The store's shared secret.
    pub const ACCEL_RUN_TOKEN: &str = "ACCEL_RUN_TOKEN";
    /// The bound of every blocking call.
    pub const ACCEL_TIMEOUT: &str = "ACCEL_TIMEOUT";
    /// Backends to choose from, in order.
    pub const ACCEL_BACKEND: &str = "ACCEL_BACKEND";
    /// Debug mode (0/1).
    pub const ACCEL_DEBUG: &str = "ACCEL_DEBUG";
    /// Mixed precision of the training loop (`no`, `bf16`, `fp16`).
    pub const ACCEL_MIXED_PRECISION: &str = "ACCEL_MIXED_PRECISION";
    /// ZeRO sharding stage of the training loop (`none`, `optimizer`,
    /// `gradients`, `full`).
    pub const ACCEL_SHARDING: &str = "ACCEL_SHARDING";
    /// Gradient accumulation steps of the training loop, where the program
    /// leaves them at 1 (`accel launch --gradient-accumulation-steps`).
    pub const ACCEL_GRADIENT_ACCUMULATION_STEPS: &str = "ACCEL_GRADIENT_ACCUMULATION_STEPS";
    /// Accelerate's mixed precision, which its `Accelerator()` reads where
    /// the script passes none (written alongside ACCEL_MIXED_PRECISION).
    pub const ACCELERATE_MIXED_PRECISION: &str = "ACCELERATE_MIXED_PRECISION";
    /// Accelerate's gradient accumulation steps, read by its
    /// `Accelerator()` where the script passes none (written alongside
    /// ACCEL_GRADIENT_ACCUMULATION_STEPS).
    pub const ACCELERATE_GRADIENT_ACCUMULATION_STEPS: &str =
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS";
    /// The attempt number, 0 first.
    pub const ACCEL_RESTART_COUNT: &str = "ACCEL_RESTART_COUNT";
    /// Where a crashing worker writes its root cause.
    pub const ACCEL_ERROR_FILE: &str = "ACCEL_ERROR_FILE";
    /// Allow more local ranks than devices.
    pub const ACCEL_SHARE_DEVICES: &str = "ACCEL_SHARE_DEVICES";
    /// `processes` (one rank per process) or `threads` (this process hosts
    /// LOCAL_WORLD_SIZE rank threads; docs/adr/0015-process-model.md).
    pub const ACCEL_PROCESS_MODEL: &str = "ACCEL_PROCESS_MODEL";
    /// torchrun's run id.
    pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
    /// torchrun's restart count.
    pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
    /// torchrun's restart limit.
    pub const TORCHELASTIC_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
    /// torchrun's error file.
    pub const TORCHELASTIC_ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";
    /// torchrun's `True` when its agent hosts the store at MASTER_ADDR:MASTER_PORT.
    pub const TORCHELASTIC_USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";

    /// Variables an MPI launcher sets itself: a launcher that delegates to
    /// mpirun removes these from mpirun's environment.
    pub const NUMBERED_BY_LAUNCHER: [&str; 10] = [
        RANK,
        WORLD_SIZE,
        LOCAL_RANK,
        LOCAL_WORLD_SIZE,
        GROUP_RANK,
        GROUP_WORLD_SIZE,
        ROLE_RANK,
        ROLE_WORLD_SIZE,
        ACCEL_LAUNCHER,
        ACCEL_LAUNCHER_PID,
    ];
}

/// Where this process writes its error record: `ACCEL_ERROR_FILE`, else
/// torchrun's `TORCHELASTIC_ERROR_FILE`; `None` when neither is set.
pub fn error_file_from_env() -> Option<PathBuf> {
    std::env::var_os(keys::ACCEL_ERROR_FILE)
        .or_else(|| std::env::var_os(keys::TORCHELASTIC_ERROR_FILE))
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// What the error file holds (one JSON object).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ErrorRecord {
    /// Global rank of the process that failed, when known.
    pub rank: Option<usize>,
    /// Process id.
    pub pid: u32,
    /// The panic message (or error text).
    pub message: String,
    /// `file:line:column` of the panic, when known.
    pub location: Option<String>,
    /// Seconds since the Unix epoch.
    pub timestamp: u64,
}

impl ErrorRecord {
    /// A record of `message` from this process (its pid, the time now),
    /// from `rank` when known, raised at `location` when known.
    pub fn now(rank: Option<usize>, message: String, location: Option<String>) -> ErrorRecord {
        ErrorRecord {
            rank,
            pid: std::process::id(),
            message,
            location,
            timestamp: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        }
    }

    /// Read a record written by [`write_error_file`].
    ///
    /// # Errors
    /// I/O errors, or [`crate::ErrorKind::Corrupt`] when the file is not
    /// a record.
    pub fn read(path: &Path) -> crate::Result<ErrorRecord> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| crate::Error::io(format!("reading error file {}", path.display()), e))?;
        serde_json::from_str(&text)
            .or_else(|e| ErrorRecord::from_torch(&text).ok_or(e))
            .map_err(|e| {
                crate::Error::new(
                    crate::ErrorKind::Corrupt,
                    format!(
                        "error file {} is neither an accel error record nor torch elastic's: {e}",
                        path.display()
                    ),
                )
            })
    }

    /// The record torch elastic's `@record` writes to
    /// TORCHELASTIC_ERROR_FILE: `{"message": {"message": "ValueError: ...",
    /// "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "..."}}}`
    /// (or a plain string message). The message keeps the exception line
    /// and the traceback; the location is the innermost frame.
    fn from_torch(text: &str) -> Option<ErrorRecord> {
        let v: serde_json::Value = serde_json::from_str(text).ok()?;
        let m = v.get("message")?;
        let (message, info) = match m {
            serde_json::Value::String(s) => (s.clone(), None),
            serde_json::Value::Object(o) => {
                (o.get("message")?.as_str()?.to_string(), o.get("extraInfo"))
            }
            _ => return None,
        };
        let stack = info
            .and_then(|i| i.get("py_callstack"))
            .and_then(|s| s.as_str())
            .unwrap_or("");
        let timestamp = info
            .and_then(|i| i.get("timestamp"))
            .and_then(|t| {
                t.as_str()
                    .and_then(|s| s.parse().ok())
                    .or_else(|| t.as_u64())
            })
            .unwrap_or(0);
        // `  File "/x/train.py", line 4, in main` -> `/x/train.py:4 (in main)`
        let location = stack.lines().rev().find_map(|l| {
            let rest = l.trim_start().strip_prefix("File \"")?;
            let (file, rest) = rest.split_once("\", line ")?;
            let (line, func) = rest.split_once(", in ").unwrap_or((rest, ""));
            Some(if func.is_empty() {
                format!("{file}:{line}")
            } else {
                format!("{file}:{line} (in {func})")
            })
        });
        let message = if stack.trim().is_empty() {
            message
        } else {
            format!("{message}\n{}", stack.trim_end())
        };
        Some(ErrorRecord {
            rank: None,
            pid: 0,
            message,
            location,
            timestamp,
        })
    }
}

/// Write `record` to `path` atomically (temporary file, fsync, rename).
///
/// # Errors
/// The I/O error, naming the path.
pub fn write_error_file(path: &Path, record: &ErrorRecord) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        path.file_name().and_then(|s| s.to_str()).unwrap_or("error"),
        std::process::id()
    ));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(serde_json::to_string(record).unwrap_or_default().as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

/// [`write_error_file`], unless `path` holds a record already: the first
/// failure is the root cause, and a later one (a panic while unwinding, a
/// survivor's report) never overwrites it. `Ok(false)` when one was there.
///
/// # Errors
/// As [`write_error_file`].
pub fn write_first_error(path: &Path, record: &ErrorRecord) -> std::io::Result<bool> {
    if path.exists() {
        return Ok(false);
    }
    write_error_file(path, record).map(|()| true)
}

/// The first byte of a rank-tagged output line: `\x1e<rank>\x1f<line>`.
const TAG_START: u8 = 0x1e;
/// The byte that ends a line's rank tag.
const TAG_END: u8 = 0x1f;

/// `line` tagged with `rank`, as a rank thread writes it under
/// `accel launch` (the launcher strips the tag and prefixes `[rank N]`).
pub fn tag_line(rank: usize, line: &str) -> String {
    format!("{}{rank}{}{line}", TAG_START as char, TAG_END as char)
}

/// The rank and the text of a tagged line ([`tag_line`]); `None` for a line
/// without a well-formed tag.
pub fn untag_line(line: &[u8]) -> Option<(usize, &[u8])> {
    let rest = line.strip_prefix(&[TAG_START])?;
    let end = rest.iter().position(|&b| b == TAG_END)?;
    let digits = &rest[..end];
    if digits.is_empty() || digits.len() > 9 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let rank = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some((rank, &rest[end + 1..]))
}

#[cfg(test)]
mod torch_record_tests {
    use super::*;

    #[test]
    fn torch_elastic_records_are_read_with_their_exception_and_innermost_frame() {
        let text = r#"{"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"/x/errors.py\", line 367, in wrapper\n    return f()\n  File \"/tmp/t.py\", line 4, in main\n    raise ValueError(\"boom\")\nValueError: boom\n", "timestamp": "1796190164"}}}"#;
        let dir = std::env::temp_dir().join(format!("accel-torch-rec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("e.json");
        std::fs::write(&p, text).unwrap();
        let r = ErrorRecord::read(&p).unwrap();
        assert!(
            r.message.starts_with("ValueError: boom\nTraceback"),
            "{}",
            r.message
        );
        assert_eq!(r.location.as_deref(), Some("/tmp/t.py:4 (in main)"));
        assert_eq!(r.timestamp, 1796190164);
        std::fs::write(&p, r#"{"message": "plain failure"}"#).unwrap();
        assert_eq!(ErrorRecord::read(&p).unwrap().message, "plain failure");
        std::fs::write(&p, "{}").unwrap();
        assert!(ErrorRecord::read(&p).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
