//! The launchers' heartbeats during an attempt, and the root cause when a
//! machine goes silent.
//!
//! Every launcher adds 1 to `alive/{m}` every [`BEAT`], over a connection of
//! its own, and reads the others' counters ([`Liveness`]). A machine whose
//! counter has not moved for the lost threshold (`--timeout` + 2 s) is
//! lost: the root cause names it (`Exit::Lost`), not a rank that timed out
//! waiting for it. A rank failure that speaks of a lost or late peer is
//! published as the loss of the machine that went silent
//! ([`SUSPECT`] earlier: a killed launcher's ranks fail at once). A
//! launcher whose own heartbeat cannot reach the store for that long has
//! lost the others: it stops its workers and says so, without waiting on
//! the store again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use accel_api::Store;

use super::membership::{key, Plan};
use crate::report::{Exit, Failure};

/// How often a launcher beats.
pub const BEAT: Duration = Duration::from_millis(250);

/// How long a machine may be silent before a rank failure that speaks of a
/// lost or late peer is blamed on it.
pub const SUSPECT: Duration = Duration::from_millis(1000);

/// The heartbeat counters as this machine last saw them.
#[derive(Debug)]
struct Table {
    /// Per machine: its counter and when that changed (this machine's
    /// clock). This machine's own entry: when its beat last reached the
    /// store.
    seen: Vec<(i64, Instant)>,
    /// Why this machine's last beat failed, if it did.
    beat_error: Option<String>,
}

/// The launchers' heartbeats during one attempt: this machine's beat and
/// what the others' say.
#[derive(Debug)]
pub struct Liveness {
    me: usize,
    table: Arc<Mutex<Table>>,
    stop: Arc<AtomicBool>,
}

/// Machines silent for longer than asked, with how long.
pub type Silent = Vec<(usize, Duration)>;

impl Liveness {
    /// Beat into `store` (a connection of this launcher's liveness alone,
    /// so that a beat stuck on a cut link holds up nothing else) and call
    /// `on_lost` once, from another thread, when a machine was silent for
    /// `lost_after`: with this machine (`me`) alone when its own beat did
    /// not reach the store (and the store's last error), else with the
    /// silent others.
    pub fn start(
        store: Arc<dyn Store>,
        attempt: u32,
        me: usize,
        num_machines: usize,
        lost_after: Duration,
        on_lost: Box<dyn FnOnce(Silent, Option<String>) + Send>,
    ) -> Liveness {
        let now = Instant::now();
        let table = Arc::new(Mutex::new(Table {
            seen: vec![(0, now); num_machines],
            beat_error: None,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let live = Liveness {
            me,
            table: table.clone(),
            stop: stop.clone(),
        };
        let (t, st) = (table.clone(), stop.clone());
        let _ = std::thread::Builder::new()
            .name("accel-beat".into())
            .spawn(move || {
                let keys: Vec<String> = (0..num_machines)
                    .map(|k| key(attempt, &format!("alive/{k}")))
                    .collect();
                while !st.load(Ordering::SeqCst) {
                    let beat = store.add(&keys[me], 1);
                    let mut read = vec![None; num_machines];
                    for (k, slot) in read.iter_mut().enumerate().filter(|(k, _)| *k != me) {
                        *slot = store
                            .try_get(&keys[k])
                            .ok()
                            .flatten()
                            .and_then(|v| String::from_utf8_lossy(&v).parse::<i64>().ok());
                    }
                    let now = Instant::now();
                    let mut tab = t.lock().unwrap_or_else(|p| p.into_inner());
                    match beat {
                        Ok(_) => {
                            tab.seen[me].1 = now;
                            tab.beat_error = None;
                        }
                        Err(e) => tab.beat_error = Some(e.to_string()),
                    }
                    for (k, v) in read.into_iter().enumerate() {
                        if let Some(v) = v.filter(|v| *v != tab.seen[k].0) {
                            tab.seen[k] = (v, now);
                        }
                    }
                    drop(tab);
                    std::thread::sleep(BEAT);
                }
            });
        let probe = Liveness {
            me,
            table,
            stop: stop.clone(),
        };
        let _ = std::thread::Builder::new()
            .name("accel-liveness".into())
            .spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(BEAT);
                    let own = probe.own_silence();
                    let others = probe.silent(lost_after);
                    // Silent others while this machine's own beat fails
                    // too: this machine is the one cut off.
                    let lost = if own > lost_after || (own > SUSPECT && !others.is_empty()) {
                        vec![(me, own)]
                    } else {
                        others
                    };
                    if !lost.is_empty() && !stop.load(Ordering::SeqCst) {
                        let why = probe
                            .table
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .beat_error
                            .clone();
                        on_lost(lost, why);
                        return;
                    }
                }
            });
        live
    }

