//! Ranks as threads of one process: the analogue of Accelerate's
//! `notebook_launcher` / `debug_launcher`, and the threads process model of
//! `accel launch --backend xla` (docs/adr/0015-process-model.md).
//!
//! * [`Threads`] runs a closure on N ranks, each a thread of this process
//!   with its own [`ProcessState`], its own [`Accelerator`] (its own
//!   communicator) and one in-memory store they share: tests, notebooks,
//!   debugging. Any backend whose ranks can live in one process works:
//!   `single` (one rank), `cpu-gloo` over loopback, `xla`.
//! * [`run`] is a program's entry: under the processes model (the default)
//!   it connects this process's one rank and calls the closure once; under
//!   `ACCEL_PROCESS_MODEL=threads` (set by `accel launch --backend xla`) it
//!   starts the process's LOCAL_WORLD_SIZE rank threads and calls the
//!   closure on each. A program written with [`run`] runs unchanged under
//!   both.
//!
//! On a rank thread, [`state()`](crate::state()) is the rank's own state,
//! so code that reads it (or builds an [`Accelerator`] from it) sees its
//! rank; threads that a rank thread starts itself do not inherit it.
//!
//! # Failure
//! A rank that returns an error or panics is the run's root cause: its own
//! communicator is aborted first, then the other ranks' (xla wakes them
//! immediately; cpu-gloo closes the failed rank's idle connections, so that
//! the ranks waiting on it in a call get `PeerLost` naming it at once, with
//! its reason), and the root cause is what the entry returns: an error
//! tagged with the rank, a panic as [`ErrorKind::Aborted`] carrying its
//! message. Only a rank blocked in a call that neither the failed rank's
//! connections nor an interrupting engine reach ends at the run's timeout. Under
//! `accel launch` the root cause also goes to `ACCEL_ERROR_FILE` with its
//! rank, and the process exits after [`FAIL_FAST_GRACE`] if ranks are still
//! blocked, as the launcher would stop process workers.
//!
//! # Output
//! Under `accel launch`, lines written with [`rank_println!`](crate::rank_println) /
//! [`rank_eprintln!`](crate::rank_eprintln) carry their rank in a tag
//! ([`tag_line`]) that the launcher turns into the usual `[rank N]` prefix
//! (and routes to that rank's `--tee` file and rank filter). Plain
//! `println!` output of the process carries no rank: the launcher shows it
//! under the process's first rank, which is right for what the main process
//! prints ([`Accelerator::print`], `if acc.is_main_process()`). Under
//! [`Threads`], the macros prefix `[rank N] ` themselves.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use accel_api::{Communicator, Error, ErrorKind, Result, Store};

pub use crate::rank_output::print_rank_line;
/// The rank tag's format lives in the worker protocol
/// ([`accel_api::worker`]); re-exported where it always was.
pub use accel_api::worker::{tag_line, untag_line};

use crate::rank_output::panic_message;

use crate::state::{self, enter_rank_thread, ProcessModel, ProcessState, RankThread};
use crate::{Accelerator, Registry, WorkerEnv};
use accel_api::sync::lock;

/// Under `accel launch`, how long the other rank threads get to end after
/// the root-cause failure before the process exits (their communicators are
/// aborted first).
pub const FAIL_FAST_GRACE: Duration = Duration::from_secs(3);

/// `println!` for code on rank threads: the line carries the rank (see
/// [`print_rank_line`]); on other threads, a plain `println!`.
#[macro_export]
macro_rules! rank_println {
    ($($arg:tt)*) => {
        $crate::threads::print_rank_line(false, format_args!($($arg)*))
    };
}

/// `eprintln!` for code on rank threads (see [`rank_println!`](crate::rank_println)).
#[macro_export]
macro_rules! rank_eprintln {
    ($($arg:tt)*) => {
        $crate::threads::print_rank_line(true, format_args!($($arg)*))
    };
}

