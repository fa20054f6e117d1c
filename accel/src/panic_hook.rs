//! A process-wide panic hook that writes the root cause of a crash to
//! `ACCEL_ERROR_FILE`, where `accel launch` reads it for its failure report.

use std::sync::Once;

use accel_api::worker::{error_file_from_env, write_first_error};
pub use accel_api::worker::{write_error_file, ErrorRecord};

static INSTALL: Once = Once::new();

/// Install the hook (idempotent). The previous hook still runs, so the usual
/// message still reaches stderr (on a rank thread under `accel launch`, the
/// message is written with the rank's tag instead, unless `RUST_BACKTRACE`
/// asks for the previous hook's backtrace). Without `ACCEL_ERROR_FILE` (or
/// `TORCHELASTIC_ERROR_FILE`) the hook only forwards.
pub fn install_panic_hook() {
    INSTALL.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if let Some(path) = error_file_from_env() {
                let message = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic with a non-string payload".into());
                // A rank thread's own rank (the threads process model);
                // otherwise the process's.
                let rank = crate::state::thread_rank()
                    .or_else(|| std::env::var("RANK").ok().and_then(|r| r.parse().ok()));
                let location = info
                    .location()
                    .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()));
                // Keep the first failure: a later panic while unwinding must
                // not overwrite the root cause.
                let _ =
                    write_first_error(&path, &ErrorRecord::now(rank, message.clone(), location));
                // What every communicator was doing when it crashed.
                let _ = crate::flight::dump_now(&format!("panic: {message}"));
            }
            if !crate::rank_output::report_rank_thread_panic(info) {
                previous(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("err.json");
        let r = ErrorRecord {
            rank: Some(3),
            pid: 42,
            message: "index out of bounds".into(),
            location: Some("src/main.rs:1:2".into()),
            timestamp: 1,
        };
        write_error_file(&p, &r).unwrap();
        assert_eq!(ErrorRecord::read(&p).unwrap(), r);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
        std::fs::write(&p, "garbage").unwrap();
        let e = ErrorRecord::read(&p).unwrap_err();
        assert!(e.to_string().contains("err.json"), "{e}");
    }
}
