//! A dispatched model and its forward pass, block by block.

use accel_api::{Result, TensorMeta};

use super::{Dispatch, Framework};
use crate::exec::{ExecStats, Resident};
use crate::plan::Target;

/// A checkpoint dispatched over a device map into `F`'s tensors (see the
/// [module docs](super)). Its plan, device map, layout, stores, blocks
/// and report are those of the [`Dispatch`] it derefs to.
#[derive(Debug)]
pub struct Dispatched<F: Framework> {
    dispatch: Dispatch,
    framework: F,
    device: F::Device,
}

impl<F: Framework> std::ops::Deref for Dispatched<F> {
    type Target = Dispatch;
    fn deref(&self) -> &Dispatch {
        &self.dispatch
    }
}

impl<F: Framework> Dispatched<F> {
    pub(super) fn new(dispatch: Dispatch, framework: F, device: F::Device) -> Dispatched<F> {
        Dispatched {
            dispatch,
            framework,
            device,
        }
    }

    /// The placement (also reached through `Deref`).
    pub fn dispatch(&self) -> &Dispatch {
        &self.dispatch
    }

    /// The framework's side: the model's tensors.
    pub fn framework(&self) -> &F {
        &self.framework
    }

    /// Where blocks run: the plan's first accelerator, else the CPU.
    pub fn device(&self) -> &F::Device {
        &self.device
    }

    /// Run one forward pass: call `step(index, block_name)` for every block
    /// in order, each with its offloaded tensors installed, released after
    /// it; the next blocks are read on a background thread meanwhile.
    ///
    /// # Errors
    /// The first error of `step`, of reading a block or of the framework
    /// (the tensors of the block in hand are released first).
    pub fn run<S>(&self, mut step: S) -> Result<ExecStats>
    where
        S: FnMut(usize, &str) -> Result<()>,
    {
        let d = &self.dispatch;
        let src = d.weight_source(&[]);
        let (device, disk) = (&self.device, d.disk());
        // On the prefetch thread: a tensor on the execution device; disk
        // tensors with positioned reads, not through the mapping.
        let upload = |name: &str, meta: &TensorMeta, bytes: &[u8]| -> Result<F::Tensor> {
            let owner = src.owner(name).unwrap_or(name);
            let on_disk = d.layout.id(owner).and_then(|id| d.plan.device_of(id));
            F::materialise(name, meta, device, &mut |out| match (on_disk, disk) {
                (Some(Target::Disk), Some(disk)) => disk.read_into(owner, out),
                _ => {
                    out.copy_from_slice(bytes);
                    Ok(())
                }
            })
        };
        let fw = &self.framework;
        let compute = |r: &Resident<F::Tensor>| -> Result<()> {
            let mut res = Ok(());
            for (name, _, t) in r.tensors() {
                res = fw.install(name, t);
                if res.is_err() {
                    break;
                }
            }
            if res.is_ok() {
                res = step(r.index, &r.name);
            }
            for (name, meta, _) in r.tensors() {
                let released = fw.release(name, meta, device);
                if res.is_ok() {
                    res = released;
                }
            }
            res
        };
        d.run_blocks(&src, upload, compute)
    }
}
