//! The error record: the root cause a failing worker writes to
//! `ACCEL_ERROR_FILE` (or `TORCHELASTIC_ERROR_FILE`) and the launcher reads,
//! in accel's format or torch elastic's `@record` format.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::keys;

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