/// Runs a closure on N ranks, each a thread of this process (Accelerate's
/// `notebook_launcher` / `debug_launcher`).
///
/// ```no_run
/// use accel::{ReduceOp, Threads};
/// let sums = Threads::new(4).backend("cpu-gloo").run(|acc| {
///     let mut x = [acc.rank() as f32];
///     acc.all_reduce(&mut x, ReduceOp::Sum)?;
///     Ok(x[0])
/// })?;
/// assert_eq!(sums, vec![6.0; 4]);
/// # Ok::<(), accel::Error>(())
/// ```
#[derive(Clone)]
pub struct Threads {
    world_size: usize,
    backend: Option<Vec<String>>,
    timeout: Option<Duration>,
    debug: Option<bool>,
    registry: Option<Arc<Registry>>,
}

impl fmt::Debug for Threads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Threads")
            .field("world_size", &self.world_size)
            .field("backend", &self.backend)
            .field("timeout", &self.timeout)
            .field("debug", &self.debug)
            .finish()
    }
}

impl Threads {
    /// `world_size` rank threads; the backend is chosen as for a run of
    /// that many ranks (`ACCEL_BACKEND`, else the probe order), the timeout
    /// is `ACCEL_TIMEOUT`'s (default 300 s).
    pub fn new(world_size: usize) -> Threads {
        Threads {
            world_size,
            backend: None,
            timeout: None,
            debug: None,
            registry: None,
        }
    }

    /// Connect every rank through `backend` itself (a backend object the
    /// caller holds, e.g. a loaded plugin's), instead of choosing from the
    /// registry. Its probe still decides; for xla several ranks need the
    /// facade's `xla` feature, which marks the rank threads for xla's
    /// probe (or `ACCEL_PROCESS_MODEL=threads` in the environment).
    pub fn with_backend(mut self, backend: Arc<dyn accel_api::Backend>) -> Threads {
        self.backend = Some(vec![backend.name().to_string()]);
        let mut r = Registry::empty();
        // An empty registry takes any one backend.
        let _ = r.register(backend, crate::Origin::Builtin);
        self.registry = Some(Arc::new(r));
        self
    }

    /// Use these backends, in order of preference (`xla`,
    /// `cpu-gloo,single`: ACCEL_BACKEND's spelling).
    pub fn backend(mut self, names: &str) -> Threads {
        self.backend = Some(
            names
                .split(',')
                .map(|s| s.trim().to_ascii_lowercase())
                .filter(|s| !s.is_empty())
                .collect(),
        );
        self
    }

    /// The bound of every blocking call of the ranks.
    pub fn timeout(mut self, timeout: Duration) -> Threads {
        self.timeout = Some(timeout);
        self
    }

    /// Debug mode (ACCEL_DEBUG): fingerprint every collective.
    pub fn debug(mut self, on: bool) -> Threads {
        self.debug = Some(on);
        self
    }

    /// The state rank `rank` gets: a one-machine run of `world_size` ranks,
    /// the threads process model, the environment's ACCEL_BACKEND,
    /// ACCEL_TIMEOUT and ACCEL_DEBUG unless set here.
    fn rank_state(&self, env: &WorkerEnv, rank: usize) -> Result<ProcessState> {
        let w = WorkerEnv {
            rank: Some(rank),
            world_size: Some(self.world_size),
            local_rank: Some(rank),
            local_world_size: Some(self.world_size),
            group_rank: Some(0),
            group_world_size: Some(1),
            run_id: Some("threads".into()),
            timeout: self.timeout.or(env.timeout),
            backend: self.backend.clone().or_else(|| env.backend.clone()),
            debug: self.debug.or(env.debug),
            share_devices: env.share_devices,
            process_model: Some(ProcessModel::Threads),
            ..WorkerEnv::default()
        };
        let vars = w
            .to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        // Every rank of the run is a thread of this process.
        Ok(ProcessState::from_vars(vars)?.in_process_of_local_rank(0))
    }

