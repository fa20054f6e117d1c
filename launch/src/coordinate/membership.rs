//! The machines' membership of one attempt, over the store that machine 0
//! hosts: the join, and the outcome every machine agrees on. All keys live
//! under `accel-launch/a{attempt}/`.
//!
//! # Join (every attempt)
//!
//! 1. Machine `m > 0` takes an arrival number `i = add("arrivals", 1)` and
//!    writes its [`Registration`] (machine rank, processes, number of
//!    machines, world size it expects, run id if given, host) to
//!    `arrival/{i}`.
//! 2. Machine 0 reads `arrival/1`, `arrival/2`, ... and checks each against
//!    its own view: same number of machines, same world size, a machine
//!    rank in range and not taken, the same run id. A bad registration is
//!    refused: machine 0 writes `reply/{i}` = refused(reason), tells every
//!    machine already accepted that the run is aborted, and fails with the
//!    same reason, so both sides stop with one clear message.
//! 3. When all `M - 1` others arrived, machine 0 writes each `reply/{i}` =
//!    accepted([`Plan`]): the run id, the world size, and each machine's
//!    first global rank (the sum of the processes of the machines before
//!    it). Then `closed`, so a late extra machine learns the run started
//!    without it.
//!
//! A wrong token never gets this far: the store refuses the connection
//! (Unauthorized on the joining machine; a warning naming the peer on
//! machine 0, which then reports the machine as missing).
//!
//! # During an attempt
//!
//! The first machine with a failed worker publishes its root cause at
//! `failed` (compare-and-set: the first one wins); every machine watches
//! that key and stops its workers when it appears. A machine whose workers
//! all ended writes `result/{m}`; the attempt succeeded when every machine
//! wrote `ok`. After the outcome, each machine writes `bye/{m}` and machine 0
//! waits for those (briefly) before it shuts the store down.
//!
//!
//! How a silent machine is found and named: `liveness.rs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use accel_api::{CasOutcome, Error, ErrorKind, Result, Store};
use serde::{Deserialize, Serialize};

use crate::event::{Event, LAST_SIGNAL};
use crate::report::Failure;

pub(super) const ROOT: &str = "accel-launch";
/// Poll step of the waiting loops (they also watch for signals).
pub(super) const STEP: Duration = Duration::from_millis(200);

pub(super) fn key(attempt: u32, rest: &str) -> String {
    format!("{ROOT}/a{attempt}/{rest}")
}

/// What a machine tells machine 0 when it joins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Its machine rank.
    pub machine_rank: usize,
    /// Its worker count.
    pub nproc: usize,
    /// The number of machines it was started with.
    pub num_machines: usize,
    /// The world size it expects (`nproc × num_machines`).
    pub world_size: usize,
    /// The run id it was given, if any.
    pub run_id: Option<String>,
    /// Its host name.
    pub host: String,
    /// Its launcher's pid.
    pub pid: u32,
    /// accel version.
    pub version: String,
    /// This launcher's identity across rounds (elastic runs): host, pid and
    /// a random tag.
    #[serde(default)]
    pub id: String,
    /// The fewest machines (`MIN` of `--num-machines MIN:MAX`; equal to
    /// `num_machines` when the run is not elastic).
    #[serde(default)]
    pub min_machines: usize,
}

/// One machine in the [`Plan`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineSlot {
    /// Machine rank.
    pub machine_rank: usize,
    /// Host name.
    pub host: String,
    /// Its worker count.
    pub nproc: usize,
    /// Global rank of its local rank 0.
    pub rank_offset: usize,
    /// Its launcher's identity ([`Registration::id`]).
    #[serde(default)]
    pub id: String,
}

/// What the machines agreed on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// ACCEL_RUN_ID.
    pub run_id: String,
    /// WORLD_SIZE.
    pub world_size: usize,
    /// Restarts allowed (machine 0's --max-restarts rules).
    pub max_restarts: u32,
    /// Every machine, by rank.
    pub machines: Vec<MachineSlot>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Reply {
    Accepted(Plan),
    Refused(String),
}

pub(super) fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

