//! Accelerate's `load_checkpoint_and_dispatch` once for every framework:
//! the framework-neutral steps here, the tensors in the framework's hands
//! through [`Framework`] (accel-tch, accel-candle).
//!
//! [`load_and_dispatch`] takes the model's [`Layout`] (the framework
//! builds it: from its modules, or from the opened checkpoint), a safetensors
//! checkpoint (one file, a shard index or a folder), the blocks the
//! forward pass steps through and [`DispatchOptions`], and
//!
//! 1. **match**: pairs the checkpoint's entries with the layout's tensors
//!    (same shape; entries the layout lacks are reported as unexpected);
//! 2. **tie**: reads a tied group's storage from its owner's entry, or
//!    from the first member the checkpoint kept;
//! 3. **plan**: plans a device map with the [planner](crate::plan)
//!    (Accelerate's `infer_auto_device_map`);
//! 4. **place**: blocks run on the plan's first accelerator (else the
//!    CPU); a tensor planned there or on another accelerator is resident,
//!    one on `cpu` beside an accelerator goes to the [`HostStore`], one on
//!    `disk` to the [`DiskStore`], which serves the checkpoint's own shards
//!    in place unless the planned dtype differs (converted copies go to the
//!    offload folder);
//! 5. **load**: reads every entry once, with positioned reads (the
//!    checkpoint's pages never stay mapped in the process), converting
//!    floating-point tensors to the planned dtype; resident ones become the
//!    framework's tensors ([`Framework::keep`], [`Framework::tie`]), each
//!    offloaded one an empty placeholder ([`Framework::offload`]);
//! 6. **check**: every tensor of the model came from the checkpoint;
//!    the offloaded tensors each block needs, and those no block covers
//!    ([`DispatchReport::outside_blocks`], [`Dispatch::check_blocks_cover`]).
//!
//! [`Dispatched::run`] then steps through the blocks: a background thread
//! reads the next ones ([`exec::run_layers`](crate::exec::run_layers),
//! `lookahead` blocks ahead) into framework tensors
//! ([`Framework::materialise`]), which are put in place before the block
//! runs ([`Framework::install`]) and emptied after it
//! ([`Framework::release`]). Tied weights are materialised once per pass.
//!
//! [`HostStore`]: crate::store::HostStore
//! [`DiskStore`]: crate::store::DiskStore

mod pipeline;
mod placed;
mod run;

use std::path::PathBuf;
use std::time::Duration;

use accel_api::{DType, Result, TensorMeta};

use crate::plan::{MaxMemory, Target};

pub use pipeline::load_and_dispatch;
pub use placed::Dispatch;
pub use run::Dispatched;

#[cfg(doc)]
use crate::layout::Layout;

