//! The device mesh (issue 39): named dimensions over the world, row-major as
//! torch's `DeviceMesh`, one sub-communicator per dimension and per joint
//! dimension Accelerate builds (`dp` = `dp_replicate` × `dp_shard`,
//! `dp_shard_cp`, `dp_cp`), each rank's coordinates. The sub-communicators
//! are splits of the world's: they keep its call check, stall inspector,
//! flight recorder and timeout.
//!
//! [`ParallelismConfig`] holds Accelerate's sizes and their rules
//! (`config.rs`); `Accelerator::device_mesh` (accelerator/mesh.rs) builds
//! the mesh once from the environment and keeps it.

mod config;

use std::collections::BTreeMap;
use std::sync::Arc;

use accel_api::{Communicator, Error, ErrorKind, Result};

pub use config::{
    ParallelismConfig, CP_BACKEND_ENV, CP_SIZE_ENV, DP_REPLICATE_SIZE_ENV, DP_SHARD_SIZE_ENV,
    SP_SIZE_ENV, TP_SIZE_ENV,
};

/// The joint dimensions Accelerate flattens, each over the mesh's
/// dimensions it names that are on (a joint with none is absent).
pub const JOINT_DIMS: [(&str, &[&str]); 3] = [
    ("dp", &["dp_replicate", "dp_shard"]),
    ("dp_shard_cp", &["dp_shard", "cp"]),
    ("dp_cp", &["dp_replicate", "dp_shard", "cp"]),
];

/// A rank's place in a [`ParallelismConfig`]'s mesh and the groups it is in.
pub struct DeviceMesh {
    config: ParallelismConfig,
    names: Vec<&'static str>,
    sizes: Vec<usize>,
    coords: Vec<usize>,
    groups: BTreeMap<String, (Vec<usize>, Arc<dyn Communicator>)>,
}

impl std::fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMesh")
            .field(
                "dims",
                &self.names.iter().zip(&self.sizes).collect::<Vec<_>>(),
            )
            .field("coordinates", &self.coords)
            .field("groups", &self.groups.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Row-major index of `coords` over `sizes` (the positions in `dims`).
fn linear(coords: &[usize], sizes: &[usize], dims: &[usize]) -> usize {
    dims.iter().fold(0, |acc, &d| acc * sizes[d] + coords[d])
}

impl DeviceMesh {
    /// Build `config`'s mesh over `world` (collective: every rank of `world`
    /// calls it with the same configuration): the configuration checked for
    /// `world`'s size ([`ParallelismConfig::for_world`]), then one split of
    /// `world` per dimension and per joint dimension, in a fixed order.
    ///
    /// # Errors
    /// The configuration's ([`ParallelismConfig::for_world`]); a split's,
    /// with the operation `device mesh`.
    pub fn new(world: &Arc<dyn Communicator>, config: ParallelismConfig) -> Result<DeviceMesh> {
        let config = config.for_world(world.world_size())?;
        let dims = config.dims();
        let names: Vec<&'static str> = dims.iter().map(|(n, _)| *n).collect();
        let sizes: Vec<usize> = dims.iter().map(|(_, s)| *s).collect();
        let mut rest = world.rank();
        let mut coords = vec![0; sizes.len()];
        for d in (0..sizes.len()).rev() {
            coords[d] = rest % sizes[d];
            rest /= sizes[d];
        }
        let mut mesh = DeviceMesh {
            config,
            names,
            sizes,
            coords,
            groups: BTreeMap::new(),
        };
        let mut wanted: Vec<(String, Vec<usize>)> = (0..mesh.names.len())
            .map(|d| (mesh.names[d].to_string(), vec![d]))
            .collect();
        for (joint, parts) in JOINT_DIMS {
            let on: Vec<usize> = (0..mesh.names.len())
                .filter(|&d| parts.contains(&mesh.names[d]))
                .collect();
            if !on.is_empty() {
                wanted.push((joint.to_string(), on));
            }
        }
        for (name, dims) in wanted {
            // A joint over one dimension is that dimension's group.
            if let Some(same) = mesh.groups.values().find(|(d, _)| *d == dims).cloned() {
                mesh.groups.insert(name, same);
                continue;
            }
            let others: Vec<usize> = (0..mesh.names.len())
                .filter(|d| !dims.contains(d))
                .collect();
            let color = linear(&mesh.coords, &mesh.sizes, &others) as u32;
            let key = linear(&mesh.coords, &mesh.sizes, &dims) as u32;
            let comm = world
                .split(Some(color), key)
                .map_err(|e| e.with_op("device mesh"))?
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::Internal,
                        format!("the split for mesh group {name} gave this rank no group"),
                    )
                    .with_op("device mesh")
                })?;
            mesh.groups.insert(name, (dims, Arc::from(comm)));
        }
        Ok(mesh)
    }

    /// The configuration it was built for (checked, every size set).
    pub fn config(&self) -> ParallelismConfig {
        self.config
    }

    /// Its dimensions and sizes, outermost first.
    pub fn dims(&self) -> Vec<(&'static str, usize)> {
        self.names
            .iter()
            .copied()
            .zip(self.sizes.iter().copied())
            .collect()
    }

    /// This rank's coordinate along `dim` (0 along a dimension that is off).
    pub fn coordinate(&self, dim: &str) -> usize {
        self.names
            .iter()
            .position(|n| *n == dim)
            .map_or(0, |d| self.coords[d])
    }

    /// The names [`group`](Self::group) takes: the dimensions, then the
    /// joint ones.
    pub fn group_names(&self) -> Vec<&str> {
        self.groups.keys().map(String::as_str).collect()
    }

    /// The communicator of `name`: a dimension (`dp_replicate`, `dp_shard`,
    /// `tp`, `cp`) or a joint one (`dp`, `dp_shard_cp`, `dp_cp`); its
    /// ranks are this rank's neighbours along it, in mesh order.
    ///
    /// # Errors
    /// `InvalidArgument` naming the group and the mesh's groups when the
    /// mesh has no such group (a dimension of size 1 is off).
    pub fn group(&self, name: &str) -> Result<&Arc<dyn Communicator>> {
        self.groups.get(name).map(|(_, c)| c).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "the device mesh has no group {name:?}; it has {:?}",
                    self.group_names()
                ),
            )
            .with_op("device mesh")
            .with_fix("a dimension of size 1 is off: its group is absent")
        })
    }
}

#[cfg(test)]
mod tests;
