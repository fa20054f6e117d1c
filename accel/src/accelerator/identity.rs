//! Who this process is in the run, and what it is connected with.

use std::sync::Arc;

use accel_api::{Communicator, Store};

use super::Accelerator;
use crate::state::ProcessState;

impl Accelerator {
    /// The process state.
    pub fn state(&self) -> &ProcessState {
        &self.state
    }

    /// The world communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// The run's rendezvous store (scoped to this run and restart).
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The chosen backend's name.
    pub fn backend_name(&self) -> &str {
        self.comm.backend_name()
    }

    /// Global rank.
    pub fn rank(&self) -> usize {
        self.state.rank
    }

    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.state.world_size
    }

    /// Rank on this machine.
    pub fn local_rank(&self) -> usize {
        self.state.local_rank
    }

    /// `true` on global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.state.is_main_process()
    }

    /// `true` on local rank 0.
    pub fn is_local_main_process(&self) -> bool {
        self.state.is_local_main_process()
    }

    /// `true` on the last rank.
    pub fn is_last_process(&self) -> bool {
        self.state.is_last_process()
    }
}
