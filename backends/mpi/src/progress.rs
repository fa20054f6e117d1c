//! Progress records: how a world communicator's ranks learn, while they
//! wait in a collective, that a peer ended early or is frozen.
//!
//! MPI tells a waiting rank nothing about a peer that returned or exited
//! mid-job: the peer sits in `MPI_Finalize` (which waits for every rank)
//! and the others wait in their collective until its timeout. So each rank
//! keeps a record in the run's store, `mpi/<n>/progress/<rank>` =
//! `<collectives entered> <ended: 0 no, 1 communicator dropped, 2 process
//! exited> <beat>`:
//!
//! * the count is two atomic operations per collective (every rank makes
//!   the same collectives in the same order, so the counts are comparable);
//! * a process-wide thread writes every live record each [`BEAT`] (the beat
//!   counter advances, so a frozen process shows as a beat that stops);
//! * a rank that ends marks itself ended: when its communicator is dropped
//!   (1) and at process exit, before `MPI_Finalize` (2).
//!
//! A waiting rank reads its peers' records (non-blocking path: between
//! polls; blocking path: the watchdog): a peer that ended having entered
//! fewer collectives than the one waited in will never come. The
//! non-blocking path returns `PeerLost` naming it (a process that exited
//! also makes this one end the MPI job at its own exit: `ffi`), the
//! blocking path ends the job ([`early_exit_message`]). At a timeout the
//! records name the ranks that had not entered the collective, or whose
//! beat stopped, instead of the rank that waited (a victim).
//!
//! Under a launcher without a shared store (bare `mpirun`: each process has
//! its own in-memory store) nothing is seen and the timeouts apply.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use accel_api::Store;

use crate::registry::Registry;

/// How often every record is written (and its beat advanced).
pub(crate) const BEAT: Duration = Duration::from_millis(250);

/// What a peer's record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) entered: u64,
    /// 0: running; [`DROPPED`]; [`EXITED`].
    pub(crate) ended: u8,
    pub(crate) beat: u64,
}

/// A record's state: the rank dropped this communicator.
pub(crate) const DROPPED: u8 = 1;
/// A record's state: the rank's process exited.
pub(crate) const EXITED: u8 = 2;

fn parse(v: &[u8]) -> Option<Record> {
    let s = std::str::from_utf8(v).ok()?;
    let mut w = s.split_whitespace();
    Some(Record {
        entered: w.next()?.parse().ok()?,
        ended: w.next()?.parse().ok()?,
        beat: w.next()?.parse().ok()?,
    })
}

/// The progress record of one rank of a world communicator.
pub(crate) struct Progress {
    store: Arc<dyn Store>,
    prefix: String,
    rank: usize,
    size: usize,
    entered: AtomicU64,
    ended: AtomicU8,
    beat: AtomicU64,
    /// Serialises writes (the thread's and an exit's).
    write: Mutex<()>,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entered = self.entered.load(Ordering::Relaxed);
        write!(
            f,
            "Progress({} rank {} of {}, {entered} calls entered)",
            self.prefix, self.rank, self.size
        )
    }
}

impl Progress {
    /// The record of `rank` of `size` under `prefix` in `store`, written
    /// from now on by the process's progress thread.
    pub(crate) fn start(
        store: Arc<dyn Store>,
        prefix: String,
        rank: usize,
        size: usize,
    ) -> Arc<Progress> {
        let p = Arc::new(Progress {
            store,
            prefix,
            rank,
            size,
            entered: AtomicU64::new(0),
            ended: AtomicU8::new(0),
            beat: AtomicU64::new(0),
            write: Mutex::new(()),
        });
        p.publish();
        // Without the thread, records are written at enter and end only.
        let _ = registry().add(&p, "accel-mpi-progress", write_records);
        p
    }

    fn key(&self, rank: usize) -> String {
        format!("{}/progress/{rank}", self.prefix)
    }

    /// Count a collective entered; its index (0 for the first).
    pub(crate) fn enter(&self) -> u64 {
        self.entered.fetch_add(1, Ordering::SeqCst)
    }

    /// Write this rank's record (best effort).
    fn publish(&self) {
        let _g = self.write.lock().unwrap_or_else(|p| p.into_inner());
        let beat = self.beat.fetch_add(1, Ordering::Relaxed);
        let rec = format!(
            "{} {} {beat}",
            self.entered.load(Ordering::SeqCst),
            self.ended.load(Ordering::SeqCst)
        );
        let _ = self.store.set(&self.key(self.rank), rec.as_bytes());
    }

    /// Mark this rank as ended ([`DROPPED`] or [`EXITED`]): it enters no
    /// more collectives.
    pub(crate) fn end(&self, how: u8) {
        if self.ended.fetch_max(how, Ordering::SeqCst) < how {
            self.publish();
        }
    }

