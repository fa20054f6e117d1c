//! ZeRO-3's prefetch: the next unit's all-gather runs on a communicator of
//! its own (split from the optimizer's) on a thread of its own, while the
//! model computes with the current unit. One gather is in flight at most.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use accel_api::{Buf, Communicator, Error, HostBuf, HostBufMut, Result};

struct Job {
    unit: usize,
    shard: Vec<f32>,
    padded: usize,
}

type Done = (usize, Result<Vec<f32>>);

/// The prefetch thread and its one gather in flight.
pub(super) struct Prefetcher {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<Done>,
    in_flight: Option<usize>,
    wait: Duration,
    rank: usize,
}

impl Prefetcher {
    /// Start the thread that gathers over `comm`.
    ///
    /// # Errors
    /// [`accel_api::ErrorKind::Io`] when the thread cannot be started.
    pub(super) fn start(comm: Arc<dyn Communicator>) -> Result<Prefetcher> {
        // The gather itself times out after the communicator's timeout.
        let wait = comm.timeout() + Duration::from_secs(5);
        let rank = comm.rank();
        let (jobs, todo) = mpsc::channel::<Job>();
        let (finished, done) = mpsc::channel::<Done>();
        std::thread::Builder::new()
            .name("accel-zero-prefetch".into())
            .spawn(move || {
                for job in todo {
                    let mut out = vec![0.0f32; job.padded];
                    let r = comm
                        .all_gather(
                            Buf::Host(HostBuf::from(&job.shard[..])),
                            HostBufMut::from(&mut out[..]).into(),
                        )
                        .map(|()| out);
                    if finished.send((job.unit, r)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::io("sharding: starting the prefetch thread", e))?;
        Ok(Prefetcher {
            jobs,
            done,
            in_flight: None,
            wait,
            rank,
        })
    }

    /// The unit whose gather is in flight.
    pub(super) fn in_flight(&self) -> Option<usize> {
        self.in_flight
    }

    /// Start gathering `unit` from this rank's `shard` into `padded`
    /// elements. Requires: nothing in flight.
    ///
    /// # Errors
    /// [`accel_api::ErrorKind::Internal`] when the thread is gone.
    pub(super) fn issue(&mut self, unit: usize, shard: Vec<f32>, padded: usize) -> Result<()> {
        debug_assert!(self.in_flight.is_none());
        self.jobs
            .send(Job {
                unit,
                shard,
                padded,
            })
            .map_err(|_| Error::internal("sharding prefetch", "the prefetch thread has ended"))?;
        self.in_flight = Some(unit);
        Ok(())
    }

    /// Wait for the gather in flight, if any: its unit and values.
    ///
    /// # Errors
    /// The gather's error; [`accel_api::ErrorKind::Timeout`] when no
    /// answer comes within the communicator's timeout and 5 s. After an
    /// error the prefetcher must be dropped: a late answer would otherwise
    /// reach the next `take`.
    pub(super) fn take(&mut self) -> Result<Option<(usize, Vec<f32>)>> {
        let Some(unit) = self.in_flight.take() else {
            return Ok(None);
        };
        match self.done.recv_timeout(self.wait) {
            Ok((unit, r)) => r.map(|v| Some((unit, v))),
            Err(_) => Err(Error::timeout(
                "sharding prefetch",
                self.wait,
                format!("the prefetched all-gather of unit {unit} did not finish"),
            )
            .with_rank(self.rank)
            .with_fix("the prefetch communicator's gather outlived its own timeout; run without the prefetch (ZeroOptimizer::with_prefetch(false)) and report the backend")),
        }
    }
}
