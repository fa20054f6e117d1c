//! Elastic membership (`--num-machines MIN:MAX`, torchrun's `--nnodes
//! MIN:MAX`): each attempt is a *round* whose members machine 0 fixes in its
//! store (docs/adr/0026-elastic-membership.md).
//!
//! * Machine 0 opens round `n` (`round` = n), reads the arrivals of
//!   `a{n}/`, and closes the round (`a{n}/closed`, the barrier on who is
//!   in) when `MAX` machines are in, or when at least `MIN` are and the join
//!   window has passed since the `MIN`-th arrived. Fewer than `MIN` after
//!   the join timeout is an error naming the machines that are in.
//! * Machine ranks per round: machine 0 first, then the previous round's
//!   members in their order, then newcomers by their `--machine-rank`, then
//!   in arrival order.
//! * A machine whose registration comes after `closed` waits for the next
//!   round (the next restart), up to its join timeout, or until machine 0
//!   writes `done`.

use std::time::{Duration, Instant};

use accel_api::{Error, ErrorKind, Result, Store};

use super::membership::{
    self, abort, interrupted, json, key, parse, wait_key, Plan, Registration, Reply, ROOT, STEP,
};
use crate::output::say;

/// The bounds of a round.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Fewest machines.
    pub min: usize,
    /// Most machines.
    pub max: usize,
    /// How long the round stays open once `min` are in.
    pub window: Duration,
    /// How long to wait for `min` (and, on other machines, for a round).
    pub timeout: Duration,
}

fn round_key() -> String {
    format!("{ROOT}/round")
}

/// The key machine 0 writes when the run is over.
pub fn done_key() -> String {
    format!("{ROOT}/done")
}

fn who(regs: &[(usize, Registration)], me: &Registration) -> String {
    std::iter::once(me)
        .chain(regs.iter().map(|(_, r)| r))
        .map(|r| format!("{} (pid {})", r.host, r.pid))
        .collect::<Vec<_>>()
        .join(", ")
}

fn refusal(me: &Registration, run_id: &str, r: &Registration) -> Option<String> {
    if r.machine_rank == 0 {
        return Some(format!(
            "machine {} (pid {}) also says --machine-rank 0, but machine 0 ({}, pid {}) hosts this run",
            r.host, r.pid, me.host, me.pid
        ));
    }
    if (r.min_machines, r.num_machines) != (me.min_machines, me.num_machines) {
        return Some(format!(
            "machine {} (pid {}) was started with --num-machines {}:{}, but machine 0 runs {}:{}",
            r.host, r.pid, r.min_machines, r.num_machines, me.min_machines, me.num_machines
        ));
    }
    if r.nproc != me.nproc {
        return Some(format!(
            "machine {} (pid {}) runs {} processes, but machine 0 runs {}: every machine of an \
             elastic run starts the same -n",
            r.host, r.pid, r.nproc, me.nproc
        ));
    }
    match &r.run_id {
        Some(id) if id != run_id => Some(format!(
            "machine {} (pid {}) asks for run id `{id}`, but this run is `{run_id}`",
            r.host, r.pid
        )),
        _ => None,
    }
}

