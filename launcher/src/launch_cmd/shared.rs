//! What both launch paths (the launcher's own process groups in
//! `local.rs`, mpirun in `mpi.rs`) derive from the [`Settings`]: the
//! supervision, the workers' shared environment, the scratch folder.

use std::path::{Path, PathBuf};
use std::time::Duration;

use accel_api::worker::{ProcessModel, WorkerEnv};
use accel_api::{Error, Result};
use accel_launch::output::say;
use accel_launch::{store, Supervision};

use super::args::LaunchArgs;
use super::settings::{Settings, StreamLogs};

/// What the supervisor watches, from the settings; the launcher's record
/// of itself (for `accel dump`) goes to `scratch`.
pub(super) fn supervision(s: &Settings, args: &LaunchArgs, scratch: &Path) -> Result<Supervision> {
    Ok(Supervision {
        ranks: s.ranks.clone(),
        tee: s.tee.clone(),
        streams: s
            .stream_logs
            .as_ref()
            .map(|l| stream_logs(l, s.run_id.as_deref()))
            .transpose()?,
        grace: s.grace,
        hang_timeout: s.hang_timeout,
        wall_limit: None,
        echo: true,
        forward_signals: true,
        stdout_to_stderr: args.workers_stdout_to_stderr,
        // Across machines, the ranks that lost a machine's ranks say so
        // themselves: they wait in the same collective, so they time out
        // (or lose the peer) together; 2 s bounds a rank that printed its
        // error but hangs on its way out.
        peer_drain: s.multi_machine().then_some(Duration::from_secs(2)),
        record: Some(scratch.join(accel_launch::running::RECORD_FILE)),
    })
}

/// Run `f` (the supervised run) with Kubeflow Trainer's progress posts
/// when the pod has `KUBEFLOW_TRAINER_STATUS_URL` (the launcher whose
/// machine runs rank 0 posts: only its dump folder has rank 0's status).
///
/// # Errors
/// A malformed Kubeflow setting (URL, CA file, interval), before `f` runs.
pub(super) fn with_progress_posts<T>(sup: &Supervision, f: impl FnOnce() -> T) -> Result<T> {
    let target = super::kubeflow::Target::from_env(|k| std::env::var(k).ok())?;
    let reporter = match (target, &sup.record) {
        (Some(t), Some(record)) => Some(super::kubeflow::start(t, record.clone())?),
        _ => None,
    };
    let out = f();
    if let Some(r) = reporter {
        r.finish();
    }
    Ok(out)
}

/// torchrun's log layout: a new run directory `RUN_ID_XXXXXXXX` (run id
/// `none` when not given, as torchrun's --rdzv-id) in `base`, or in a new
/// `torchelastic_XXXXXXXX` under the temporary directory, said on stderr.
fn stream_logs(
    (base, tee, redirects): &StreamLogs,
    run_id: Option<&str>,
) -> Result<accel_launch::output::StreamLogs> {
    let base = match base {
        Some(b) => b.clone(),
        None => std::env::temp_dir().join(format!("torchelastic_{}", store::random_hex(4)?)),
    };
    let dir = base.join(format!(
        "{}_{}",
        run_id.unwrap_or("none"),
        store::random_hex(4)?
    ));
    std::fs::create_dir_all(&dir).map_err(|e| {
        Error::io(
            format!("cannot create the log directory {}", dir.display()),
            e,
        )
        .with_fix("pass --log-dir a directory you can write to")
    })?;
    say(&format!("log directory set to: {}", dir.display()));
    Ok(accel_launch::output::StreamLogs {
        dir,
        tee: tee.clone(),
        redirects: redirects.clone(),
    })
}

/// The environment every worker of the run shares (store fields and the
/// restart count are added per attempt).
pub(super) fn base_env(s: &Settings, run_id: &str) -> WorkerEnv {
    WorkerEnv {
        world_size: Some(s.world_size_claim()),
        local_world_size: Some(s.nproc),
        group_rank: Some(s.machine_rank),
        group_world_size: Some(s.num_machines),
        run_id: Some(run_id.to_string()),
        timeout: Some(s.timeout),
        backend: s.backend.clone(),
        debug: Some(s.debug),
        mixed_precision: s.mixed_precision,
        sharding: s.sharding,
        gradient_accumulation_steps: s.gradient_accumulation_steps,
        dump_dir: s.dump_dir.clone(),
        launcher: Some("accel".into()),
        // Lets the runtime tie the worker's life to this process.
        launcher_pid: Some(std::process::id()),
        // Process workers say so, against an inherited ACCEL_PROCESS_MODEL;
        // the threads group writes its own.
        process_model: Some(ProcessModel::Processes),
        ..WorkerEnv::default()
    }
}

/// The launcher's scratch folder, `<temp>/accel-<pid>-<hex>` (the
/// attempts' error files, its record for `accel dump`), removed when the
/// run ends. The folders of earlier launchers that ended without removing
/// theirs (SIGKILL) are removed first.
pub(super) fn scratch_dir() -> Result<PathBuf> {
    remove_stale_scratch(&std::env::temp_dir());
    Ok(std::env::temp_dir().join(format!(
        "accel-{}-{}",
        std::process::id(),
        store::random_hex(4)?
    )))
}

/// Remove every `accel-<pid>-<8 hex>` folder in `temp` whose launcher is
/// gone (no process `<pid>`). A pid reused by another process keeps its
/// folder until that process ends too: a live launcher's files are never
/// at risk. Best effort: a folder that cannot be removed is left.
fn remove_stale_scratch(temp: &Path) {
    let Ok(entries) = std::fs::read_dir(temp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = scratch_pid(&name.to_string_lossy()) else {
            continue;
        };
        let alive = Path::new(&format!("/proc/{pid}")).exists();
        if !alive && e.file_type().is_ok_and(|t| t.is_dir()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The launcher pid in a scratch folder's name `accel-<pid>-<8 hex>`.
fn scratch_pid(name: &str) -> Option<u32> {
    let (pid, hex) = name.strip_prefix("accel-")?.split_once('-')?;
    let hex_ok = hex.len() == 8 && hex.bytes().all(|b| b.is_ascii_hexdigit());
    let pid_ok = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    (hex_ok && pid_ok).then(|| pid.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_folders_of_gone_launchers_are_removed_and_others_kept() {
        let temp = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        // This test's own process stands for a live launcher.
        let live = format!("accel-{}-89abcdef", std::process::id());
        let keep = [
            "accel-dumps",
            "accel-12-nothex!",
            "accel-x-0123abcd",
            "other-1-0123abcd",
            &live,
        ];
        let stale = [format!("accel-{gone}-0123abcd")];
        for n in keep
            .iter()
            .map(|s| s.to_string())
            .chain(stale.iter().cloned())
        {
            std::fs::create_dir(temp.path().join(&n)).unwrap();
            std::fs::write(temp.path().join(&n).join("error.json"), b"{}").unwrap();
        }
        remove_stale_scratch(temp.path());
        for n in keep {
            assert!(temp.path().join(n).is_dir(), "{n} was removed");
        }
        for n in &stale {
            assert!(!temp.path().join(n).exists(), "{n} was kept");
        }
        assert_eq!(scratch_pid("accel-4242-0123abcd"), Some(4242));
        assert_eq!(scratch_pid("accel-4242-0123abc"), None);
    }
}
