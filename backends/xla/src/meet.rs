//! Where the rank threads of one group meet: [`Meet`].
//!
//! Every collective call is a *round*. Each rank thread deposits its
//! contribution for round `k` (its `k`-th call on the group); the last one
//! to arrive runs the round's work (one XLA execution over all devices)
//! without holding the lock, posts one outcome per rank, and each rank takes
//! its own. The next round opens once every rank took its outcome. Every
//! wait is bounded by the caller's deadline: a rank that never arrives makes
//! the others fail with a timeout naming it and the operation, and the
//! meeting is then *broken* so that later calls fail at once.
//!
//! Point-to-point messages go through a mailbox keyed by
//! `(source, destination, tag)`, in order per key.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use accel_api::{DType, ReduceOp};

use crate::error::XlaError;
use accel_api::sync::lock;

/// What a call is, as every rank must agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallKey {
    /// The operation's name (`all_reduce`, `connect`).
    pub(crate) op: &'static str,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
    pub(crate) root: Option<usize>,
    pub(crate) reduce: Option<ReduceOp>,
}

impl CallKey {
    /// A call without data (barrier, split, connect).
    pub(crate) fn control(op: &'static str) -> CallKey {
        CallKey {
            op,
            dtype: DType::U8,
            len: 0,
            root: None,
            reduce: None,
        }
    }

    fn describe(&self) -> String {
        let mut s = format!("{} of {} {}", self.op, self.len, self.dtype);
        if let Some(r) = self.reduce {
            s.push_str(&format!(" ({r})"));
        }
        if let Some(r) = self.root {
            s.push_str(&format!(" root {r}"));
        }
        s
    }
}

/// One rank's contribution to a round.
#[derive(Debug)]
pub(crate) struct Deposit {
    pub(crate) key: CallKey,
    pub(crate) data: Vec<u8>,
    /// `(color, key)` for a split.
    pub(crate) split: Option<(Option<u32>, u32)>,
}

/// What one rank takes from a round.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Nothing (barrier, connect).
    Done,
    /// The rank's output tensor.
    Bytes(Vec<u8>),
    /// A split: the sub-group's meeting and this rank's rank in it, or
    /// `None` when the rank opted out.
    Sub(Option<(Arc<Meet>, usize)>),
}

#[derive(Debug, Default)]
struct Round {
    /// The round now open.
    number: u64,
    deposits: Vec<Option<Deposit>>,
    arrived: Vec<bool>,
    /// Set once the round's work is done (an error is shared by all).
    outcomes: Option<Result<Vec<Option<Outcome>>, XlaError>>,
    taken: usize,
    /// The first failure that broke the meeting.
    broken: Option<XlaError>,
}

type Mailbox = HashMap<(usize, usize, u32), VecDeque<(DType, Vec<u8>)>>;

/// The meeting point of the `size` rank threads of one group.
#[derive(Debug)]
pub(crate) struct Meet {
    /// Names the group in logs and sub-group names.
    pub(crate) name: String,
    pub(crate) size: usize,
    round: Mutex<Round>,
    turn: Condvar,
    mailbox: Mutex<Mailbox>,
    mail: Condvar,
}

/// What a round's work returns: one outcome per rank.
pub(crate) type Work<'a> =
    Box<dyn FnOnce(Vec<Deposit>) -> Result<Vec<Option<Outcome>>, XlaError> + 'a>;

impl Meet {
    pub(crate) fn new(name: String, size: usize) -> Arc<Meet> {
        Arc::new(Meet {
            name,
            size,
            round: Mutex::new(Round {
                deposits: (0..size).map(|_| None).collect(),
                arrived: vec![false; size],
                ..Round::default()
            }),
            turn: Condvar::new(),
            mailbox: Mutex::new(HashMap::new()),
            mail: Condvar::new(),
        })
    }

    /// Break the meeting (first reason wins): every waiting and later call
    /// fails with it.
    pub(crate) fn break_with(&self, err: XlaError) {
        let mut r = lock(&self.round);
        if r.broken.is_none() {
            r.broken = Some(err);
        }
        drop(r);
        self.turn.notify_all();
        // Take the mailbox lock so that no receiver misses the wake-up
        // between its check and its wait.
        drop(lock(&self.mailbox));
        self.mail.notify_all();
    }