/// Machine 0's side of round `round`; `previous` are the ids of the
/// previous round's machines, in rank order.
///
/// # Errors
/// [`ErrorKind::Timeout`] when fewer than `MIN` machines joined within the
/// timeout (naming those that did); the store's errors.
pub fn host_round(
    store: &dyn Store,
    me: &Registration,
    (run_id, max_restarts): (&str, u32),
    round: u32,
    previous: &[String],
    b: Bounds,
) -> Result<Plan> {
    store.set(&round_key(), round.to_string().as_bytes())?;
    let opened = Instant::now();
    let deadline = opened + b.timeout;
    let mut regs: Vec<(usize, Registration)> = Vec::new();
    let mut min_at = (b.min <= 1).then_some(opened);
    let mut i = 0usize;
    loop {
        let count = 1 + regs.len();
        if count >= b.max || min_at.is_some_and(|t| t.elapsed() >= b.window) {
            break;
        }
        let until = match min_at {
            Some(t) => t + b.window,
            None => deadline,
        };
        match wait_key(store, &key(round, &format!("arrival/{}", i + 1)), until)? {
            Some(raw) => {
                i += 1;
                let r: Registration = parse("machine registration", &raw)?;
                if let Some(why) = refusal(me, run_id, &r) {
                    // One bad machine does not end an elastic run.
                    say(&format!("round {round}: refused {why}"));
                    store.set(
                        &key(round, &format!("reply/{i}")),
                        &json(&Reply::Refused(why)),
                    )?;
                    continue;
                }
                regs.push((i, r));
                if 1 + regs.len() >= b.min && min_at.is_none() {
                    min_at = Some(Instant::now());
                }
            }
            None if min_at.is_none() => {
                let why = format!(
                    "round {round}: {} machine(s) joined within {:?}, fewer than the minimum of {} \
                     (--num-machines {}:{}); in: {}",
                    1 + regs.len(),
                    b.timeout,
                    b.min,
                    b.min,
                    b.max,
                    who(&regs, me)
                );
                let accepted: Vec<(usize, usize)> =
                    regs.iter().map(|(i, r)| (*i, r.machine_rank)).collect();
                abort(store, round, &accepted, &why);
                let _ = store.set(&done_key(), why.as_bytes());
                return Err(Error::timeout("machine join", b.timeout, why).with_fix(
                    "start more machines with the same --num-machines MIN:MAX, \
                     --main-process-ip, --main-process-port and token, or lower MIN",
                ));
            }
            None => {}
        }
    }
    // Stable ranks: machine 0, the previous round's machines that came
    // back in their order, then the newcomers by their --machine-rank, then
    // as they arrived.
    let place = |r: &Registration| {
        previous
            .iter()
            .position(|id| *id == r.id)
            .unwrap_or(usize::MAX)
    };
    regs.sort_by_key(|(i, r)| (place(r), r.machine_rank, *i));
    let members: Vec<&Registration> = std::iter::once(me)
        .chain(regs.iter().map(|(_, r)| r))
        .collect();
    let replies: Vec<usize> = regs.iter().map(|(i, _)| *i).collect();
    let plan = membership::close(store, round, (run_id, max_restarts), &members, &replies)?;
    say(&format!(
        "round {round}: {} machine(s), world size {}: {}",
        plan.machines.len(),
        plan.world_size,
        plan.machines
            .iter()
            .map(|m| format!("{} = {}", m.machine_rank, m.host))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    Ok(plan)
}

fn read_round(store: &dyn Store) -> Result<Option<u32>> {
    Ok(store
        .try_get(&round_key())?
        .and_then(|v| String::from_utf8_lossy(&v).trim().parse().ok()))
}

fn ended(store: &dyn Store) -> Result<Option<String>> {
    Ok(store
        .try_get(&done_key())?
        .map(|v| String::from_utf8_lossy(&v).into_owned()))
}

fn gave_up(timeout: Duration, me: &Registration, round: u32) -> Error {
    Error::timeout(
        "machine join",
        timeout,
        format!(
            "machine {} (pid {}) found no round to join within {timeout:?}: round {round} runs \
             without it, and the run has not restarted since",
            me.host, me.pid
        ),
    )
    .with_fix(
        "a machine joins an elastic run at its next restart; raise --join-timeout to wait longer",
    )
}

/// A machine other than machine 0: join round `from` or the first later
/// one that is open. Returns the round joined and its plan.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when machine 0 refused this machine;
/// [`ErrorKind::Aborted`] when the run ended or was aborted first;
/// [`ErrorKind::Timeout`] when no round took it within the timeout.
pub fn member_round(
    store: &dyn Store,
    me: &Registration,
    from: u32,
    timeout: Duration,
) -> Result<(u32, Plan)> {
    let deadline = Instant::now() + timeout;
    let mut round = from.max(read_round(store)?.unwrap_or(0));
    let mut said = false;
    loop {
        interrupted()?;
        if let Some(why) = ended(store)? {
            return Err(Error::new(
                ErrorKind::Aborted,
                format!(
                    "the run ended before this machine could join a round: {}",
                    why.trim()
                ),
            )
            .with_op("machine join"));
        }
        let closed = store.try_get(&key(round, "closed"))?;
        if closed.is_none() {
            match register(store, me, round, deadline)? {
                Some(plan) => return Ok((round, plan)),
                None => continue, // closed before our turn: look again
            }
        }
        let c = closed
            .map(|c| String::from_utf8_lossy(&c).into_owned())
            .unwrap_or_default();
        if c.starts_with("aborted") {
            return Err(
                Error::new(ErrorKind::Aborted, format!("machine 0 {c}")).with_op("machine join")
            );
        }
        if !said {
            say(&format!(
                "round {round} of the run already started without this machine; it waits for the \
                 next round (the run's next restart)"
            ));
            said = true;
        }
        // Wait for machine 0 to open a later round.
        loop {
            interrupted()?;
            if read_round(store)?.is_some_and(|r| r > round) || ended(store)?.is_some() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(gave_up(timeout, me, round));
            }
            std::thread::sleep(STEP);
        }
        round = read_round(store)?.unwrap_or(round + 1).max(round + 1);
    }
}

/// Register in `round` and wait for machine 0's answer; `None` when the
/// round closed without taking this machine.
fn register(
    store: &dyn Store,
    me: &Registration,
    round: u32,
    deadline: Instant,
) -> Result<Option<Plan>> {
    let i = membership::arrive(store, me, round)?;
    let reply_key = key(round, &format!("reply/{i}"));
    loop {
        let got = membership::reply(store, round, i, deadline)?;
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(got) = got {
            return match got {
                Reply::Accepted(plan) => Ok(Some(plan)),
                Reply::Refused(why) => Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!("machine 0 refused this machine: {why}"),
                )
                .with_op("machine join")
                .with_fix(
                    "start every machine of an elastic run with the same --num-machines MIN:MAX, \
                     -n and --run-id; only machine 0 passes --machine-rank 0",
                )),
            };
        }
        if store.try_get(&key(round, "closed"))?.is_some() && store.try_get(&reply_key)?.is_none() {
            return Ok(None);
        }
        if left.is_zero() {
            return Err(Error::timeout(
                "machine join",
                deadline.elapsed(),
                format!(
                    "machine 0 did not close round {round} in time: fewer than MIN machines joined"
                ),
            )
            .with_fix("start at least MIN machines of the run"));
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use accel_rendezvous::MemoryStore;
    use std::sync::Arc;

    /// A registration of 2 ranks on a run of 2 to 3 machines (the etcd
    /// coordinator's tests use it too).
    pub(in crate::coordinate) fn reg(rank: usize, id: &str) -> Registration {
        Registration {
            machine_rank: rank,
            nproc: 2,
            num_machines: 3,
            world_size: 6,
            run_id: None,
            host: format!("host-{id}"),
            pid: 1,
            version: "0".into(),
            id: id.into(),
            min_machines: 2,
        }
    }

    const B: Bounds = Bounds {
        min: 2,
        max: 3,
        window: Duration::from_millis(300),
        timeout: Duration::from_secs(5),
    };

    #[test]
    fn a_round_closes_at_max_at_once_then_at_min_after_the_window_keeping_the_order() {
        // A window far above a loaded machine's scheduling delays: "closed at
        // once" must not depend on the machine being quiet.
        const B: Bounds = Bounds {
            window: Duration::from_secs(2),
            ..super::tests::B
        };
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let join = |id: &'static str, from: u32| {
            let s = store.clone();
            std::thread::spawn(move || member_round(&*s, &reg(1, id), from, B.timeout))
        };
        let (a, b) = (join("a", 0), join("b", 0));
        let t = Instant::now();
        let plan = host_round(&*store, &reg(0, "h"), ("run", 2), 0, &[], B).unwrap();
        assert!(t.elapsed() < B.window, "closed at MAX without the window");
        assert_eq!(plan.world_size, 6);
        assert_eq!(a.join().unwrap().unwrap(), (0, plan.clone()));
        b.join().unwrap().unwrap();
        let order: Vec<String> = plan.machines.iter().map(|m| m.id.clone()).collect();
        // Round 1: only the second machine comes back; it becomes rank 1.
        let second = order[2].clone();
        let back = {
            let s = store.clone();
            let me = reg(1, if second == "a" { "a" } else { "b" });
            std::thread::spawn(move || member_round(&*s, &me, 1, B.timeout))
        };
        let t = Instant::now();
        let plan1 = host_round(&*store, &reg(0, "h"), ("run", 2), 1, &order, B).unwrap();
        assert!(t.elapsed() >= B.window, "waited the window for a third");
        assert_eq!(plan1.world_size, 4);
        assert_eq!(plan1.machines[1].id, second);
        assert_eq!(plan1.machines[1].rank_offset, 2);
        assert_eq!(back.join().unwrap().unwrap().0, 1);
    }

    #[test]
    fn a_late_machine_waits_for_the_next_round_and_too_few_is_named() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let s = store.clone();
        let a = std::thread::spawn(move || member_round(&*s, &reg(1, "a"), 0, B.timeout));
        host_round(&*store, &reg(0, "h"), ("run", 2), 0, &[], B).unwrap();
        a.join().unwrap().unwrap();
        // Round 0 is closed: a newcomer waits, and is taken in round 1.
        let s = store.clone();
        let late = std::thread::spawn(move || member_round(&*s, &reg(2, "late"), 0, B.timeout));
        std::thread::sleep(Duration::from_millis(300));
        assert!(!late.is_finished());
        let s = store.clone();
        let a = std::thread::spawn(move || member_round(&*s, &reg(1, "a"), 1, B.timeout));
        let plan = host_round(
            &*store,
            &reg(0, "h"),
            ("run", 2),
            1,
            &["h".into(), "a".into()],
            B,
        )
        .unwrap();
        let ids: Vec<&str> = plan.machines.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(ids, ["h", "a", "late"]);
        assert_eq!(late.join().unwrap().unwrap().0, 1);
        a.join().unwrap().unwrap();
        // Round 2: nobody else comes.
        let short = Bounds {
            timeout: Duration::from_millis(400),
            ..B
        };
        let e = host_round(&*store, &reg(0, "h"), ("run", 2), 2, &[], short).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("1 machine(s) joined") && m.contains("minimum of 2") && m.contains("host-h"),
            "{m}"
        );
        // And a machine arriving after that is told the run ended.
        let e = member_round(&*store, &reg(1, "x"), 2, B.timeout).unwrap_err();
        assert!(e.to_string().contains("the run ended"), "{e}");
    }
}
