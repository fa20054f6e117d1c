//! The threads process model of `accel launch` (docs/adr/0015-process-model.md):
//! one process per machine whose rank threads are the machine's `-n` ranks,
//! supervised like process workers ([`accel_launch::ThreadsGroup`]).
//!
//! It is the model of `--backend xla` (the PJRT CPU plugin runs collectives
//! only among the devices of one process, and TPU hosts drive their chips
//! from one process, ADR 0012). `ACCEL_PROCESS_MODEL=threads` in the
//! launcher's environment asks for it with any backend whose ranks can
//! share a process (cpu-gloo); `ACCEL_PROCESS_MODEL=processes` keeps one
//! process per rank even for xla. The program opts in by entering through
//! `accel::run`, which starts the rank threads.

use accel_api::worker::{keys, ProcessModel};
use accel_api::Result;

use super::settings::Settings;

/// The process model of a launch with `s`, given the launcher's
/// environment (`env`).
///
/// # Errors
/// A malformed `ACCEL_PROCESS_MODEL`, naming it.
pub fn model(s: &Settings, env: &dyn Fn(&str) -> Option<String>) -> Result<ProcessModel> {
    if let Some(v) = env(keys::ACCEL_PROCESS_MODEL) {
        return ProcessModel::parse(&v);
    }
    let xla = s
        .backend
        .as_ref()
        .and_then(|b| b.first())
        .is_some_and(|b| b == "xla");
    Ok(if xla {
        ProcessModel::Threads
    } else {
        ProcessModel::Processes
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch_cmd::options::Options;

    fn settings(backend: Option<&str>) -> Settings {
        let o = Options {
            backend: backend.map(|b| super::super::options::Backends(vec![b.to_string()])),
            ..Options::default()
        };
        Settings::resolve(o).unwrap()
    }

    #[test]
    fn xla_runs_as_threads_unless_the_environment_says_otherwise() {
        let none = |_: &str| None;
        assert_eq!(
            model(&settings(Some("xla")), &none).unwrap(),
            ProcessModel::Threads
        );
        assert_eq!(
            model(&settings(Some("cpu-gloo")), &none).unwrap(),
            ProcessModel::Processes
        );
        assert_eq!(
            model(&settings(None), &none).unwrap(),
            ProcessModel::Processes
        );
        let threads = |_: &str| Some("threads".to_string());
        assert_eq!(
            model(&settings(Some("cpu-gloo")), &threads).unwrap(),
            ProcessModel::Threads
        );
        let procs = |_: &str| Some("processes".to_string());
        assert_eq!(
            model(&settings(Some("xla")), &procs).unwrap(),
            ProcessModel::Processes
        );
        let bad = |_: &str| Some("fibers".to_string());
        let e = model(&settings(None), &bad).unwrap_err();
        assert!(e.to_string().contains("ACCEL_PROCESS_MODEL"), "{e}");
    }
}
