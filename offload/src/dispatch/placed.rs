//! What a dispatched model keeps beside its framework's tensors, and the
//! accessors every framework's `Dispatched` gives: the layout and the plan
//! it was placed by, the host and disk stores of its offloaded tensors,
//! its blocks in forward order, how far the prefetch thread reads ahead,
//! and the load report.

use std::collections::HashMap;
use std::path::Path;

use accel_api::{Error, OffloadStore, Result, TensorMeta};

use super::DispatchReport;
use crate::exec::{self, ExecStats, LayerSpec, Resident, WeightSource};
use crate::layout::Layout;
use crate::plan::{DeviceMap, Plan, Target};
use crate::store::{DiskStore, HostStore};

/// A checkpoint placed over a device map, whatever framework holds its
/// resident tensors.
#[derive(Debug)]
pub struct Dispatch {
    pub(super) layout: Layout,
    pub(super) plan: Plan,
    pub(super) host: HostStore,
    pub(super) disk: Option<DiskStore>,
    pub(super) blocks: Vec<LayerSpec>,
    pub(super) lookahead: usize,
    pub(super) report: DispatchReport,
}

impl Dispatch {
    /// The plan (devices and budgets).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The device map in module order (serialises as Accelerate's
    /// `{"module": "device"}`).
    pub fn device_map(&self) -> DeviceMap<'_> {
        self.plan.device_map()
    }

    /// The model's layout, in the model's module order.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The host store: the tensors planned on `cpu` when blocks run on an
    /// accelerator (empty otherwise).
    pub fn host(&self) -> &HostStore {
        &self.host
    }

    /// The disk store, when anything is on disk.
    pub fn disk(&self) -> Option<&DiskStore> {
        self.disk.as_ref()
    }

    /// The disk store's folder, when anything is on disk.
    pub fn offload_dir(&self) -> Option<&Path> {
        self.disk.as_ref().map(DiskStore::dir)
    }

    /// What loading did.
    pub fn report(&self) -> &DispatchReport {
        &self.report
    }

    /// The blocks, in forward order, with the offloaded tensors each one
    /// needs.
    pub fn blocks(&self) -> &[LayerSpec] {
        &self.blocks
    }

    /// `Ok` when every offloaded tensor is in some block (else a forward
    /// pass could read one that nothing fills).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// naming up to five of the [`DispatchReport::outside_blocks`].
    pub fn check_blocks_cover(&self) -> Result<()> {
        let outside = &self.report.outside_blocks;
        if outside.is_empty() {
            return Ok(());
        }
        Err(Error::invalid_argument(
            "load_checkpoint_and_dispatch",
            format!(
                "the plan offloads {} tensor(s) that no block covers, e.g. {:?}",
                outside.len(),
                &outside[..outside.len().min(5)]
            ),
        )
        .with_fix("name the module holding them as a block, or give the CPU more memory"))
    }

    /// Where the blocks' offloaded tensors are read from: the host store
    /// (for `cpu`), `more`, and the disk store (when there is one).
    pub fn weight_source<'a>(
        &'a self,
        more: &[(Target, &'a dyn OffloadStore)],
    ) -> WeightSource<'a> {
        let mut stores: HashMap<Target, &dyn OffloadStore> = HashMap::new();
        stores.insert(Target::Cpu, &self.host);
        stores.extend(more.iter().map(|(t, s)| (t.clone(), *s)));
        if let Some(d) = &self.disk {
            stores.insert(Target::Disk, d);
        }
        WeightSource::new(&self.layout, &self.plan, stores)
    }

    /// One forward pass over the blocks with their offloaded tensors read
    /// from `src` ([`exec::run_layers`] with this read-ahead).
    ///
    /// # Errors
    /// As [`exec::run_layers`].
    pub fn run_blocks<B, U, C>(
        &self,
        src: &WeightSource<'_>,
        upload: U,
        compute: C,
    ) -> Result<ExecStats>
    where
        B: Send + Sync,
        U: Fn(&str, &TensorMeta, &[u8]) -> Result<B> + Sync,
        C: FnMut(&Resident<B>) -> Result<()>,
    {
        exec::run_layers(src, &self.blocks, self.lookahead, upload, compute)
    }
}
