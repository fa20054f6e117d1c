//! The flight recorder: per communicator, a fixed ring of the last N calls
//! (sequence number, operation, element type and count, root or peer,
//! reduction, issue / start / end times, state), written without
//! allocating on the call path and read when something goes wrong (a
//! timeout, a mismatch, a lost peer, a signal) to say what every rank was
//! doing. On by default: `ACCEL_FLIGHT_RECORDER=N` sets the ring's size
//! (default [`DEFAULT_RING`]), `0` turns it off.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::lock;
use crate::{CallInfo, DType, Op, ReduceOp};

/// The variable that sizes every communicator's ring (`0`: off).
pub const FLIGHT_RECORDER_ENV: &str = "ACCEL_FLIGHT_RECORDER";

/// Entries per ring unless `ACCEL_FLIGHT_RECORDER` says otherwise.
pub const DEFAULT_RING: usize = 2000;

/// Where a recorded call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallState {
    /// Admitted, waiting for the calls issued before it.
    Issued,
    /// The engine (or the call check) is running it.
    Started,
    /// Finished without error.
    Completed,
    /// Finished with an error.
    Failed,
}

/// One call as the ring keeps it (plain data, no allocation).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CallRecord {
    /// Issue order among every call of the communicator.
    pub ticket: u64,
    /// The collective's sequence number (`None` for point-to-point calls),
    /// the same on every rank for the same collective.
    pub seq: Option<u64>,
    /// The operation.
    pub op: Op,
    /// Element type.
    pub dtype: DType,
    /// Elements this rank contributes.
    pub count: u64,
    /// Root of a rooted call.
    pub root: Option<u32>,
    /// Peer of a point-to-point call.
    pub peer: Option<u32>,
    /// Reduction of a reducing call.
    pub reduce: Option<ReduceOp>,
    /// Started without waiting (a handle), not blocking.
    pub started_async: bool,
    /// When it was issued, started and ended: microseconds since the Unix
    /// epoch (0: not yet).
    pub issued_us: u64,
    /// See `issued_us`.
    pub started_us: u64,
    /// See `issued_us`.
    pub ended_us: u64,
    /// Where it is.
    pub state: CallState,
}

/// Who a ring belongs to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GroupIdentity {
    /// The backend's registered name.
    pub backend: String,
    /// This rank in the group.
    pub rank: usize,
    /// Ranks in the group.
    pub world_size: usize,
    /// `world`, or the path of splits that made it (`world/split0:c1`).
    pub name: String,
}

/// One communicator's ring.
#[derive(Debug)]
pub struct FlightRecorder {
    identity: GroupIdentity,
    ring: Mutex<Ring>,
}

#[derive(Debug)]
struct Ring {
    slots: Vec<Option<CallRecord>>,
}

/// Microseconds since the Unix epoch, from one anchor per process and a
/// monotonic clock (so that a process's times never go backwards).
fn now_us() -> u64 {
    static ANCHOR: OnceLock<(Instant, u64)> = OnceLock::new();
    let (t0, wall) = *ANCHOR.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        (Instant::now(), wall)
    });
    wall + t0.elapsed().as_micros() as u64
}

/// Every live ring of this process (what a dump writes).
fn registry() -> &'static Mutex<Vec<Weak<FlightRecorder>>> {
    static R: OnceLock<Mutex<Vec<Weak<FlightRecorder>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Vec::new()))
}

/// The ring size `ACCEL_FLIGHT_RECORDER` asks for (`0`: off); a malformed
/// value keeps the default (the environment check reports it).
pub fn ring_size_from_env() -> usize {
    match std::env::var(FLIGHT_RECORDER_ENV) {
        Ok(v) => v.trim().parse().unwrap_or(DEFAULT_RING),
        Err(_) => DEFAULT_RING,
    }
}

/// Every live flight recorder of this process, oldest first.
pub fn flight_recorders() -> Vec<Arc<FlightRecorder>> {
    let mut r = lock(registry());
    r.retain(|w| w.strong_count() > 0);
    r.iter().filter_map(Weak::upgrade).collect()
}

impl FlightRecorder {
    /// A ring of `size` entries for `identity`, registered for dumps;
    /// `None` when `size` is 0.
    pub fn new(identity: GroupIdentity, size: usize) -> Option<Arc<FlightRecorder>> {
        if size == 0 {
            return None;
        }
        let r = Arc::new(FlightRecorder {
            identity,
            ring: Mutex::new(Ring {
                slots: vec![None; size],
            }),
        });
        lock(registry()).push(Arc::downgrade(&r));
        Some(r)
    }

    /// Who this ring belongs to.
    pub fn identity(&self) -> &GroupIdentity {
        &self.identity
    }

    /// Record call `ticket` (collective number `seq`) as issued.
    pub(crate) fn issued(
        &self,
        ticket: u64,
        seq: Option<u64>,
        call: &CallInfo,
        started_async: bool,
    ) {
        let rec = CallRecord {
            ticket,
            seq,
            op: call.op,
            dtype: call.dtype,
            count: call.len as u64,
            root: call.root.map(|r| r as u32),
            peer: call.peer.map(|p| p as u32),
            reduce: call.reduce,
            started_async,
            issued_us: now_us(),
            started_us: 0,
            ended_us: 0,
            state: CallState::Issued,
        };
        let mut ring = lock(&self.ring);
        let n = ring.slots.len();
        ring.slots[(ticket % n as u64) as usize] = Some(rec);
    }

    /// Move call `ticket` to `state` (`Started`, `Completed`, `Failed`),
    /// stamping the time; nothing when the ring has moved past it.
    pub(crate) fn set(&self, ticket: u64, state: CallState) {
        let t = now_us();
        let mut ring = lock(&self.ring);
        let n = ring.slots.len();
        if let Some(rec) = ring.slots[(ticket % n as u64) as usize].as_mut() {
            if rec.ticket == ticket {
                rec.state = state;
                match state {
                    CallState::Started => rec.started_us = t,
                    CallState::Completed | CallState::Failed => rec.ended_us = t,
                    CallState::Issued => {}
                }
            }
        }
    }

    /// The ring's calls, oldest first.
    pub fn snapshot(&self) -> Vec<CallRecord> {
        let ring = lock(&self.ring);
        let mut v: Vec<CallRecord> = ring.slots.iter().flatten().copied().collect();
        v.sort_by_key(|r| r.ticket);
        v
    }

    /// The newest call in `state`, if any.
    pub fn last_in(&self, state: CallState) -> Option<CallRecord> {
        self.snapshot().into_iter().rev().find(|r| r.state == state)
    }
}