    /// How long ago this machine's own beat last reached the store.
    pub fn own_silence(&self) -> Duration {
        let tab = self.table.lock().unwrap_or_else(|p| p.into_inner());
        tab.seen[self.me].1.elapsed()
    }

    /// The other machines silent for longer than `d`.
    pub fn silent(&self, d: Duration) -> Silent {
        let tab = self.table.lock().unwrap_or_else(|p| p.into_inner());
        tab.seen
            .iter()
            .enumerate()
            .filter(|(k, _)| *k != self.me)
            .map(|(k, (_, at))| (k, at.elapsed()))
            .filter(|(_, s)| *s > d)
            .collect()
    }

    /// `true` when this machine's beat reaches the store (its answers, and
    /// the store itself, can be trusted).
    pub fn reaches_store(&self) -> bool {
        self.own_silence() <= SUSPECT
    }

    /// Stop beating (the threads end within a beat, unwaited). Dropping
    /// does not stop them: the thread that watches holds a copy.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Where a run's store lives, for the words of a loss: on machine 0 (its
/// address), or on an etcd cluster that no machine hosts (its URL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSite {
    Machine0(String),
    Cluster(String),
}

impl std::fmt::Display for StoreSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreSite::Machine0(at) | StoreSite::Cluster(at) => f.write_str(at),
        }
    }
}

/// The root cause of losing the machines `lost` (the first one is named)
/// as `me` sees it; `plan` gives their hosts and ranks, `witness` the rank
/// failure that was noticed first, if any.
pub fn lost_failure(
    plan: &Plan,
    me: usize,
    lost: &Silent,
    site: &StoreSite,
    witness: Option<&Failure>,
) -> Failure {
    let (first, silent) = lost.first().copied().unwrap_or((me, Duration::ZERO));
    let slot = |k: usize| plan.machines.get(k);
    let ranks = |k: usize| {
        slot(k).map_or_else(String::new, |m| match m.nproc {
            1 => format!("rank {}", m.rank_offset),
            n => format!("ranks {}-{}", m.rank_offset, m.rank_offset + n - 1),
        })
    };
    let host = |k: usize| slot(k).map_or_else(|| "?".to_string(), |m| m.host.clone());
    let secs = silent.as_secs_f64();
    let others = plan.machines.len().saturating_sub(1);
    let (named, mut error) = if let (true, StoreSite::Cluster(store_at)) = (first == me, site) {
        // No machine hosts the store: this machine lost the cluster.
        (
            me,
            format!(
                "machine {me} lost the etcd cluster ({store_at}): its heartbeat did not reach \
                 the store for {secs:.1}s (the cluster lost its quorum, or this machine's link \
                 is down)"
            ),
        )
    } else if first == me {
        // This machine's beat did not reach machine 0's store.
        let store_at = site;
        (
            0,
            format!(
                "machine {me} lost machine 0 (host {}, {}) and with it the others: machine 0's \
                 store at {store_at} did not answer this machine's heartbeat for {secs:.1}s \
                 (machine 0 stopped, or this machine's link is down)",
                host(0),
                ranks(0)
            ),
        )
    } else if lost.len() == others && others > 1 {
        let names: Vec<String> = lost.iter().map(|(k, _)| k.to_string()).collect();
        (
            first,
            format!(
                "machine {me} lost the others: machines {} sent no heartbeat for {secs:.1}s \
                 (this machine's link is down, or they stopped)",
                names.join(", ")
            ),
        )
    } else {
        let mut e = format!(
            "machine {first} (host {}, {}) was lost: its launcher sent no heartbeat for {secs:.1}s \
             (its link is down, or its launcher or the machine stopped)",
            host(first),
            ranks(first)
        );
        for (k, s) in lost.iter().skip(1) {
            e.push_str(&format!(
                "; machine {k} (host {}, {}) too, silent for {:.1}s",
                host(*k),
                ranks(*k),
                s.as_secs_f64()
            ));
        }
        (first, e)
    };
    if let Some(w) = witness {
        let said = w
            .error
            .clone()
            .or_else(|| w.stderr_tail.last().cloned())
            .unwrap_or_else(|| w.exit.describe());
        error.push_str(&format!(
            "\nrank {} (machine {}) noticed it: {said}",
            w.rank, w.machine
        ));
    }
    let first_rank = slot(named).map_or(0, |m| m.rank_offset);
    Failure {
        rank: first_rank,
        local_rank: 0,
        machine: named,
        host: host(named),
        pid: None,
        exit: Exit::Lost {
            silent_ms: u64::try_from(silent.as_millis()).unwrap_or(u64::MAX),
        },
        error: Some(error),
        location: None,
        stderr_tail: witness.map(|w| w.stderr_tail.clone()).unwrap_or_default(),
        also_hung: Vec::new(),
        interrupted: false,
    }
}

