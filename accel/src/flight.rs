//! Flight-recorder dumps: every communicator ring of this process
//! ([`accel_api::flight`]) written, with the run's identity, to the run's
//! dump folder when something goes wrong (the first timeout, mismatch or
//! lost peer a communicator reports, a panic) and on `SIGUSR1` (what `accel
//! launch` forwards and `accel dump` sends), so that `accel trace DIR` can
//! say what every rank was doing. The folder is `ACCEL_DUMP_DIR` (`accel
//! launch --dump-dir`; the launcher sets one under its logs by default),
//! else `<temp>/accel-dumps/<run id>`. Each dump is one JSON file written
//! atomically, at most [`MAX_CALLS`] calls. [`trace`] merges the dumps of
//! a run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, Once, OnceLock};

use accel_api::flight::{flight_recorders, CallRecord, GroupIdentity};
use accel_api::{Error, ErrorKind, Result};

pub mod trace;

/// Where dumps go (`accel launch --dump-dir` sets it for its workers).
pub const DUMP_DIR_ENV: &str = accel_api::worker::keys::ACCEL_DUMP_DIR;

/// The `format` of a dump file.
pub const DUMP_FORMAT: &str = "accel-flight-dump/1";

/// The most calls one dump holds (the newest, across rings).
pub const MAX_CALLS: usize = 50_000;

/// One ring in a dump.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GroupDump {
    /// Whose ring.
    pub identity: GroupIdentity,
    /// Its calls, oldest first.
    pub calls: Vec<CallRecord>,
}

/// One dump file: why, who, and every ring of the process.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Dump {
    /// [`DUMP_FORMAT`].
    pub format: String,
    /// What made the process dump (`signal`, `timeout: ...`, `panic: ...`).
    pub reason: String,
    /// The run (`ACCEL_RUN_ID`).
    pub run_id: String,
    /// The process's rank (its first rank with ranks as threads).
    pub rank: Option<usize>,
    /// Ranks in the run.
    pub world_size: Option<usize>,
    /// The attempt (`ACCEL_RESTART_COUNT`), so that `accel trace` reads
    /// one attempt of a restarted run.
    #[serde(default)]
    pub restart: Option<u32>,
    /// This machine's name.
    pub host: String,
    /// This process.
    pub pid: u32,
    /// When, in microseconds since the Unix epoch.
    pub time_us: u64,
    /// Every ring of the process.
    pub groups: Vec<GroupDump>,
    /// What each rank of the process was doing: section, step, the last
    /// step's phase times, straggler score ([`crate::watch`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<crate::watch::RankStatus>,
}

fn env_usize(key: &str) -> Option<usize> {
    std::env::var(key).ok().and_then(|v| v.trim().parse().ok())
}

fn run_id() -> String {
    std::env::var(accel_api::worker::keys::ACCEL_RUN_ID)
        .or_else(|_| std::env::var(accel_api::worker::keys::TORCHELASTIC_RUN_ID))
        .unwrap_or_else(|_| "default".into())
}