    fn broken_error(&self, me: usize) -> Option<XlaError> {
        lock(&self.round).broken.clone().map(|b| seen_by(b, me))
    }

    /// Join round `number` as `rank` with `deposit`; the last rank to
    /// arrive runs `work` over every deposit (in rank order).
    ///
    /// # Errors
    /// [`XlaError::Timeout`] naming the ranks that did not arrive by
    /// `deadline`; [`XlaError::Mismatch`] when the ranks' calls differ; the
    /// work's error (on every rank); the error that broke the meeting.
    pub(crate) fn round(
        &self,
        rank: usize,
        number: u64,
        deposit: Deposit,
        timeout: Duration,
        work: Work<'_>,
    ) -> Result<Outcome, XlaError> {
        let deadline = Instant::now() + timeout;
        let key = deposit.key;
        let mut r = lock(&self.round);
        // Wait for the previous round to drain.
        while r.number != number {
            if let Some(b) = r.broken.clone() {
                return Err(seen_by(b, rank));
            }
            if r.number > number {
                return Err(XlaError::Broken(format!(
                    "rank {rank} joined round {number} after round {} opened",
                    r.number
                )));
            }
            r = self.wait(r, deadline, || XlaError::Timeout {
                after: timeout,
                what: format!(
                    "{}: the other ranks did not finish their previous call in time",
                    key.op
                ),
            })?;
        }
        if let Some(b) = r.broken.clone() {
            return Err(seen_by(b, rank));
        }
        if let Some(other) = r.deposits.iter().flatten().next() {
            if other.key != key {
                let err = XlaError::Mismatch(format!(
                    "rank {rank} called {}, another rank {} in the same position",
                    key.describe(),
                    other.key.describe()
                ));
                drop(r);
                self.break_with(err.clone());
                return Err(err);
            }
        }
        r.deposits[rank] = Some(deposit);
        r.arrived[rank] = true;
        if r.arrived.iter().all(|&a| a) {
            let deposits: Vec<Deposit> = r.deposits.iter_mut().filter_map(Option::take).collect();
            drop(r);
            let done = work(deposits);
            r = lock(&self.round);
            r.outcomes = Some(done);
            self.turn.notify_all();
        }
        // Wait for the work to be done.
        while r.outcomes.is_none() {
            if let Some(b) = r.broken.clone() {
                return Err(seen_by(b, rank));
            }
            let missing: Vec<usize> = (0..self.size).filter(|&i| !r.arrived[i]).collect();
            let size = self.size;
            let name = &self.name;
            let timed_out = || XlaError::Timeout {
                after: timeout,
                what: if missing.is_empty() {
                    format!("{}: the program did not finish within {timeout:?}", key.op)
                } else {
                    format!(
                        "{}: rank(s) {} of {size} did not join within {timeout:?} (group {name})",
                        key.op,
                        join(&missing)
                    )
                },
            };
            r = match self.wait(r, deadline, timed_out) {
                Ok(r) => r,
                Err(e) => {
                    self.break_with(e.clone());
                    return Err(e);
                }
            };
        }
        let outcome = match r.outcomes.as_mut() {
            Some(Ok(v)) => Ok(v[rank].take().unwrap_or(Outcome::Done)),
            Some(Err(e)) => Err(e.clone()),
            None => Err(XlaError::Broken("round without outcome".into())),
        };
        r.taken += 1;
        if r.taken == self.size {
            r.number += 1;
            r.taken = 0;
            r.outcomes = None;
            r.arrived.iter_mut().for_each(|a| *a = false);
            self.turn.notify_all();
        }
        outcome
    }

