//! The machines' coordination on an etcd cluster (`accel launch
//! --rdzv-backend etcd`): the store lives outside the machines, so no
//! machine is special. Each attempt is a round (as in an elastic run,
//! `elastic.rs`) whose host is elected in etcd: the first machine to claim
//! `a{n}/leader` hosts round `n`'s join and is machine 0 of that round (so
//! rank 0 is always a live process); the others join it. When the leader of
//! a round dies, the next round elects another.

use std::sync::Arc;
use std::time::Duration;

use accel_api::{CasOutcome, Error, ErrorKind, Result, Store};
use accel_rendezvous::{EtcdAuth, EtcdStore};

use super::elastic::{self, done_key, Bounds};
use super::membership::{key, Plan, Registration};

/// Where the run's etcd cluster is and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdRendezvous {
    /// The members' client endpoints (`host:port`).
    pub endpoints: Vec<String>,
    /// TLS and authentication.
    pub auth: EtcdAuth,
}

impl EtcdRendezvous {
    /// The namespace of run `run_id`'s keys.
    pub fn namespace(run_id: &str) -> String {
        format!("accel/{run_id}")
    }

    /// The store URL the workers of run `run_id` open.
    pub fn url(&self, run_id: &str) -> String {
        format!(
            "etcd://{}/{}",
            self.endpoints.join(","),
            Self::namespace(run_id)
        )
    }

    /// Connect for run `run_id` within `join`: the coordination's store
    /// (calls bounded by `call`, the workers' timeout) and the heartbeats'
    /// own (bounded by `beat`).
    ///
    /// # Errors
    /// The cluster cannot be reached in time; the run id was used by a run
    /// that ended (naming how to pick another).
    pub fn connect(
        &self,
        run_id: &str,
        (join, call, beat): (Duration, Duration, Duration),
    ) -> Result<(Arc<dyn Store>, Arc<dyn Store>)> {
        let ns = Self::namespace(run_id);
        let at = |e: Error| e.with_op("machine join");
        let store = EtcdStore::connect(&self.endpoints, &ns, &self.auth, join)
            .map_err(at)?
            .with_call_timeout(call);
        if let Some(why) = store.try_get(&done_key()).map_err(at)? {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "run `{run_id}` already ended on the etcd cluster at {} ({})",
                    self.endpoints.join(","),
                    String::from_utf8_lossy(&why).trim()
                ),
            )
            .with_op("machine join")
            .with_fix(format!(
                "give each run its own --rdzv-id, or remove the old run's keys with \
                 `etcdctl del --prefix {ns}/`"
            )));
        }
        let beat = store.sibling(beat);
        Ok((Arc::new(store), Arc::new(beat)))
    }
}

/// Join round `from` on an etcd store: host it when this machine is the
/// first to claim it, else join the first open round from `from` on.
/// Returns the round and its plan.
///
/// # Errors
/// As [`elastic::host_round`] and [`elastic::member_round`].
pub fn join_round(
    store: &dyn Store,
    me: &Registration,
    (run_id, max_restarts): (&str, u32),
    from: u32,
    previous: &[String],
    b: Bounds,
) -> Result<(u32, Plan)> {
    let claim = store.compare_set(&key(from, "leader"), None, me.id.as_bytes())?;
    if claim == CasOutcome::Swapped {
        let plan = elastic::host_round(store, me, (run_id, max_restarts), from, previous, b)?;
        return Ok((from, plan));
    }
    elastic::member_round(store, me, from, b.timeout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_rendezvous::MemoryStore;
    use std::time::Instant;

    /// The elastic tests' registration, on the run "r" with no fixed rank.
    fn reg(id: &str) -> Registration {
        Registration {
            machine_rank: usize::MAX,
            run_id: Some("r".into()),
            ..super::super::elastic::tests::reg(0, id)
        }
    }

    const B: Bounds = Bounds {
        min: 2,
        max: 3,
        window: Duration::from_millis(300),
        timeout: Duration::from_secs(10),
    };

    #[test]
    fn one_leader_per_round_and_a_new_one_when_it_is_gone() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let join = |id: &'static str, from: u32, previous: Vec<String>| {
            let s = store.clone();
            std::thread::spawn(move || join_round(&*s, &reg(id), ("r", 3), from, &previous, B))
        };
        let hs: Vec<_> = ["a", "b", "c"]
            .into_iter()
            .map(|id| join(id, 0, Vec::new()))
            .collect();
        let plans: Vec<(u32, Plan)> = hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        // One plan, one leader: machine 0 of the round is the claimant.
        assert!(plans.iter().all(|p| *p == plans[0]));
        let leader = String::from_utf8(store.try_get(&key(0, "leader")).unwrap().unwrap()).unwrap();
        let order: Vec<String> = plans[0].1.machines.iter().map(|m| m.id.clone()).collect();
        assert_eq!(order[0], leader);
        assert_eq!(plans[0].1.world_size, 6);
        // Round 1 without the leader: the two others go on at world size 4,
        // one of them leads, in the previous order.
        let rest: Vec<String> = order[1..].to_vec();
        let t = Instant::now();
        let hs: Vec<_> = rest
            .iter()
            .map(|id| {
                let id: &'static str = Box::leak(id.clone().into_boxed_str());
                join(id, 1, order.clone())
            })
            .collect();
        let plans: Vec<(u32, Plan)> = hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        assert!(t.elapsed() >= B.window, "waited the window for a third");
        assert!(plans.iter().all(|p| *p == plans[0] && p.0 == 1));
        let ids: Vec<&str> = plans[0].1.machines.iter().map(|m| m.id.as_str()).collect();
        assert_eq!(plans[0].1.world_size, 4);
        assert!(!ids.contains(&leader.as_str()), "{ids:?}");
        let leader1 =
            String::from_utf8(store.try_get(&key(1, "leader")).unwrap().unwrap()).unwrap();
        assert_eq!(ids[0], leader1);
    }
}