/// The folder this process dumps into.
pub fn dump_dir() -> PathBuf {
    match std::env::var_os(DUMP_DIR_ENV) {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => accel_api::worker::default_dump_dir(&run_id()),
    }
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// This process's rings as a dump for `reason` (the newest
/// [`MAX_CALLS`] calls).
pub fn snapshot(reason: &str) -> Dump {
    let mut groups: Vec<GroupDump> = flight_recorders()
        .iter()
        .map(|r| GroupDump {
            identity: r.identity().clone(),
            calls: r.snapshot(),
        })
        .collect();
    let total: usize = groups.iter().map(|g| g.calls.len()).sum();
    if total > MAX_CALLS {
        // Drop the oldest calls first, across rings.
        let mut times: Vec<u64> = groups
            .iter()
            .flat_map(|g| g.calls.iter().map(|c| c.issued_us))
            .collect();
        times.sort_unstable();
        let cut = times[total - MAX_CALLS];
        for g in &mut groups {
            g.calls.retain(|c| c.issued_us >= cut);
        }
    }
    let world = groups
        .iter()
        .map(|g| &g.identity)
        .find(|i| i.name == "world")
        .cloned();
    let world = world.as_ref();
    Dump {
        format: DUMP_FORMAT.into(),
        reason: reason.to_string(),
        run_id: run_id(),
        // Under mpirun no RANK: the world ring's.
        rank: crate::state::thread_rank()
            .or_else(|| env_usize("RANK"))
            .or_else(|| world.map(|w| w.rank)),
        world_size: env_usize("WORLD_SIZE").or_else(|| world.map(|w| w.world_size)),
        restart: env_usize(accel_api::worker::keys::ACCEL_RESTART_COUNT)
            .and_then(|r| u32::try_from(r).ok()),
        host: nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default(),
        pid: std::process::id(),
        time_us: now_us(),
        groups,
        ranks: crate::watch::watches()
            .iter()
            .map(|w| w.status_with_phases())
            .collect(),
    }
}

/// Write this process's rings to `dir` for `reason`: one new file,
/// `rank<R>-pid<P>-<N>.json`, written atomically. Returns its path.
///
/// # Errors
/// [`ErrorKind::Io`] naming the folder or file.
pub fn dump_to(dir: &Path, reason: &str) -> Result<PathBuf> {
    static N: AtomicU32 = AtomicU32::new(0);
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating the dump folder {}", dir.display()), e))?;
    let d = snapshot(reason);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let rank = d.rank.map_or_else(|| "x".to_string(), |r| r.to_string());
    let path = dir.join(format!("rank{rank}-pid{}-{n}.json", d.pid));
    accel_api::durable::write_atomic(&path, |w| {
        serde_json::to_writer(w, &d).map_err(std::io::Error::other)
    })?;
    Ok(path)
}

/// [`dump_to`] the run's folder ([`dump_dir`]).
///
/// # Errors
/// As [`dump_to`].
pub fn dump_now(reason: &str) -> Result<PathBuf> {
    dump_to(&dump_dir(), reason)
}

/// [`dump_now`] for `reason`, said on stderr: what a section timeout
/// ([`crate::watch`]) calls before it ends the process.
pub fn dump_for_watch(reason: &str) {
    match dump_now(reason) {
        Ok(p) => eprintln!("accel: flight recorder dumped to {}", p.display()),
        Err(e) => eprintln!("accel: the flight recorder could not be dumped: {e}"),
    }
}

/// Dump once per kind of failure (the first timeout, the first mismatch,
/// ...): what a communicator's error path calls. Failures to write are
/// logged, never returned (the communicator's error is what matters).
pub fn dump_on_failure(err: &Error) {
    let kind = match err.kind() {
        ErrorKind::Timeout { .. } => "timeout",
        ErrorKind::Mismatch { .. } => "mismatch",
        ErrorKind::PeerLost { .. } => "lost peer",
        _ => return,
    };
    static DONE: OnceLock<Mutex<Vec<&'static str>>> = OnceLock::new();
    {
        let mut done = DONE
            .get_or_init(|| Mutex::new(Vec::new()))
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if done.contains(&kind) {
            return;
        }
        done.push(kind);
    }
    match dump_now(&format!("{kind}: {err}")) {
        Ok(p) => tracing::warn!("flight recorder dumped to {} ({kind})", p.display()),
        Err(e) => tracing::warn!("the flight recorder could not be dumped: {e}"),
    }
}

/// The layer over a sub-group's communicator (made by `split` under the
/// stall inspector): its first timeout, mismatch or lost peer dumps too,
/// as the world's does.
#[derive(Debug)]
pub(crate) struct DumpOnFailure;

impl accel_api::Layer for DumpOnFailure {
    fn before(&self, _: &dyn accel_api::Communicator, _: &accel_api::CallInfo) -> Result<()> {
        Ok(())
    }

    fn on_error(
        &self,
        _: &dyn accel_api::Communicator,
        _: &accel_api::CallInfo,
        err: Error,
    ) -> Error {
        dump_on_failure(&err);
        err
    }

    fn wrap_split(
        &self,
        sub: Box<dyn accel_api::Communicator>,
        _: u32,
    ) -> Box<dyn accel_api::Communicator> {
        Box::new(accel_api::Layered::new(sub, DumpOnFailure))
    }
}

/// Dump on every `SIGUSR1` (from `accel launch`, `accel dump` or `kill
/// -USR1`), from a thread of its own; the program goes on. Idempotent.
pub fn install_dump_on_signal() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let signals = match signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1]) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("SIGUSR1 dumps are off: {e}");
                return;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("accel-dump-on-signal".into())
            .spawn(move || {
                let mut signals = signals;
                for _ in signals.forever() {
                    match dump_now("signal: SIGUSR1") {
                        Ok(p) => eprintln!("accel: flight recorder dumped to {}", p.display()),
                        Err(e) => eprintln!("accel: the flight recorder could not be dumped: {e}"),
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("SIGUSR1 dumps are off: {e}");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_api::{CommunicatorExt, ReduceOp};

    #[test]
    fn a_dump_holds_every_live_ring_and_reads_back() {
        let comm = accel_backend_single::connect_named(
            "single",
            accel_api::ConnectContext::local(
                0,
                1,
                std::time::Duration::from_secs(5),
                std::sync::Arc::new(accel_rendezvous::MemoryStore::new()),
            ),
        )
        .unwrap();
        comm.all_reduce_slice(&mut [1.0f32; 3], ReduceOp::Sum)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dump_to(dir.path(), "test").unwrap();
        let d: Dump = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(
            (d.format.as_str(), d.reason.as_str()),
            (DUMP_FORMAT, "test")
        );
        assert_eq!(d.pid, std::process::id());
        assert!(
            d.groups
                .iter()
                .any(|g| g.identity.backend == "single" && g.calls.iter().any(|c| c.count == 3)),
            "{d:?}"
        );
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temp file left"
        );
    }
}