/// What a framework gives dispatch: how to make its tensor from bytes, and
/// how to put a tensor in the model's place, tie, empty and fill it again.
///
/// Loading calls [`keep`](Self::keep), [`tie`](Self::tie) and
/// [`offload`](Self::offload) (once per tensor, on the caller's thread);
/// [`Dispatched::run`] calls [`materialise`](Self::materialise) on the
/// prefetch thread and [`install`](Self::install) and
/// [`release`](Self::release) around each block on the caller's. Names are
/// the layout's full tensor names; a tied alias's meta is its owner's.
///
/// A toy framework whose tensors are `f32` vectors, its model a map of
/// them, dispatched with every block on disk:
///
/// ```
/// use std::collections::HashMap;
/// use std::sync::Mutex;
///
/// use accel_api::{DType, Result, TensorMeta};
/// use accel_offload::dispatch::{load_and_dispatch, DispatchOptions, Framework};
/// use accel_offload::layout::Layout;
/// use accel_offload::plan::{MaxMemory, Target};
/// use accel_offload::safetensors::{write_file, Checkpoint};
///
/// /// The model: every tensor by name, empty while offloaded.
/// #[derive(Default)]
/// struct Toy(Mutex<HashMap<String, Vec<f32>>>);
///
/// impl Framework for Toy {
///     type Device = ();
///     type Tensor = Vec<f32>;
///     fn device(&self, _: &Target) -> Result<()> {
///         Ok(())
///     }
///     fn materialise(
///         _: &str,
///         meta: &TensorMeta,
///         _: &(),
///         fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
///     ) -> Result<Vec<f32>> {
///         let mut bytes = vec![0u8; meta.byte_len()];
///         fill(&mut bytes)?;
///         Ok(bytes.chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
///     }
///     fn keep(&mut self, name: &str, t: Vec<f32>) -> Result<()> {
///         self.0.get_mut().unwrap().insert(name.into(), t);
///         Ok(())
///     }
///     fn tie(&mut self, alias: &str, owner: &str) -> Result<()> {
///         let m = self.0.get_mut().unwrap();
///         let t = m[owner].clone();
///         m.insert(alias.into(), t);
///         Ok(())
///     }
///     fn offload(&mut self, name: &str, meta: &TensorMeta, dev: &()) -> Result<()> {
///         self.release(name, meta, dev)
///     }
///     fn install(&self, name: &str, t: &Vec<f32>) -> Result<()> {
///         self.0.lock().unwrap().insert(name.into(), t.clone());
///         Ok(())
///     }
///     fn release(&self, name: &str, _: &TensorMeta, _: &()) -> Result<()> {
///         self.0.lock().unwrap().insert(name.into(), vec![]);
///         Ok(())
///     }
/// }
///
/// // A checkpoint of two one-weight blocks.
/// let dir = tempfile::tempdir().unwrap();
/// let path = dir.path().join("model.safetensors");
/// let meta = TensorMeta { dtype: DType::F32, shape: vec![2] };
/// let (a, b) = ([1f32, 2.0], [3f32, 4.0]);
/// let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
/// let (ab, bb) = (bytes(&a), bytes(&b));
/// write_file(&path, [("l0.w", &meta, &ab[..]), ("l1.w", &meta, &bb[..])])?;
///
/// let opts = DispatchOptions {
///     max_memory: Some(MaxMemory::parse("disk")?),
///     ..DispatchOptions::default()
/// };
/// // The layout from the checkpoint: module order inferred from the names.
/// let layout = |ck: &Checkpoint| Layout::from_checkpoint(ck, &[]);
/// let d = load_and_dispatch(Toy::default(), layout, &path, &["l0", "l1"], &opts)?;
/// assert!(d.framework().0.lock().unwrap()["l0.w"].is_empty());
/// let mut sums = vec![];
/// d.run(|i, _block| {
///     sums.push(d.framework().0.lock().unwrap()[&format!("l{i}.w")].iter().sum::<f32>());
///     Ok(())
/// })?;
/// assert_eq!(sums, [3.0, 7.0]);
/// assert!(d.framework().0.lock().unwrap()["l1.w"].is_empty());
/// # Ok::<(), accel_api::Error>(())
/// ```
pub trait Framework {
    /// Where the framework's tensors live (`tch::Device`); carries what
    /// [`materialise`](Self::materialise) needs besides the bytes.
    type Device: Clone + std::fmt::Debug + Send + Sync;
    /// A tensor made from bytes: kept resident at load, or a block's
    /// offloaded weight on its way in (shared by the blocks of a tie).
    type Tensor: Send + Sync;

    /// The device that planned `target` (`cpu` or an accelerator, never
    /// `disk`) stands for.
    ///
    /// # Errors
    /// [`ErrorKind::Unsupported`](accel_api::ErrorKind::Unsupported) for a
    /// device the framework does not run on here (dispatch stops before
    /// reading any tensor).
    fn device(&self, target: &Target) -> Result<Self::Device>;

