//! The accelerator's parallelism and device mesh, built once
//! (`crate::mesh`), and the data-parallel group that data and metrics
//! follow: loaders shard over it, `gather_for_metrics`, `reduce` and
//! `split_between_processes` act on it (the ranks of one tensor- or
//! context-parallel block see the same batches and count once).

use std::sync::Arc;

use accel_api::{Communicator, Error, ErrorKind, Result};

use super::Accelerator;
use crate::mesh::{DeviceMesh, ParallelismConfig};
use crate::state::ProcessState;

/// The configuration `accelerate launch` exported (`PARALLELISM_CONFIG_*`),
/// else plain data parallel, checked for the world: an impossible one
/// fails the accelerator's creation on every rank alike.
pub(super) fn env_parallelism(state: &ProcessState) -> Result<ParallelismConfig> {
    ParallelismConfig::from_env()?
        .unwrap_or_default()
        .for_world(state.world_size)
        .map_err(|e| e.with_rank(state.rank))
}

/// The communicator that data-parallel collectives go over.
pub(crate) enum DataParallel {
    /// Every rank is a data-parallel rank: the world's communicator.
    World,
    /// The mesh's `dp` group.
    Group(Arc<dyn Communicator>),
    /// This rank is the only data-parallel rank (pure tensor parallel):
    /// nothing to exchange.
    Alone,
}

impl Accelerator {
    /// The device mesh of this run, built on first use (collective: every
    /// rank calls it first at the same point) from the parallelism
    /// configuration ([`parallelism_config`](Self::parallelism_config)),
    /// and kept.
    ///
    /// # Errors
    /// A split's ([`DeviceMesh::new`]), the same on every rank.
    pub fn device_mesh(&self) -> Result<Arc<DeviceMesh>> {
        let mut slot = accel_api::sync::lock(&self.mesh);
        if let Some(m) = slot.as_ref() {
            return Ok(m.clone());
        }
        let config = self.parallelism_config();
        let mesh = Arc::new(DeviceMesh::new(self.comm(), config)?);
        *slot = Some(mesh.clone());
        Ok(mesh)
    }

    /// The run's parallelism: what [`set_parallelism_config`](Self::set_parallelism_config)
    /// set, else what `accelerate launch` / `accel launch` exported
    /// (`PARALLELISM_CONFIG_*`, read when the accelerator was made), else
    /// the whole world as data parallel; checked for the world, every size
    /// set.
    pub fn parallelism_config(&self) -> ParallelismConfig {
        *accel_api::sync::lock(&self.parallelism)
    }

    /// Use `config` for this run (Accelerate's
    /// `Accelerator(parallelism_config=...)`), before the device mesh is
    /// built and before loaders are prepared. Not collective, but every
    /// rank must set the same.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] from
    /// [`ParallelismConfig::for_world`]; and when the device mesh was
    /// already built for another configuration.
    pub fn set_parallelism_config(&self, config: ParallelismConfig) -> Result<()> {
        let checked = config
            .for_world(self.world_size())
            .map_err(|e| e.with_rank(self.rank()))?;
        let mesh = accel_api::sync::lock(&self.mesh);
        if let Some(m) = mesh.as_ref().filter(|m| m.config() != checked) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "the device mesh was already built for {:?}; it cannot become {checked:?}",
                    m.config()
                ),
            )
            .with_op("set_parallelism_config")
            .with_rank(self.rank())
            .with_fix("set the configuration before the first device_mesh or prepare"));
        }
        *accel_api::sync::lock(&self.parallelism) = checked;
        Ok(())
    }

    /// This rank's index among the data-parallel ranks, and their number
    /// (the world's rank and size without tensor or context parallelism).
    pub(crate) fn data_parallel_place(&self) -> (usize, usize) {
        self.parallelism_config().data_parallel_place(self.rank())
    }

    /// The communicator data-parallel collectives go over (building the
    /// mesh, collectively, on first use when tensor or context parallelism
    /// is on).
    ///
    /// # Errors
    /// [`device_mesh`](Self::device_mesh)'s.
    pub(crate) fn data_parallel(&self) -> Result<DataParallel> {
        let c = self.parallelism_config();
        Ok(if c.tp * c.cp == 1 {
            DataParallel::World
        } else if c.data_parallel_size() == 1 {
            DataParallel::Alone
        } else {
            DataParallel::Group(self.device_mesh()?.group("dp")?.clone())
        })
    }
}