pub(super) fn parse<T: for<'de> Deserialize<'de>>(what: &str, v: &[u8]) -> Result<T> {
    serde_json::from_slice(v).map_err(|e| {
        Error::new(
            ErrorKind::Corrupt,
            format!("the store holds a malformed {what}: {e} (is another program using it?)"),
        )
    })
}

pub(super) fn interrupted() -> Result<()> {
    match LAST_SIGNAL.load(Ordering::SeqCst) {
        0 => Ok(()),
        s => Err(Error::new(
            ErrorKind::Aborted,
            format!(
                "interrupted by {} while the machines were joining",
                crate::report::signal_name(s)
            ),
        )),
    }
}

pub(super) fn is_timeout(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::Timeout { .. })
}

/// Wait for `k`, at most until `deadline`, in short steps that watch for
/// signals. `Ok(None)` when the deadline passed.
pub(super) fn wait_key(store: &dyn Store, k: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
    loop {
        interrupted()?;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return store.try_get(k);
        }
        match store.get(k, left.min(STEP)) {
            Ok(v) => return Ok(Some(v)),
            Err(e) if is_timeout(&e) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Machine 0's side of the join of `attempt`.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when a machine was refused (the reason
/// names it); [`ErrorKind::Timeout`] naming the machines that did not join.
pub fn host_join(
    store: &dyn Store,
    me: &Registration,
    run_id: &str,
    max_restarts: u32,
    attempt: u32,
    timeout: Duration,
) -> Result<Plan> {
    let m = me.num_machines;
    let deadline = Instant::now() + timeout;
    let mut regs: Vec<Option<Registration>> = vec![None; m];
    regs[0] = Some(me.clone());
    let mut arrivals: Vec<(usize, usize)> = Vec::new(); // (arrival index, machine)
    let mut i = 0usize;
    while arrivals.len() < m - 1 {
        // Who is still awaited, for members whose own join timeout ends
        // first.
        let awaited: Vec<String> = (1..m)
            .filter(|k| regs[*k].is_none())
            .map(|k| k.to_string())
            .collect();
        let _ = store.set(&key(attempt, "awaited"), awaited.join(", ").as_bytes());
        i += 1;
        let Some(raw) = wait_key(store, &key(attempt, &format!("arrival/{i}")), deadline)? else {
            let missing: Vec<String> = (1..m)
                .filter(|k| regs[*k].is_none())
                .map(|k| k.to_string())
                .collect();
            let why = format!(
                "machine(s) {} did not join within {:?} ({} of {m} machines joined)",
                missing.join(", "),
                timeout,
                m - missing.len()
            );
            abort(store, attempt, &arrivals, &why);
            // Let the machines that joined read why before the store goes.
            let acks: Vec<String> = arrivals
                .iter()
                .map(|(i, _)| key(attempt, &format!("ack/{i}")))
                .collect();
            let acks: Vec<&str> = acks.iter().map(String::as_str).collect();
            let _ = store.wait(&acks, Duration::from_secs(2));
            return Err(Error::timeout("machine join", timeout, why).with_fix(
                "start `accel launch --machine-rank K` on every other machine with the same \
                 --num-machines, --main-process-ip, --main-process-port and --token; a \
                 machine with the wrong token is refused by the store (see the warning above)",
            ));
        };
        let r: Registration = parse("machine registration", &raw)?;
        let refusal = check(me, run_id, &regs, &r);
        if let Some(why) = refusal {
            let _ = store.set(
                &key(attempt, &format!("reply/{i}")),
                &json(&Reply::Refused(why.clone())),
            );
            abort(
                store,
                attempt,
                &arrivals,
                &format!("machine {} was refused: {why}", r.machine_rank),
            );
            // Give the refused machine a moment to read its answer.
            let _ = store.wait(
                &[&key(attempt, &format!("ack/{i}"))],
                Duration::from_secs(2),
            );
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "refused machine {} (host {}, pid {}): {why}",
                    r.machine_rank, r.host, r.pid
                ),
            )
            .with_op("machine join")
            .with_fix("start every machine with the same --num-machines, --num-processes and --run-id, and a distinct --machine-rank"));
        }
        arrivals.push((i, r.machine_rank));
        let slot = r.machine_rank;
        regs[slot] = Some(r);
    }
    let members = regs
        .iter()
        .enumerate()
        .map(|(k, r)| {
            r.as_ref().ok_or_else(|| {
                Error::new(
                    ErrorKind::Backend,
                    format!("machine {k} missing after the join"),
                )
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let replies: Vec<usize> = arrivals.iter().map(|(i, _)| *i).collect();
    close(store, attempt, (run_id, max_restarts), &members, &replies)
}

/// Fix the membership of `attempt`: `members` in machine-rank order get
/// their first global ranks, the arrivals `replies` are told the plan, and
/// `closed` is written (the barrier on who is in).
pub(super) fn close(
    store: &dyn Store,
    attempt: u32,
    (run_id, max_restarts): (&str, u32),
    members: &[&Registration],
    replies: &[usize],
) -> Result<Plan> {
    let mut machines = Vec::with_capacity(members.len());
    let mut offset = 0;
    for (k, r) in members.iter().enumerate() {
        machines.push(MachineSlot {
            machine_rank: k,
            host: r.host.clone(),
            nproc: r.nproc,
            rank_offset: offset,
            id: r.id.clone(),
        });
        offset += r.nproc;
    }
    let plan = Plan {
        run_id: run_id.to_string(),
        world_size: offset,
        max_restarts,
        machines,
    };
    for i in replies {
        store.set(
            &key(attempt, &format!("reply/{i}")),
            &json(&Reply::Accepted(plan.clone())),
        )?;
    }
    store.set(&key(attempt, "closed"), b"started")?;
    Ok(plan)
}

fn check(
    me: &Registration,
    run_id: &str,
    regs: &[Option<Registration>],
    r: &Registration,
) -> Option<String> {
    if r.num_machines != me.num_machines {
        return Some(format!(
            "machine {} (host {}) was started with --num-machines {}, but machine 0 runs {} machines",
            r.machine_rank, r.host, r.num_machines, me.num_machines
        ));
    }
    if r.world_size != me.world_size {
        return Some(format!(
            "machine {} (host {}) expects world size {} ({} processes x {} machines), but machine 0 \
             runs world size {} ({} processes x {} machines)",
            r.machine_rank,
            r.host,
            r.world_size,
            r.nproc,
            r.num_machines,
            me.world_size,
            me.nproc,
            me.num_machines
        ));
    }
    if r.machine_rank == 0 || r.machine_rank >= me.num_machines {
        return Some(format!(
            "machine rank {} (host {}) is not one of 1..{}: machine 0 is {} (pid {})",
            r.machine_rank,
            r.host,
            me.num_machines - 1,
            me.host,
            me.pid
        ));
    }
    if let Some(Some(prev)) = regs.get(r.machine_rank) {
        return Some(format!(
            "machine rank {} joined twice: from host {} (pid {}) and from host {} (pid {})",
            r.machine_rank, prev.host, prev.pid, r.host, r.pid
        ));
    }
    if let Some(id) = &r.run_id {
        if id != run_id {
            return Some(format!(
                "machine {} (host {}) asks for run id `{id}`, but this run is `{run_id}`",
                r.machine_rank, r.host
            ));
        }
    }
    None
}

pub(super) fn abort(store: &dyn Store, attempt: u32, accepted: &[(usize, usize)], why: &str) {
    for (i, _) in accepted {
        let _ = store.set(
            &key(attempt, &format!("reply/{i}")),
            &json(&Reply::Refused(format!("the run was aborted: {why}"))),
        );
    }
    let _ = store.set(
        &key(attempt, "closed"),
        format!("aborted: {why}").as_bytes(),
    );
}

/// The side of the join of machine `me.machine_rank > 0`.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when machine 0 refused this machine (with
/// its reason); [`ErrorKind::Timeout`] when it did not answer.
pub fn member_join(
    store: &dyn Store,
    me: &Registration,
    attempt: u32,
    timeout: Duration,
) -> Result<Plan> {
    let deadline = Instant::now() + timeout;
    let i = arrive(store, me, attempt)?;
    let reply_key = key(attempt, &format!("reply/{i}"));
    loop {
        let got = reply(store, attempt, i, deadline)?;
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(got) = got {
            return match got {
                Reply::Accepted(plan) => Ok(plan),
                Reply::Refused(why) => Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!("machine 0 refused this machine: {why}"),
                )
                .with_op("machine join")
                .with_fix("start every machine with the same --num-machines, --num-processes and --run-id, and a distinct --machine-rank")),
            };
        }
        if let Some(c) = store.try_get(&key(attempt, "closed"))? {
            // Closed without a reply for us: the run started (or was
            // aborted) without this machine.
            if store.try_get(&reply_key)?.is_none() {
                let c = String::from_utf8_lossy(&c).into_owned();
                let why = if c == "started" {
                    format!(
                        "the run already started with all {} machines; machine rank {} is not part of it",
                        me.num_machines, me.machine_rank
                    )
                } else {
                    format!("machine 0 {c}")
                };
                return Err(Error::new(ErrorKind::InvalidConfig, why).with_op("machine join"));
            }
        }
        if left.is_zero() {
            let awaited = store
                .try_get(&key(attempt, "awaited"))
                .ok()
                .flatten()
                .map(|v| String::from_utf8_lossy(&v).into_owned())
                .filter(|v| !v.is_empty());
            let why = match awaited {
                Some(a) => format!(
                    "machine(s) {a} did not join within {timeout:?}: machine 0 still waits for them"
                ),
                None => format!(
                    "machine 0 did not answer within {timeout:?}: it waits for the other machines to join"
                ),
            };
            return Err(Error::timeout("machine join", timeout, why)
                .with_fix("start every machine of the run, with the same --num-machines"));
        }
    }
}

/// Register `me` as an arrival of `attempt`: its arrival number.
pub(super) fn arrive(store: &dyn Store, me: &Registration, attempt: u32) -> Result<usize> {
    let i = store.add(&key(attempt, "arrivals"), 1)?;
    store.set(&key(attempt, &format!("arrival/{i}")), &json(me))?;
    usize::try_from(i).map_err(|_| {
        Error::new(
            ErrorKind::Corrupt,
            format!("the store's arrival counter is {i} (is another program using it?)"),
        )
    })
}

/// Wait a short step (until `deadline` at most) for machine 0's reply to
/// arrival `i` of `attempt`; acknowledge it when it came.
pub(super) fn reply(
    store: &dyn Store,
    attempt: u32,
    i: usize,
    deadline: Instant,
) -> Result<Option<Reply>> {
    interrupted()?;
    let left = deadline.saturating_duration_since(Instant::now());
    let k = key(attempt, &format!("reply/{i}"));
    let raw = match store.get(&k, left.min(STEP).max(Duration::from_millis(1))) {
        Ok(v) => v,
        Err(e) if is_timeout(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let _ = store.set(&key(attempt, &format!("ack/{i}")), b"1");
    parse("join reply", &raw).map(Some)
}

/// Publish a local root cause. Returns the failure that was first anywhere:
/// ours, or another machine's if it was there before.
pub fn publish_failure(store: &dyn Store, attempt: u32, f: &Failure) -> Option<Failure> {
    match store.compare_set(&key(attempt, "failed"), None, &json(f)) {
        Ok(CasOutcome::Swapped) => Some(f.clone()),
        Ok(CasOutcome::Current(Some(v))) => parse("failure record", &v).ok(),
        Ok(CasOutcome::Current(None)) | Err(_) => None,
    }
}

/// The published root cause of `attempt`, if any.
pub fn failure(store: &dyn Store, attempt: u32) -> Option<Failure> {
    store
        .try_get(&key(attempt, "failed"))
        .ok()
        .flatten()
        .and_then(|v| parse("failure record", &v).ok())
}

/// A thread that turns a published failure (or a lost store) into an event.
#[derive(Debug)]
pub struct Watcher {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Watch `attempt`'s failure key; `me` = this machine's rank (its own
    /// failures are not reported back to it).
    pub fn start(store: Arc<dyn Store>, attempt: u32, me: usize, tx: Sender<Event>) -> Watcher {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::Builder::new()
            .name("accel-watch".into())
            .spawn(move || {
                let k = key(attempt, "failed");
                while !s.load(Ordering::SeqCst) {
                    match store.get(&k, STEP) {
                        Ok(v) => {
                            if let Ok(f) = parse::<Failure>("failure record", &v) {
                                if f.machine != me {
                                    let _ = tx.send(Event::Remote {
                                        attempt,
                                        failure: Box::new(f),
                                    });
                                }
                            }
                            return;
                        }
                        Err(e) if is_timeout(&e) => {}
                        Err(e) => {
                            if !s.load(Ordering::SeqCst) {
                                let _ = tx.send(Event::StoreLost {
                                    attempt,
                                    message: e.to_string(),
                                });
                            }
                            return;
                        }
                    }
                }
            })
            .ok();
        Watcher { stop, handle }
    }

    /// Stop watching. The thread ends after its current read, unwaited:
    /// on a cut link that read takes the store client's whole timeout.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        drop(self.handle.take());
    }
}

/// The outcome of an attempt across machines.
#[derive(Debug)]
pub enum Global {
    /// Every machine's workers exited 0.
    Succeeded,
    /// This root cause, published by some machine.
    Failed(Box<Failure>),
    /// The store went away (machine 0 stopped).
    StoreLost(String),
    /// These machines did not report within the limit of
    /// [`settle_within`] (and no root cause was published).
    Missing(Vec<usize>),
}

/// After this machine's workers ended: publish `ok`/`failed` and wait for
/// the outcome of the whole attempt (every machine ok, or a root cause).
pub fn settle(store: &dyn Store, attempt: u32, me: usize, num_machines: usize, ok: bool) -> Global {
    settle_within(store, attempt, (me, num_machines), ok, None)
}

/// [`settle`], waiting at most `limit` for the other machines' results
/// (elastic runs: a machine that froze or was lost after its workers'
/// last collective would otherwise hold the others forever).
pub fn settle_within(
    store: &dyn Store,
    attempt: u32,
    (me, num_machines): (usize, usize),
    ok: bool,
    limit: Option<Duration>,
) -> Global {
    let t0 = Instant::now();
    let _ = store.set(
        &key(attempt, &format!("result/{me}")),
        if ok { b"ok" } else { b"failed" },
    );
    let results: Vec<String> = (0..num_machines)
        .map(|k| key(attempt, &format!("result/{k}")))
        .collect();
    loop {
        if let Some(f) = failure(store, attempt) {
            return Global::Failed(Box::new(f));
        }
        let refs: Vec<&str> = results.iter().map(String::as_str).collect();
        match store.wait(&refs, STEP) {
            Ok(()) => {
                if let Some(f) = failure(store, attempt) {
                    return Global::Failed(Box::new(f));
                }
                return Global::Succeeded;
            }
            Err(e) if is_timeout(&e) => {
                if LAST_SIGNAL.load(Ordering::SeqCst) != 0 {
                    return Global::StoreLost(
                        "interrupted while waiting for the other machines".into(),
                    );
                }
                if limit.is_some_and(|l| t0.elapsed() >= l) {
                    let missing = (0..num_machines)
                        .filter(|k| matches!(store.try_get(&results[*k]), Ok(None)))
                        .collect::<Vec<_>>();
                    if !missing.is_empty() {
                        return Global::Missing(missing);
                    }
                }
            }
            Err(e) => return Global::StoreLost(e.to_string()),
        }
    }
}

/// Say goodbye (members) or wait, up to `limit`, for the goodbye of the
/// machines `awaited` (machine 0) before the store shuts down.
pub fn farewell(store: &dyn Store, attempt: u32, me: usize, awaited: &[usize], limit: Duration) {
    if me != 0 {
        let _ = store.set(&key(attempt, &format!("bye/{me}")), b"1");
        return;
    }
    let byes: Vec<String> = awaited
        .iter()
        .filter(|k| **k != 0)
        .map(|k| key(attempt, &format!("bye/{k}")))
        .collect();
    let refs: Vec<&str> = byes.iter().map(String::as_str).collect();
    let _ = store.wait(&refs, limit);
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_rendezvous::MemoryStore;

    fn reg(machine_rank: usize, nproc: usize, num_machines: usize) -> Registration {
        Registration {
            machine_rank,
            nproc,
            num_machines,
            world_size: nproc * num_machines,
            run_id: None,
            host: format!("host{machine_rank}"),
            pid: 100 + machine_rank as u32,
            version: "0".into(),
            id: format!("host{machine_rank}:{}", 100 + machine_rank),
            min_machines: num_machines,
        }
    }

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn three_machines_agree_on_offsets() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let members: Vec<_> = [2usize, 1]
            .into_iter()
            .map(|k| {
                let s = store.clone();
                std::thread::spawn(move || member_join(&*s, &reg(k, 2, 3), 0, T))
            })
            .collect();
        let plan = host_join(&*store, &reg(0, 2, 3), "run", 1, 0, T).unwrap();
        assert_eq!(plan.world_size, 6);
        assert_eq!(
            plan.machines
                .iter()
                .map(|m| m.rank_offset)
                .collect::<Vec<_>>(),
            vec![0, 2, 4]
        );
        for m in members {
            assert_eq!(m.join().unwrap().unwrap(), plan);
        }
    }

    #[test]
    fn another_world_size_is_refused_on_both_sides() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let s = store.clone();
        let member = std::thread::spawn(move || member_join(&*s, &reg(1, 3, 2), 0, T));
        let e = host_join(&*store, &reg(0, 2, 2), "run", 0, 0, T).unwrap_err();
        assert!(e.to_string().contains("expects world size 6"), "{e}");
        let e = member.join().unwrap().unwrap_err();
        assert!(
            e.to_string().contains("machine 0 refused this machine")
                && e.to_string().contains("world size 6"),
            "{e}"
        );
    }

    #[test]
    fn duplicate_and_out_of_range_ranks_are_refused() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let s = store.clone();
        let a = std::thread::spawn(move || member_join(&*s, &reg(1, 1, 3), 0, T));
        // Let the first one register before the duplicate.
        std::thread::sleep(Duration::from_millis(50));
        let s = store.clone();
        let b = std::thread::spawn(move || member_join(&*s, &reg(1, 1, 3), 0, T));
        let e = host_join(&*store, &reg(0, 1, 3), "run", 0, 0, T).unwrap_err();
        assert!(e.to_string().contains("joined twice"), "{e}");
        assert!(a
            .join()
            .unwrap()
            .unwrap_err()
            .to_string()
            .contains("aborted"));
        assert!(b
            .join()
            .unwrap()
            .unwrap_err()
            .to_string()
            .contains("joined twice"));
    }

    #[test]
    fn missing_machines_are_named() {
        let store = MemoryStore::new();
        let e = host_join(
            &store,
            &reg(0, 1, 3),
            "run",
            0,
            0,
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("machine(s) 1, 2 did not join"),
            "{e}"
        );
    }

    #[test]
    fn a_member_whose_join_times_out_names_the_machines_still_awaited() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let s = store.clone();
        let host = std::thread::spawn(move || {
            host_join(&*s, &reg(0, 1, 3), "run", 0, 0, Duration::from_secs(2))
        });
        let e = member_join(&*store, &reg(1, 1, 3), 0, Duration::from_millis(500)).unwrap_err();
        assert!(
            e.to_string()
                .contains("machine(s) 2 did not join within 500ms: machine 0 still waits"),
            "{e}"
        );
        let e = host.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("machine(s) 2 did not join"), "{e}");
    }

    #[test]
    fn first_failure_wins_and_settles_everyone() {
        let store = MemoryStore::new();
        let f = |machine| Failure {
            rank: machine,
            local_rank: 0,
            machine,
            host: "h".into(),
            pid: Some(1),
            exit: crate::report::Exit::Code { code: 3 },
            error: None,
            location: None,
            stderr_tail: vec![],
            also_hung: vec![],
            interrupted: false,
        };
        assert_eq!(publish_failure(&store, 0, &f(1)).unwrap().machine, 1);
        assert_eq!(publish_failure(&store, 0, &f(0)).unwrap().machine, 1);
        assert!(matches!(settle(&store, 0, 0, 2, false), Global::Failed(x) if x.machine == 1));
        let _ = store.set(&key(1, "result/1"), b"ok");
        assert!(matches!(settle(&store, 1, 0, 2, true), Global::Succeeded));
    }
}
