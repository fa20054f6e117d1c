//! Layer-by-layer execution with prefetch.
//!
//! For each layer in order the executor makes the layer's weights
//! resident on the execution device (through a caller-supplied `upload`),
//! runs the caller's `compute` step, then releases them (drops its
//! handles). With `lookahead = k > 0`, a background thread fetches up to
//! `k` layers ahead through a bounded `sync_channel`, so layer i+1 is
//! read (from RAM, or paged in from the disk store) while layer i computes.
//! Tied weights are materialised once and shared by every layer that uses
//! them. The executor is framework-agnostic: `upload` turns bytes into the
//! caller's device buffer type `B` (for a CPU framework, a `Vec<u8>`).

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{Error, ErrorKind, OffloadStore, Result, TensorMeta};

use crate::layout::Layout;
use crate::plan::{Plan, Target};

/// Finds a tensor's bytes through the plan: each device's store.
#[derive(Clone)]
pub struct WeightSource<'a> {
    layout: &'a Layout,
    plan: &'a Plan,
    stores: HashMap<Target, &'a dyn OffloadStore>,
}

impl std::fmt::Debug for WeightSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightSource")
            .field("devices", &self.stores.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl<'a> WeightSource<'a> {
    /// Look tensors up in `stores`, one per planned device.
    pub fn new(
        layout: &'a Layout,
        plan: &'a Plan,
        stores: HashMap<Target, &'a dyn OffloadStore>,
    ) -> Self {
        WeightSource {
            layout,
            plan,
            stores,
        }
    }

    /// The storage owner of `name` (itself unless it is a tied alias).
    pub fn owner(&self, name: &str) -> Option<&'a str> {
        let id = self.layout.id(name)?;
        let n = self.layout.node(id);
        Some(self.layout.node(n.alias_of().unwrap_or(id)).name())
    }

    /// `true` when `name` shares storage with other tensors.
    pub fn is_tied(&self, name: &str) -> bool {
        self.layout
            .id(name)
            .is_some_and(|id| self.layout.tied().iter().any(|g| g.contains(&id)))
    }

    /// The bytes of `name` (its owner's, for a tied alias).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for an unknown name; store errors.
    pub fn get(&self, name: &str) -> Result<(TensorMeta, Cow<'a, [u8]>)> {
        let id = self.layout.id(name).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("no tensor `{name}` in the layout"),
            )
        })?;
        let owner = self.layout.node(id).alias_of().unwrap_or(id);
        let oname = &self.layout.node(owner).name();
        let dev = self.plan.device_of(owner).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("`{name}` is not a placed tensor"),
            )
        })?;
        let store = self.stores.get(dev).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("no store given for device {dev}"),
            )
        })?;
        Ok((store.meta(oname)?, store.get(oname)?))
    }
}

/// A layer: a name and the tensors its compute step needs.
#[derive(Debug, Clone)]
pub struct LayerSpec {
    /// Layer name (usually a module name).
    pub name: String,
    /// Full tensor names.
    pub tensors: Vec<String>,
}

impl LayerSpec {
    /// A layer holding every stored tensor under module `name` of `layout`
    /// (non-persistent buffers are left out: the model computes them, no
    /// store holds them).
    pub fn module(layout: &Layout, name: &str) -> Option<LayerSpec> {
        let mut tensors = layout.tensors_under(name)?;
        tensors.retain(|t| layout.id(t).is_some_and(|i| layout.node(i).persistent()));
        Some(LayerSpec {
            name: name.to_string(),
            tensors,
        })
    }
}

/// A layer's weights, resident on the execution device.
#[derive(Debug)]
pub struct Resident<B> {
    /// Position in the layer list.
    pub index: usize,
    /// Layer name.
    pub name: String,
    tensors: Vec<(String, TensorMeta, Arc<B>)>,
    fetch_time: Duration,
}

impl<B> Resident<B> {
    /// The buffer of `tensor`.
    pub fn get(&self, tensor: &str) -> Option<&B> {
        self.tensors
            .iter()
            .find(|(n, _, _)| n == tensor)
            .map(|(_, _, b)| &**b)
    }

    /// Every (name, meta, buffer).
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &TensorMeta, &B)> {
        self.tensors.iter().map(|(n, m, b)| (n.as_str(), m, &**b))
    }
}

/// Timings of a run.
#[derive(Debug, Clone, Default)]
pub struct ExecStats {
    /// Layers run.
    pub layers: usize,
    /// Time spent fetching and uploading (on the prefetch thread when on).
    pub fetch: Duration,
    /// Time spent in `compute`.
    pub compute: Duration,
    /// Time the compute thread waited for weights.
    pub stall: Duration,
    /// Wall time.
    pub wall: Duration,
    /// Tied tensors uploaded (once each).
    pub tied_uploads: usize,
    /// Per layer, in order: (fetch time, compute time).
    pub per_layer: Vec<(Duration, Duration)>,
}