#[cfg(test)]
mod tests {
    use super::super::membership::MachineSlot;
    use super::*;
    use accel_rendezvous::MemoryStore;

    const T: Duration = Duration::from_secs(5);

    fn plan3() -> Plan {
        Plan {
            run_id: "run".into(),
            world_size: 6,
            max_restarts: 0,
            machines: (0..3)
                .map(|k| MachineSlot {
                    machine_rank: k,
                    host: format!("host{k}"),
                    nproc: 2,
                    rank_offset: 2 * k,
                    id: format!("m{k}"),
                })
                .collect(),
        }
    }

    #[test]
    fn a_silent_machine_is_reported_lost_and_a_beating_one_is_not() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let (tx, rx) = std::sync::mpsc::channel();
        let lost_after = Duration::from_millis(700);
        let watch = Liveness::start(
            store.clone(),
            0,
            0,
            3,
            lost_after,
            Box::new(move |lost, _| {
                let _ = tx.send(lost);
            }),
        );
        // Machine 1 beats throughout; machine 2 beats, then stops.
        let one = Liveness::start(store.clone(), 0, 1, 3, T, Box::new(|_, _| {}));
        let two = Liveness::start(store.clone(), 0, 2, 3, T, Box::new(|_, _| {}));
        std::thread::sleep(3 * BEAT);
        two.stop();
        let lost = rx.recv_timeout(Duration::from_secs(5)).expect("a loss");
        assert_eq!(lost.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![2]);
        assert!(lost[0].1 > lost_after, "{lost:?}");
        assert!(watch.reaches_store());
        assert_eq!(
            watch
                .silent(lost_after)
                .iter()
                .map(|(k, _)| *k)
                .collect::<Vec<_>>(),
            vec![2]
        );
        // Machine 0 still beats after reporting the loss.
        assert!(one.silent(lost_after).iter().all(|(k, _)| *k == 2));
        one.stop();
        watch.stop();
    }

    #[test]
    fn a_lost_machine_is_named_with_its_ranks_and_the_witness() {
        let plan = plan3();
        let witness = Failure {
            rank: 1,
            local_rank: 1,
            machine: 0,
            host: "host0".into(),
            pid: Some(9),
            exit: crate::report::Exit::Code { code: 1 },
            error: None,
            location: None,
            stderr_tail: vec!["all_reduce: timed out; missing ranks: 4, 5".into()],
            also_hung: vec![],
            interrupted: false,
        };
        assert!(witness.speaks_of_a_peer());
        let lost = vec![(2, Duration::from_millis(3100))];
        let f = lost_failure(
            &plan,
            0,
            &lost,
            &StoreSite::Machine0("10.0.0.1:1".into()),
            Some(&witness),
        );
        assert_eq!((f.machine, f.rank, f.host.as_str()), (2, 4, "host2"));
        assert!(matches!(f.exit, Exit::Lost { silent_ms: 3100 }));
        let e = f.error.unwrap();
        assert!(e.starts_with("machine 2 (host host2, ranks 4-5) was lost: its launcher sent no heartbeat for 3.1s"), "{e}");
        assert!(
            e.contains("rank 1 (machine 0) noticed it: all_reduce: timed out"),
            "{e}"
        );
        // Cut off from machine 0's store: machine 0 is named, and the others.
        let f = lost_failure(
            &plan,
            2,
            &vec![(2, Duration::from_secs(5))],
            &StoreSite::Machine0("10.0.0.1:1".into()),
            None,
        );
        assert_eq!((f.machine, f.rank), (0, 0));
        assert!(f.error.unwrap().starts_with(
            "machine 2 lost machine 0 (host host0, ranks 0-1) and with it the others"
        ));
        // Cut off from an etcd cluster: no machine hosts it, so this one is named.
        let at = StoreSite::Cluster("etcd://10.0.0.9:2379/run".into());
        let f = lost_failure(&plan, 2, &vec![(2, Duration::from_secs(5))], &at, None);
        assert_eq!((f.machine, f.rank), (2, 4));
        assert!(f
            .error
            .unwrap()
            .starts_with("machine 2 lost the etcd cluster (etcd://10.0.0.9:2379/run)"));
        // Machine 0 hearing from nobody.
        let all = vec![(1, Duration::from_secs(5)), (2, Duration::from_secs(5))];
        let f = lost_failure(
            &plan,
            0,
            &all,
            &StoreSite::Machine0("10.0.0.1:1".into()),
            None,
        );
        assert!(f
            .error
            .unwrap()
            .starts_with("machine 0 lost the others: machines 1, 2"));
    }
}