    /// Every peer's record that can be read (rank, record).
    fn peers(&self) -> Vec<(usize, Record)> {
        (0..self.size)
            .filter(|&r| r != self.rank)
            .filter_map(|r| {
                let v = self.store.try_get(&self.key(r)).ok()??;
                Some((r, parse(&v)?))
            })
            .collect()
    }

    /// A peer that ended before entering collective `index`: (rank, its
    /// record). It will never come.
    pub(crate) fn left_before(&self, index: u64) -> Option<(usize, Record)> {
        self.peers()
            .into_iter()
            .find(|(_, rec)| rec.ended != 0 && rec.entered <= index)
    }

    /// Who holds up collective `index` after its timeout: the peers that
    /// ended or had not entered it, or else those whose record stopped
    /// beating (frozen processes) over `2 * BEAT`, as `rank (why)`; empty
    /// when the records say nothing (no shared store).
    pub(crate) fn culprits(&self, index: u64) -> Vec<(usize, String)> {
        let first = self.peers();
        let behind: Vec<(usize, String)> = first
            .iter()
            .filter(|(_, rec)| rec.entered <= index)
            .map(|(r, rec)| {
                let what = match rec.ended {
                    0 => "is elsewhere",
                    DROPPED => "dropped its communicator",
                    _ => "exited",
                };
                (
                    *r,
                    format!(
                        "{what} after {} collective(s), not in this one (#{index})",
                        rec.entered
                    ),
                )
            })
            .collect();
        if !behind.is_empty() || first.is_empty() {
            return behind;
        }
        std::thread::sleep(BEAT * 2 + Duration::from_millis(100));
        let second = self.peers();
        first
            .iter()
            .filter(|(r, rec)| {
                second
                    .iter()
                    .any(|(r2, rec2)| r2 == r && rec2.beat == rec.beat && rec2.ended == 0)
            })
            .map(|(r, _)| {
                (
                    *r,
                    format!(
                        "entered this collective (#{index}) but its process stopped responding (frozen)"
                    ),
                )
            })
            .collect()
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.end(DROPPED);
    }
}

/// What a collective that waits for a rank that ended early reports.
pub(crate) fn early_exit_message(op: &str, index: u64, peer: usize, rec: Record) -> String {
    let how = if rec.ended == EXITED {
        format!("rank {peer} exited early: its process ended (returned or exited)")
    } else {
        format!("rank {peer} left early: it dropped this communicator")
    };
    format!(
        "{how} after {} collective(s), while this rank waits in collective #{index} ({op}); a rank that ends while the others still call collectives fails the job, whatever its exit code",
        rec.entered
    )
}

/// Every live record of the process; its thread writes them.
fn registry() -> &'static Registry<Progress> {
    static REGISTRY: Registry<Progress> = Registry::new();
    &REGISTRY
}

/// Write every live record that has not ended, each [`BEAT`], forever.
fn write_records() {
    loop {
        std::thread::sleep(BEAT);
        for p in registry().live() {
            if p.ended.load(Ordering::SeqCst) == 0 {
                p.publish();
            }
        }
    }
}

/// Mark every live record of the process as [`EXITED`]: the process is
/// exiting (called before `MPI_Finalize` at exit).
pub(crate) fn exit_all() {
    for p in registry().live() {
        p.end(EXITED);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_show_who_left_and_who_is_behind() {
        let store: Arc<dyn Store> = Arc::new(accel_rendezvous::MemoryStore::new());
        let a = Progress::start(store.clone(), "t".into(), 0, 3);
        let b = Progress::start(store.clone(), "t".into(), 1, 3);
        let c = Progress::start(store.clone(), "t".into(), 2, 3);
        for _ in 0..4 {
            a.enter();
            b.enter();
        }
        c.enter();
        c.publish();
        b.publish();
        // Rank 0 waits in collective #3 (its fourth): rank 1 is in it too,
        // rank 2 entered only one.
        assert_eq!(a.left_before(3), None);
        let culprits = a.culprits(3);
        assert_eq!(culprits.len(), 1, "{culprits:?}");
        assert_eq!(culprits[0].0, 2);
        assert!(
            culprits[0].1.contains("after 1 collective(s)"),
            "{culprits:?}"
        );
        c.end(EXITED);
        let (r, rec) = a.left_before(3).expect("rank 2 left");
        assert_eq!((r, rec.entered, rec.ended), (2, 1, EXITED));
        assert!(early_exit_message("all_reduce", 3, r, rec).starts_with("rank 2 exited early"));
        // A rank that left after entering the waited collective is not blamed.
        b.end(DROPPED);
        assert_eq!(a.left_before(0), None);
    }
}