    /// A new tensor `name` of `meta`'s dtype and shape on `device`, its
    /// bytes (little-endian, row-major, `meta.byte_len()` of them) written
    /// by `fill` into host memory the framework hands it.
    ///
    /// # Errors
    /// [`ErrorKind::Unsupported`](accel_api::ErrorKind::Unsupported) for a
    /// dtype the framework has no tensor for; `fill`'s errors; the
    /// framework's own (allocation, the copy to `device`).
    fn materialise(
        name: &str,
        meta: &TensorMeta,
        device: &Self::Device,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Self::Tensor>;

    /// At load: the model's tensor `name` is `tensor` from now on.
    ///
    /// # Errors
    /// The framework's (a name the model does not have).
    fn keep(&mut self, name: &str, tensor: Self::Tensor) -> Result<()>;

    /// At load, after every [`keep`](Self::keep): the resident tensor
    /// `alias` shares `owner`'s storage.
    ///
    /// # Errors
    /// The framework's (a name the model does not have).
    fn tie(&mut self, alias: &str, owner: &str) -> Result<()>;

    /// At load: `name` is offloaded; leave the model an empty placeholder
    /// of `meta`'s dtype on `device` (the execution device) until a block
    /// [`install`](Self::install)s it.
    ///
    /// # Errors
    /// The framework's.
    fn offload(&mut self, name: &str, meta: &TensorMeta, device: &Self::Device) -> Result<()>;

    /// Before a block runs: the model's tensor `name` holds `tensor`'s
    /// values (made by [`materialise`](Self::materialise) on the execution
    /// device) until [`release`](Self::release).
    ///
    /// # Errors
    /// The framework's (a tensor installed twice, a name the model does not
    /// have); the block does not run, and its tensors are released.
    fn install(&self, name: &str, tensor: &Self::Tensor) -> Result<()>;

    /// After a block ran (or failed): `name` is an empty placeholder of
    /// `meta`'s dtype on `device` again.
    ///
    /// # Errors
    /// The framework's; the pass stops with the block's own error first.
    fn release(&self, name: &str, meta: &TensorMeta, device: &Self::Device) -> Result<()>;
}

/// Options of [`load_and_dispatch`] (Accelerate's arguments of the same
/// names).
#[derive(Debug, Clone)]
pub struct DispatchOptions {
    /// Budgets (`cuda:0=40GiB,cpu=20MiB,disk`); `None` puts everything on
    /// the CPU, unbounded (no offload).
    pub max_memory: Option<MaxMemory>,
    /// Class names or full-name globs of modules kept on one device.
    pub no_split: Vec<String>,
    /// Cast floating-point weights to this dtype (narrowing only).
    pub dtype: Option<DType>,
    /// Where converted disk tensors are written; without it a folder under
    /// the system's temporary directory, removed when the [`Dispatched`] is
    /// dropped. Unneeded when disk tensors keep the checkpoint's dtype
    /// (they are served from the checkpoint in place).
    pub offload_dir: Option<PathBuf>,
    /// Blocks read ahead by the prefetch thread (0: read each block on the
    /// compute thread just before it runs).
    pub lookahead: usize,
    /// Accelerate's `fallback_allocation`.
    pub fallback_allocation: bool,
}

impl Default for DispatchOptions {
    fn default() -> Self {
        DispatchOptions {
            max_memory: None,
            no_split: vec![],
            dtype: None,
            offload_dir: None,
            lookahead: 1,
            fallback_allocation: false,
        }
    }
}

/// What loading did.
#[derive(Debug, Clone, Default)]
pub struct DispatchReport {
    /// Tensors read from the checkpoint.
    pub tensors: usize,
    /// Bytes kept resident in the model's tensors.
    pub resident_bytes: u64,
    /// Bytes in the host store.
    pub host_bytes: u64,
    /// Bytes served by the disk store.
    pub disk_bytes: u64,
    /// Of `disk_bytes`, those served from the checkpoint in place
    /// (zero-copy) rather than written to the offload folder.
    pub disk_in_place_bytes: u64,
    /// Checkpoint tensors that are no tensor of the model (skipped).
    pub unexpected: Vec<String>,
    /// Offloaded tensors that no block covers: [`Dispatched::run`] never
    /// materialises them.
    pub outside_blocks: Vec<String>,
    /// Planning and loading time.
    pub elapsed: Duration,
}
