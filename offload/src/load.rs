//! Loading a (sharded) safetensors checkpoint into a plan.

use std::collections::HashMap;
use std::io::Write;
use std::time::{Duration, Instant};

use accel_api::{Error, ErrorKind, OffloadStore, Result, TensorMeta};

use crate::layout::Layout;
use crate::plan::{Plan, Target};
use crate::safetensors::{Checkpoint, SafetensorsFile};

/// Where loading stands (passed to the progress callback).
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadProgress {
    /// Tensors placed so far.
    pub tensors: usize,
    /// Tensors to place.
    pub total_tensors: usize,
    /// Bytes read so far.
    pub bytes: u64,
    /// Bytes to read.
    pub total_bytes: u64,
    /// Time since loading began, in seconds.
    pub elapsed_s: f64,
    /// Throughput so far, in bytes per second.
    pub bytes_per_s: f64,
    /// `true` on the final report.
    pub done: bool,
}

/// What [`load_checkpoint`] did.
#[derive(Debug, Clone)]
pub struct LoadReport {
    /// Tensors placed.
    pub tensors: usize,
    /// Bytes read from the checkpoint.
    pub bytes: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Tensors placed per device.
    pub per_device: HashMap<Target, usize>,
}

/// How progress is reported.
#[derive(Debug)]
pub enum Progress {
    /// Nothing.
    Silent,
    /// A bar on stderr, redrawn in place (bytes, tensors).
    Bar,
    /// One JSON object per line on stdout (`{"event":"load_progress",...}`)
    /// about every 200 ms and at the end, for machines.
    Json,
}

/// One redraw of the stderr bar: 40 cells, bytes, throughput and tensors
/// so far.
fn bar_line(p: &LoadProgress) -> String {
    const CELLS: u64 = 40;
    let filled = p.bytes.min(p.total_bytes) * CELLS / p.total_bytes.max(1);
    let filled = if p.total_bytes == 0 { CELLS } else { filled } as usize;
    format!(
        "[{}{}] {}/{} {}/s {}/{} tensors",
        "#".repeat(filled),
        "-".repeat(CELLS as usize - filled),
        crate::util::format_bytes(p.bytes),
        crate::util::format_bytes(p.total_bytes),
        crate::util::format_bytes(p.bytes_per_s as u64),
        p.tensors,
        p.total_tensors
    )
}

/// Build a progress callback for `mode`.
pub fn reporter(mode: Progress) -> Box<dyn FnMut(&LoadProgress) + Send> {
    match mode {
        Progress::Silent => Box::new(|_| {}),
        Progress::Bar => {
            let mut last = None::<Instant>;
            Box::new(move |p: &LoadProgress| {
                if p.done || last.is_none_or(|t| t.elapsed() >= Duration::from_millis(100)) {
                    last = Some(Instant::now());
                    let mut err = std::io::stderr().lock();
                    let _ = write!(err, "\r{}", bar_line(p));
                    if p.done {
                        let _ = writeln!(err);
                    }
                }
            })
        }
        Progress::Json => {
            let mut last = None::<Instant>;
            Box::new(move |p: &LoadProgress| {
                if p.done || last.is_none_or(|t| t.elapsed() >= Duration::from_millis(200)) {
                    last = Some(Instant::now());
                    let mut v = serde_json::to_value(p).expect("json");
                    v["event"] = "load_progress".into();
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "{v}");
                }
            })
        }
    }
}

/// Load every tensor of `ck` into the store of its planned device.
///
/// `stores` maps each device of `plan` to the store that stands for it
/// (host-side buffers for accelerators and cpu, a disk store for disk).
/// Each tensor is read exactly once, shard by shard in file order, from a
/// memory mapping; floating-point tensors are converted to the plan's dtype
/// when it differs. Tied aliases are not stored (their owner is).
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] when the checkpoint and the layout
/// disagree (a tensor of one missing from the other) or a device has no
/// store; store and I/O errors as they come.
pub fn load_checkpoint(
    ck: &Checkpoint,
    layout: &Layout,
    plan: &Plan,
    stores: &HashMap<Target, &dyn OffloadStore>,
    progress: &mut dyn FnMut(&LoadProgress),
) -> Result<LoadReport> {
    let start = Instant::now();
    // Everything the layout owns must be in the checkpoint.
    let mut wanted = 0usize;
    for id in layout.tensor_ids() {
        let n = layout.node(id);
        // Non-persistent buffers are computed by the model, never stored.
        if n.alias_of().is_none() && n.persistent() {
            wanted += 1;
        }
    }
    let total_tensors = ck.len();
    let total_bytes = ck.total_bytes();
    let mut p = LoadProgress {
        tensors: 0,
        total_tensors,
        bytes: 0,
        total_bytes,
        elapsed_s: 0.0,
        bytes_per_s: 0.0,
        done: false,
    };
    let mut per_device: HashMap<Target, usize> = HashMap::new();
    let mut placed = 0usize;
    for path in &ck.shards {
        let f = SafetensorsFile::open_with(path, true)?;
        f.advise_sequential();
        for e in f.entries() {
            let id = layout.id(&e.name).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "{}: tensor `{}` is not in the layout",
                        path.display(),
                        e.name
                    ),
                )
                .with_fix("build the layout from this checkpoint")
            })?;
            let node = layout.node(id);
            p.bytes += e.len;
            p.tensors += 1;
            if node.alias_of().is_some() || !node.persistent() {
                continue;
            }
            let dev = plan.device_of(id).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!("tensor `{}` has no device in the plan", e.name),
                )
            })?;
            let store = stores.get(dev).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!("no store given for device {dev}"),
                )
            })?;
            let data = f.data(e);
            let to = plan.dtype_of(id).unwrap_or(e.meta.dtype);
            match crate::convert::convert(e.meta.dtype, to, data)? {
                None => store.put(&e.name, e.meta.clone(), data)?,
                Some(c) => store.put(
                    &e.name,
                    TensorMeta {
                        dtype: to,
                        shape: e.meta.shape.clone(),
                    },
                    &c,
                )?,
            }
            placed += 1;
            *per_device.entry(dev.clone()).or_default() += 1;
            if p.tensors.is_multiple_of(64) {
                p.elapsed_s = start.elapsed().as_secs_f64();
                p.bytes_per_s = p.bytes as f64 / p.elapsed_s.max(1e-9);
                progress(&p);
            }
        }
    }
    if placed != wanted {
        let missing: Vec<&str> = layout
            .tensor_ids()
            .map(|i| layout.node(i))
            .filter(|n| {
                n.alias_of().is_none()
                    && n.persistent()
                    && stores.values().all(|s| !s.contains(n.name()))
            })
            .map(|n| n.name())
            .take(5)
            .collect();
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "{} of the layout's tensors are not in the checkpoint, e.g. {missing:?}",
                wanted - placed
            ),
        ));
    }
    p.elapsed_s = start.elapsed().as_secs_f64();
    p.bytes_per_s = p.bytes as f64 / p.elapsed_s.max(1e-9);
    p.done = true;
    progress(&p);
    Ok(LoadReport {
        tensors: placed,
        bytes: p.bytes,
        elapsed: start.elapsed(),
        per_device,
    })
}