impl ExecStats {
    /// The wall time of a perfect pipeline with these fetch and compute
    /// times: the first layer's fetch, then per layer the longer of its
    /// compute and the next layer's fetch (they overlap). With one fetch
    /// thread and one compute thread no schedule is faster, so
    /// `wall / ideal` measures what prefetching loses.
    pub fn ideal(&self) -> Duration {
        let l = &self.per_layer;
        let Some(first) = l.first() else {
            return Duration::ZERO;
        };
        let mut t = first.0;
        for (i, (_, compute)) in l.iter().enumerate() {
            let next_fetch = l.get(i + 1).map_or(Duration::ZERO, |n| n.0);
            t += (*compute).max(next_fetch);
        }
        t
    }
}

fn fetch<B, U>(
    src: &WeightSource<'_>,
    index: usize,
    spec: &LayerSpec,
    upload: &U,
    cache: &mut HashMap<String, Arc<B>>,
    tied_uploads: &mut usize,
) -> Result<Resident<B>>
where
    U: Fn(&str, &TensorMeta, &[u8]) -> Result<B>,
{
    let t = Instant::now();
    let mut tensors = Vec::with_capacity(spec.tensors.len());
    for name in &spec.tensors {
        if src.is_tied(name) {
            let owner = src.owner(name).unwrap_or(name).to_string();
            if let Some(b) = cache.get(&owner) {
                let (meta, _) = src.get(name)?;
                tensors.push((name.clone(), meta, b.clone()));
                continue;
            }
            let (meta, data) = src.get(name)?;
            let b = Arc::new(upload(name, &meta, &data)?);
            *tied_uploads += 1;
            cache.insert(owner, b.clone());
            tensors.push((name.clone(), meta, b));
        } else {
            let (meta, data) = src.get(name)?;
            let b = Arc::new(upload(name, &meta, &data)?);
            tensors.push((name.clone(), meta, b));
        }
    }
    Ok(Resident {
        index,
        name: spec.name.clone(),
        tensors,
        fetch_time: t.elapsed(),
    })
}

/// Run `layers` in order: fetch each layer's weights (through `upload`),
/// call `compute`, release. `lookahead = 0` fetches synchronously;
/// `lookahead = k` keeps up to `k` layers in flight on a prefetch thread.
///
/// # Errors
/// The first error of a fetch or of `compute`; the prefetch thread stops.
pub fn run_layers<B, U, C>(
    src: &WeightSource<'_>,
    layers: &[LayerSpec],
    lookahead: usize,
    upload: U,
    mut compute: C,
) -> Result<ExecStats>
where
    B: Send + Sync,
    U: Fn(&str, &TensorMeta, &[u8]) -> Result<B> + Sync,
    C: FnMut(&Resident<B>) -> Result<()>,
{
    let start = Instant::now();
    let mut stats = ExecStats {
        layers: layers.len(),
        ..Default::default()
    };
    if lookahead == 0 {
        let mut cache = HashMap::new();
        for (i, spec) in layers.iter().enumerate() {
            let r = fetch(src, i, spec, &upload, &mut cache, &mut stats.tied_uploads)?;
            stats.fetch += r.fetch_time;
            stats.stall += r.fetch_time;
            let t = Instant::now();
            compute(&r)?;
            stats.compute += t.elapsed();
            stats.per_layer.push((r.fetch_time, t.elapsed()));
        }
        stats.wall = start.elapsed();
        return Ok(stats);
    }
    let upload = &upload;
    let tied_uploads = std::thread::scope(|s| -> Result<usize> {
        let (tx, rx) = sync_channel::<Result<Resident<B>>>(lookahead - 1);
        let worker = s.spawn(move || {
            let mut cache = HashMap::new();
            let mut tied = 0usize;
            for (i, spec) in layers.iter().enumerate() {
                let r = fetch(src, i, spec, upload, &mut cache, &mut tied);
                let failed = r.is_err();
                if tx.send(r).is_err() || failed {
                    break;
                }
            }
            tied
        });
        for _ in 0..layers.len() {
            let t = Instant::now();
            let r = rx
                .recv()
                .map_err(|_| Error::internal("run_layers", "the prefetch thread ended early"))??;
            stats.stall += t.elapsed();
            stats.fetch += r.fetch_time;
            let t = Instant::now();
            compute(&r)?;
            stats.compute += t.elapsed();
            stats.per_layer.push((r.fetch_time, t.elapsed()));
        }
        drop(rx);
        worker
            .join()
            .map_err(|_| Error::internal("run_layers", "the prefetch thread panicked"))
    })?;
    stats.tied_uploads = tied_uploads;
    stats.wall = start.elapsed();
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ideal_overlaps_each_compute_with_the_next_fetch() {
        let ms = Duration::from_millis;
        let mut s = ExecStats::default();
        assert_eq!(s.ideal(), Duration::ZERO);
        // fetch 3, 1, 4; compute 2, 5, 1: 3 + max(2, 1) + max(5, 4) + 1.
        s.per_layer = vec![(ms(3), ms(2)), (ms(1), ms(5)), (ms(4), ms(1))];
        assert_eq!(s.ideal(), ms(11));
        // Fetch-bound: the fetches back to back, then the last compute.
        s.per_layer = vec![(ms(4), ms(1)), (ms(4), ms(1)), (ms(4), ms(1))];
        assert_eq!(s.ideal(), ms(13));
    }
}
