//! What a framework's dispatched model (accel-tch's and accel-candle's
//! `Dispatched`) keeps beside its own tensors, and the accessors both
//! give: the layout and the plan it was placed by, the disk store of its
//! offloaded tensors, its blocks in forward order, how far the prefetch
//! thread reads ahead, and the framework's load report.

use std::collections::HashMap;
use std::path::Path;

use accel_api::{OffloadStore, Result, TensorMeta};

use crate::exec::{self, ExecStats, LayerSpec, Resident, WeightSource};
use crate::layout::Layout;
use crate::plan::{DeviceMap, Plan, Target};
use crate::store::DiskStore;

/// A checkpoint placed over a device map, whatever framework holds its
/// tensors; `R` is that framework's load report.
#[derive(Debug)]
pub struct Dispatch<R> {
    layout: Layout,
    plan: Plan,
    disk: Option<DiskStore>,
    blocks: Vec<LayerSpec>,
    lookahead: usize,
    report: R,
}

impl<R> Dispatch<R> {
    /// The placement of `layout` by `plan`, with the offloaded tensors in
    /// `disk` (and the framework's own stores), and no block yet.
    pub fn new(layout: Layout, plan: Plan, disk: Option<DiskStore>, report: R) -> Dispatch<R> {
        let (blocks, lookahead) = (Vec::new(), 0);
        Dispatch {
            layout,
            plan,
            disk,
            blocks,
            lookahead,
            report,
        }
    }

    /// Run as `blocks`, in forward order, with `lookahead` blocks read
    /// ahead.
    pub fn with_blocks(mut self, blocks: Vec<LayerSpec>, lookahead: usize) -> Dispatch<R> {
        self.blocks = blocks;
        self.lookahead = lookahead;
        self
    }

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

    /// The disk store, when anything is on disk.
    pub fn disk(&self) -> Option<&DiskStore> {
        self.disk.as_ref()
    }

    /// The disk store's folder, when anything is on disk.
    pub fn offload_dir(&self) -> Option<&Path> {
        self.disk.as_ref().map(DiskStore::dir)
    }

    /// What loading did.
    pub fn report(&self) -> &R {
        &self.report
    }

    /// The blocks, in forward order, with the offloaded tensors each one
    /// needs.
    pub fn blocks(&self) -> &[LayerSpec] {
        &self.blocks
    }

    /// Where the blocks' offloaded tensors are read from: the disk store
    /// (when there is one) and `more`.
    pub fn weight_source<'a>(
        &'a self,
        more: &[(Target, &'a dyn OffloadStore)],
    ) -> WeightSource<'a> {
        let mut stores: HashMap<Target, &dyn OffloadStore> =
            more.iter().map(|(t, s)| (t.clone(), *s)).collect();
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
