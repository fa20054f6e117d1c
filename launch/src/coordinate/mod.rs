//! Coordinators: where an attempt's store is and how the attempt went
//! across machines ([`Coordinator`], the restart loop's side of torch
//! elastic's `RendezvousHandler`), one file per implementation:
//!
//! * [`HostedStore`] (`hosted.rs`): one machine (or one mpirun started from
//!   machine 0): this launcher hosts the store, a fresh one per attempt;
//! * [`Machines`] (`machines.rs`): several machines' launchers, machine 0
//!   hosting the store for the whole run, every attempt starting with the
//!   machines' join, fixed or elastic (`--num-machines MIN:MAX`); or, on
//!   an etcd cluster (`etcd.rs`), no machine hosting anything, each round
//!   electing its machine 0.
//!
//! What [`Machines`] agrees on with the other machines, one file per
//! protocol: the join and the attempt's outcome (`membership.rs`: who is
//! in, each machine's first rank, the first root cause, the result of every
//! machine), the heartbeats and a lost machine (`liveness.rs`), and
//! elastic rounds (`elastic.rs`; docs/adr/0026-elastic-membership.md). All
//! of it goes through the run's store, so several coordinators can run in
//! one process (the conformance harness runs two "machines" on loopback).

mod elastic;
mod etcd;
mod hosted;
mod liveness;
mod machines;
mod membership;

use std::sync::mpsc::Sender;
use std::sync::Arc;

use accel_api::Result;

pub use etcd::EtcdRendezvous;
pub use hosted::HostedStore;
pub use machines::{Machines, MachinesConfig};

use crate::event::Event;
use crate::group::Attempt;
use crate::report::{self, Failure, Status};
use crate::supervise::LocalOutcome;

/// How an attempt went across machines.
#[derive(Debug, Clone)]
pub struct Settled {
    /// Outcome.
    pub status: Status,
    /// What failed first, anywhere.
    pub root: Option<Failure>,
    /// The launcher's exit code if the run ends here.
    pub code: u8,
    /// What interrupted it (a signal's name, another machine's launcher).
    pub interrupted_by: Option<String>,
    /// A failed attempt may be restarted (false when the store is lost).
    pub restartable: bool,
}

impl Settled {
    /// The outcome on one machine (no one to agree with).
    pub fn alone(local: LocalOutcome) -> Settled {
        let failed = |root: Option<Box<Failure>>, code: u8, why: Option<String>| Settled {
            status: Status::Failed,
            root: root.map(|b| *b),
            code,
            interrupted_by: why,
            restartable: true,
        };
        match local {
            LocalOutcome::Succeeded => Settled {
                status: Status::Succeeded,
                root: None,
                code: 0,
                interrupted_by: None,
                restartable: false,
            },
            LocalOutcome::Failed { root, code, exit } => {
                let why = root
                    .is_none()
                    .then(|| format!("process {}", exit.describe()));
                failed(root, code, why)
            }
            LocalOutcome::Interrupted(sig) => Settled {
                status: Status::Interrupted,
                root: None,
                code: u8::try_from(128 + sig).unwrap_or(1),
                interrupted_by: Some(report::signal_name(sig)),
                restartable: false,
            },
            LocalOutcome::WallLimit(d) => failed(None, 124, Some(format!("wall limit of {d:?}"))),
            LocalOutcome::Remote(f) => {
                let code = f.exit.launcher_code();
                failed(Some(f), code, None)
            }
            LocalOutcome::StoreLost(m) => Settled {
                restartable: false,
                ..failed(None, 1, Some(format!("lost store: {m}")))
            },
        }
    }
}

/// What the restart loop asks of the machines' coordination.
pub trait Coordinator {
    /// Prepare attempt `n`: host or join the store, agree with the other
    /// machines; `tx` receives remote failures.
    ///
    /// # Errors
    /// The store cannot be hosted or reached, the machines do not agree.
    fn begin(&mut self, n: u32, tx: &Sender<Event>) -> Result<Attempt>;

    /// A local root cause, as soon as it is known.
    fn publish(&self, _n: u32, _failure: &Failure) {}

    /// The attempt ended on this machine: how did it go everywhere?
    fn settle(&mut self, n: u32, attempt: &Attempt, local: LocalOutcome) -> Settled {
        let _ = (n, attempt);
        Settled::alone(local)
    }

    /// Restarts allowed.
    fn max_restarts(&self) -> u32;

    /// The run ended after attempt `last`.
    fn end(&mut self, _last: u32) {}

    /// Where the store of the last attempt listened (for `--json`).
    fn store_url(&self) -> String;

    /// The stall inspector's verdict for `attempt` (`accel_api::worker::stall`), when
    /// this coordinator can read the store and a rank that timed out wrote
    /// one. The default reads nothing.
    fn stall(&self, attempt: &Attempt) -> Option<report::Stall> {
        let _ = attempt;
        None
    }

    /// Where global `rank` runs when it runs on another machine of this
    /// attempt: its local rank, machine and host. The default (one
    /// machine) knows no other machine.
    fn place(&self, rank: usize) -> Option<(usize, usize, String)> {
        let _ = rank;
        None
    }
}

/// This machine's host name.
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into())
}

/// The stall inspector's verdict for `attempt` in the run's `store` (the
/// store root, as the launcher sees it), under the key the workers'
/// `Accelerator` uses for this run and attempt.
pub fn read_stall(store: Arc<dyn accel_api::Store>, attempt: &Attempt) -> Option<report::Stall> {
    let run_id = attempt.env.run_id.as_deref().unwrap_or("default");
    let store = accel_rendezvous::PrefixStore::new(
        store,
        accel_api::worker::stall::store_prefix(run_id, attempt.number),
    );
    // Fresh at the moment of the report, not as of the first timeout.
    let v = accel_api::worker::stall::StallVerdict::read_fresh(&store)?;
    Some(report::Stall {
        seen_by: v.seen_by,
        waiting_in: v.waiting_in,
        missing: v.missing.into_iter().map(|m| (m.rank, m.last)).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Exit;
    use std::time::Duration;

    #[test]
    fn one_machine_outcomes() {
        let s = Settled::alone(LocalOutcome::Interrupted(15));
        assert_eq!((s.code, s.restartable), (143, false));
        let s = Settled::alone(LocalOutcome::WallLimit(Duration::from_secs(1)));
        assert_eq!((s.code, s.restartable), (124, true));
        let s = Settled::alone(LocalOutcome::Failed {
            root: None,
            code: 7,
            exit: Exit::Code { code: 7 },
        });
        assert_eq!(s.code, 7);
        assert!(s.interrupted_by.unwrap().contains("code 7"));
    }
}
