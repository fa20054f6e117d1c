//! The accelerator's device mesh, built once (`crate::mesh`).

use std::sync::Arc;

use accel_api::Result;

use super::Accelerator;
use crate::mesh::{DeviceMesh, ParallelismConfig};

impl Accelerator {
    /// The device mesh of this run, built on first use (collective: every
    /// rank calls it first at the same point) from the configuration
    /// `accelerate launch` exports (`PARALLELISM_CONFIG_*`), else plain
    /// data parallel over the world, and kept.
    ///
    /// # Errors
    /// The environment's and the configuration's
    /// ([`ParallelismConfig::from_env`], [`DeviceMesh::new`]), the same on
    /// every rank.
    pub fn device_mesh(&self) -> Result<Arc<DeviceMesh>> {
        let mut slot = accel_api::sync::lock(&self.mesh);
        if let Some(m) = slot.as_ref() {
            return Ok(m.clone());
        }
        let config = ParallelismConfig::from_env()?.unwrap_or_default();
        let mesh = Arc::new(DeviceMesh::new(self.comm(), config)?);
        *slot = Some(mesh.clone());
        Ok(mesh)
    }
}