    /// Call `f` on every rank, each on its own thread with its own
    /// connected [`Accelerator`]; the results in rank order.
    ///
    /// Blocks until every rank has ended. Each rank's blocking calls are
    /// bounded by the timeout; `f` itself is the caller's.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for zero ranks or a call from a rank
    /// thread; malformed `ACCEL_*` variables; otherwise the root cause: the
    /// first rank to fail (its connect error, its error, or its panic as
    /// [`ErrorKind::Aborted`]), tagged with its rank.
    pub fn run<T, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(&Accelerator) -> Result<T> + Sync,
    {
        if self.world_size == 0 {
            return Err(Error::invalid_argument(
                "accel::Threads",
                "a run needs at least one rank",
            ));
        }
        not_nested("accel::Threads::run")?;
        let env = WorkerEnv::from_vars(&std::env::vars().collect())?;
        let states = (0..self.world_size)
            .map(|r| self.rank_state(&env, r).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        let store: Arc<dyn Store> = Arc::new(accel_rendezvous::MemoryStore::new());
        let registry = match &self.registry {
            Some(r) => r.clone(),
            None => Arc::new(Registry::from_env()),
        };
        host(
            &states,
            &Host {
                store: Some(store),
                tagged: false,
                under_launcher: false,
                registry,
            },
            &f,
        )
    }
}

/// A program's entry, for either process model: connect this process's
/// rank(s) and call `f` with each rank's [`Accelerator`]; the results of
/// this process's ranks in rank order.
///
/// * Processes (the default): one rank, [`Accelerator::new`], one call.
/// * Threads (`ACCEL_PROCESS_MODEL=threads`, set by `accel launch
///   --backend xla`): LOCAL_WORLD_SIZE rank threads whose first is RANK /
///   LOCAL_RANK, each connecting through the run's store as a process
///   would, each with its own state ([`state()`](crate::state())).
///
/// Also installs the panic hook and ties the process to its launcher, as
/// [`Accelerator::new`] does.
///
/// ```no_run
/// fn main() -> accel::Result<()> {
///     accel::run(|acc| {
///         let mut x = [1.0f32];
///         acc.all_reduce(&mut x, accel::ReduceOp::Sum)?;
///         acc.print(format_args!("{} ranks", x[0]));
///         Ok(())
///     })?;
///     Ok(())
/// }
/// ```
///
/// # Errors
/// As [`Accelerator::new`] for a process's one rank; under the threads
/// model, as [`Threads::run`]. Under `accel launch`, when a rank fails
/// while others stay blocked past [`FAIL_FAST_GRACE`], the process exits
/// with code 1 after recording the root cause instead of returning.
pub fn run<T, F>(f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(&Accelerator) -> Result<T> + Sync,
{
    not_nested("accel::run")?;
    crate::install_panic_hook();
    crate::tie_to_launcher();
    let process = state::process_state()?;
    if process.process_model == ProcessModel::Processes {
        let acc = Accelerator::new()?;
        return Ok(vec![f(&acc)?]);
    }
    let states = (0..process.ranks_in_process())
        .map(|i| process.rank_thread(i).map(Arc::new))
        .collect::<Result<Vec<_>>>()?;
    let under_launcher = process.source == crate::LaunchSource::Accel;
    // A whole run in this process with no store named: the ranks share one
    // in memory. Otherwise each rank opens the run's store itself, as a
    // process would (one client per rank: a blocking wait on one cannot
    // hold up another rank's calls).
    let whole_run_here = states.len() == process.world_size
        && process.store_url.is_none()
        && process.master_addr.is_none();
    let store =
        whole_run_here.then(|| Arc::new(accel_rendezvous::MemoryStore::new()) as Arc<dyn Store>);
    host(
        &states,
        &Host {
            store,
            tagged: under_launcher,
            under_launcher,
            registry: Arc::new(Registry::from_env()),
        },
        &f,
    )
}

fn not_nested(what: &str) -> Result<()> {
    match state::thread_rank() {
        Some(rank) => Err(Error::invalid_argument(
            what,
            format!("called on rank thread {rank}, which is already a rank of a run"),
        )
        .with_fix("call it once, from the thread that starts the run")),
        None => Ok(()),
    }
}

/// How [`host`] runs its ranks.
struct Host {
    store: Option<Arc<dyn Store>>,
    tagged: bool,
    under_launcher: bool,
    registry: Arc<Registry>,
}

/// What the rank threads and the caller share.
struct Shared {
    comms: Vec<Option<Arc<dyn Communicator>>>,
    /// The root cause's text, once a rank failed.
    failed: Option<String>,
}

/// Run `f` on one thread per state; see [`Threads::run`] and [`run`].
fn host<T, F>(states: &[Arc<ProcessState>], how: &Host, f: &F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(&Accelerator) -> Result<T> + Sync,
{
    let n = states.len();
    let registry = &*how.registry;
    let shared = Mutex::new(Shared {
        comms: vec![None; n],
        failed: None,
    });
    // Every rank's accelerator lives until all ranks are done: nobody
    // tears its communicator down under a peer still finishing a call.
    let keep: Mutex<Vec<Accelerator>> = Mutex::new(Vec::with_capacity(n));
    let (tx, rx) = mpsc::channel::<(usize, Result<T>)>();
    // An abort() in one rank thread ends every rank of the process: the
    // thread says which rank it was, for the launcher's root cause.
    accel_signals::name_aborting_rank_threads();
    std::thread::scope(|s| {
        for (i, st) in states.iter().enumerate() {
            let rt = RankThread {
                state: st.clone(),
                store: how.store.clone(),
                tagged: how.tagged,
            };
            let (rank_tx, shared, keep) = (tx.clone(), &shared, &keep);
            let body = move || {
                let rank = rt.state.rank;
                let state = rt.state.clone();
                let _me = enter_rank_thread(rt);
                let out = catch_unwind(AssertUnwindSafe(|| -> Result<T> {
                    let acc = Accelerator::connect(state, registry)?;
                    {
                        let mut sh = lock(shared);
                        sh.comms[i] = Some(acc.comm().clone());
                        if let Some(why) = &sh.failed {
                            acc.abort(why);
                        }
                    }
                    let out = f(&acc);
                    lock(keep).push(acc);
                    out
                }))
                .unwrap_or_else(|p| {
                    Err(Error::new(
                        ErrorKind::Aborted,
                        format!("rank thread {rank} panicked: {}", panic_message(&*p)),
                    ))
                });
                let out = out.map_err(|e| match e.rank() {
                    Some(_) => e,
                    None => e.with_rank(rank),
                });
                let _ = rank_tx.send((i, out));
            };
            let spawned = std::thread::Builder::new()
                .name(format!("rank {}", st.rank))
                .spawn_scoped(s, body);
            if let Err(e) = spawned {
                let why = format!("could not start the thread of rank {}: {e}", st.rank);
                fail_all(shared, None, &why);
                return Err(Error::io("starting a rank thread", e).with_rank(st.rank));
            }
        }
        drop(tx);
        collect(states, how, &shared, &rx)
    })
}

/// Abort every connected rank with `why`, the failed one (`failed`) first,
/// and make ranks that connect later abort themselves.
///
/// The failed rank's thread has ended, so its communicator is idle: its
/// abort closes its connections at once (cpu-gloo) or breaks the group's
/// meeting naming it (xla), and the ranks waiting on it in a call get
/// `PeerLost` naming it within moments, whether or not their engine can
/// interrupt a call. Aborting it first makes it the rank they name.
fn fail_all(shared: &Mutex<Shared>, failed: Option<usize>, why: &str) {
    let mut sh = lock(shared);
    sh.failed.get_or_insert_with(|| why.to_string());
    let first = failed.and_then(|i| sh.comms.get(i).cloned().flatten());
    if let Some(c) = first {
        c.abort(why);
    }
    for (j, c) in sh.comms.iter().enumerate() {
        if Some(j) != failed {
            if let Some(c) = c {
                c.abort(why);
            }
        }
    }
}

/// Wait for every rank's outcome; the first failure is the root cause.
fn collect<T>(
    states: &[Arc<ProcessState>],
    how: &Host,
    shared: &Mutex<Shared>,
    rx: &mpsc::Receiver<(usize, Result<T>)>,
) -> Result<Vec<T>> {
    let n = states.len();
    let mut results: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut root: Option<Error> = None;
    let mut deadline: Option<Instant> = None;
    for _ in 0..n {
        let msg = match deadline {
            None => rx.recv().ok(),
            Some(d) => match rx.recv_timeout(d.saturating_duration_since(Instant::now())) {
                Ok(m) => Some(m),
                Err(mpsc::RecvTimeoutError::Disconnected) => None,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let e = root.as_ref().map(|e| e.to_string()).unwrap_or_default();
                    eprintln!(
                        "accel: {e}; the other rank threads did not end within {FAIL_FAST_GRACE:?}, \
                         stopping the process"
                    );
                    std::process::exit(1);
                }
            },
        };
        let Some((i, out)) = msg else { break };
        match out {
            Ok(v) => results[i] = Some(v),
            Err(e) if root.is_none() => {
                let rank = states[i].rank;
                fail_all(shared, Some(i), &format!("rank {rank} failed: {e}"));
                if how.under_launcher {
                    record_root_cause(&states[i], &e);
                    deadline = Some(Instant::now() + FAIL_FAST_GRACE);
                }
                root = Some(e);
            }
            Err(e) => tracing::debug!(
                rank = states[i].rank,
                "rank thread failed after the root cause: {e}"
            ),
        }
    }
    if let Some(e) = root {
        return Err(e);
    }
    let missing: Vec<String> = results
        .iter()
        .zip(states)
        .filter(|(r, _)| r.is_none())
        .map(|(_, s)| s.rank.to_string())
        .collect();
    if !missing.is_empty() {
        return Err(Error::internal(
            "rank threads",
            format!(
                "rank thread(s) {} ended without a result",
                missing.join(", ")
            ),
        ));
    }
    Ok(results.into_iter().flatten().collect())
}

/// Write the root cause to the process's error file for `accel launch`
/// (unless a panic of that rank already did, with its location).
fn record_root_cause(state: &ProcessState, e: &Error) {
    let Some(path) = &state.error_file else {
        return;
    };
    let record = crate::ErrorRecord::now(Some(state.rank), e.to_string(), None);
    if let Err(err) = accel_api::worker::write_first_error(path, &record) {
        tracing::warn!("could not write the error file {}: {err}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_reject_lookalikes() {
        let t = tag_line(12, "loss 0.5");
        assert_eq!(untag_line(t.as_bytes()), Some((12, &b"loss 0.5"[..])));
        assert_eq!(untag_line(tag_line(0, "").as_bytes()), Some((0, &b""[..])));
        for bad in [
            &b"loss"[..],
            b"\x1e\x1fx",
            b"\x1e1x\x1fy",
            b"\x1e12",
            b"\x1e1234567890\x1fy",
        ] {
            assert_eq!(untag_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn zero_ranks_is_an_argument_error() {
        let e = Threads::new(0).run(|_| Ok(())).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::InvalidArgument), "{e}");
    }

    #[test]
    fn every_rank_thread_has_its_own_state_and_errors_name_the_first_failure() {
        let out = Threads::new(1)
            .backend("single")
            .run(|acc| {
                let s = crate::state()?;
                assert_eq!(s.rank, acc.rank());
                assert_eq!(s.process_model, ProcessModel::Threads);
                assert_eq!(state::thread_rank(), Some(0));
                // Nested runs are refused.
                assert!(Threads::new(1).run(|_| Ok(())).is_err());
                Ok(acc.world_size())
            })
            .unwrap();
        assert_eq!(out, vec![1]);
        assert_eq!(state::thread_rank(), None);
        let e = Threads::new(1)
            .backend("single")
            .run(|_| -> Result<()> { panic!("boom") })
            .unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Aborted), "{e}");
        assert!(e.to_string().contains("boom") && e.rank() == Some(0), "{e}");
    }
}
