//! ZeRO-3's prefetch: the next unit's all-gather is started without
//! waiting ([`StartExt::start_all_gather`]) on a communicator of its own
//! (split from the optimizer's, so that it runs beside the optimizer's own
//! gathers and reduce-scatters), while the model computes with the current
//! unit. One gather is in flight at most.

use std::sync::Arc;

use accel_api::{Communicator, Result, StartExt, Work};

/// A send and a receive buffer in flight.
pub(super) type PairWork = Work<(Vec<f32>, Vec<f32>)>;

/// The prefetch communicator and its one gather in flight.
pub(super) struct Prefetcher {
    comm: Arc<dyn Communicator>,
    in_flight: Option<(usize, PairWork)>,
}

impl Prefetcher {
    /// Prefetch over `comm`.
    ///
    /// # Errors
    /// None today; kept fallible for engines that set up resources.
    pub(super) fn start(comm: Arc<dyn Communicator>) -> Result<Prefetcher> {
        Ok(Prefetcher {
            comm,
            in_flight: None,
        })
    }

    /// The unit whose gather is in flight.
    pub(super) fn in_flight(&self) -> Option<usize> {
        self.in_flight.as_ref().map(|(u, _)| *u)
    }

    /// Start gathering `unit` from this rank's `shard` into `padded`
    /// elements. Requires: nothing in flight.
    ///
    /// # Errors
    /// What the communicator refuses at once (a poisoned group, ...).
    pub(super) fn issue(&mut self, unit: usize, shard: Vec<f32>, padded: usize) -> Result<()> {
        debug_assert!(self.in_flight.is_none());
        let work = self.comm.start_all_gather(shard, vec![0.0f32; padded])?;
        self.in_flight = Some((unit, work));
        Ok(())
    }

    /// Wait for the gather in flight, if any: its unit and values.
    ///
    /// # Errors
    /// The gather's error (its handle's bound is the communicator's
    /// timeout).
    pub(super) fn take(&mut self) -> Result<Option<(usize, Vec<f32>)>> {
        let Some((unit, work)) = self.in_flight.take() else {
            return Ok(None);
        };
        work.wait().map(|(_, values)| Some((unit, values)))
    }
}