    fn wait<'a>(
        &self,
        r: MutexGuard<'a, Round>,
        deadline: Instant,
        timed_out: impl FnOnce() -> XlaError,
    ) -> Result<MutexGuard<'a, Round>, XlaError> {
        let now = Instant::now();
        if now >= deadline {
            return Err(timed_out());
        }
        Ok(self
            .turn
            .wait_timeout(r, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0)
    }

    /// Post a message from `src` to `dst`.
    pub(crate) fn send(&self, src: usize, dst: usize, tag: u32, dtype: DType, data: Vec<u8>) {
        lock(&self.mailbox)
            .entry((src, dst, tag))
            .or_default()
            .push_back((dtype, data));
        self.mail.notify_all();
    }

    /// Take the next message from `src` to `dst` with `tag`, waiting at
    /// most `timeout`; `dtype` and `bytes` are what the receive buffer
    /// holds.
    ///
    /// # Errors
    /// [`XlaError::Timeout`] when no message came; [`XlaError::Argument`]
    /// for a message of another size or type (dropped).
    pub(crate) fn recv(
        &self,
        src: usize,
        dst: usize,
        tag: u32,
        dtype: DType,
        bytes: usize,
        timeout: Duration,
    ) -> Result<Vec<u8>, XlaError> {
        let deadline = Instant::now() + timeout;
        let mut mb = lock(&self.mailbox);
        loop {
            if let Some((t, data)) = mb.get_mut(&(src, dst, tag)).and_then(VecDeque::pop_front) {
                if t != dtype || data.len() != bytes {
                    return Err(XlaError::Argument(format!(
                        "rank {src} sent {} {t} elements with tag {tag}, the receive buffer holds {} {dtype} elements (the message was dropped)",
                        data.len() / t.size(),
                        bytes / dtype.size()
                    )));
                }
                return Ok(data);
            }
            if let Some(b) = self.broken_error(dst) {
                return Err(b);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(XlaError::Timeout {
                    after: timeout,
                    what: format!(
                        "recv: no message from rank {src} with tag {tag} within {timeout:?}"
                    ),
                });
            }
            mb = self
                .mail
                .wait_timeout(mb, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

fn join(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Meetings being joined, by the token rank 0 published in the store.
fn pending() -> &'static Mutex<HashMap<String, Arc<Meet>>> {
    static PENDING: OnceLock<Mutex<HashMap<String, Arc<Meet>>>> = OnceLock::new();
    PENDING.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A token unique to this process and call: `<pid>:<counter>`.
pub(crate) fn new_token() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}:{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The process id a token names.
pub(crate) fn token_pid(token: &str) -> Option<u32> {
    token.split(':').next()?.parse().ok()
}

/// Rank 0: open the meeting named `token` for `size` ranks.
pub(crate) fn open(token: &str, size: usize) -> Arc<Meet> {
    let m = Meet::new(format!("xla/{token}"), size);
    lock(pending()).insert(token.to_string(), m.clone());
    m
}

/// Other ranks: the meeting rank 0 opened under `token`, if it is in this
/// process.
pub(crate) fn find(token: &str) -> Option<Arc<Meet>> {
    lock(pending()).get(token).cloned()
}

/// Forget `token` once every rank has joined (or joining failed).
pub(crate) fn close(token: &str) {
    lock(pending()).remove(token);
}

/// The error that broke a meeting as rank `me` sees it: a failure of `me`
/// itself (its abort, or its own failure reported to the others) is not a
/// lost peer on `me`, which would name itself.
fn seen_by(b: XlaError, me: usize) -> XlaError {
    match b {
        XlaError::PeerFailed { rank, why } if rank == me => XlaError::Aborted(why),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_never_sees_itself_as_the_lost_peer() {
        let b = XlaError::PeerFailed {
            rank: 1,
            why: "aborted: rank 1 failed: boom".into(),
        };
        assert!(matches!(
            seen_by(b.clone(), 0),
            XlaError::PeerFailed { rank: 1, .. }
        ));
        match seen_by(b, 1) {
            XlaError::Aborted(why) => assert!(why.contains("boom"), "{why}"),
            other => panic!("rank 1 saw {other:?}"),
        }
        let e = accel_api::Error::from(XlaError::Aborted("aborted: x".into()));
        assert_eq!(e.kind(), &accel_api::ErrorKind::Aborted);
    }
}
