//! Gradient buckets reduced while the backward pass runs (DDP's reducer):
//! the backward reports each module's gradients as final through the
//! [`UnitGate`] it already calls (`reduce_grads` after each module, in
//! backward order), and every bucket whose gradients are all final starts
//! its all-reduce at once, on the communicator's worker, while the backward
//! goes on. Buckets start in bucket order on every rank (so the ranks issue
//! the same collectives in the same order); after the backward, the rest
//! start, every handle is waited for, and the averaged values are copied
//! back into the gradients.
//!
//! The buckets are the blocking path's ([`BucketPlan`]), and each is
//! reduced by the same operations on the same bytes, so the results are
//! bit-identical to the blocking path. Buckets the engine cannot reduce
//! natively (device memory, a 16-bit type the engine only moves, a
//! compression to a type it cannot add) are reduced by the blocking path
//! after the backward.

use std::sync::Arc;

use accel_api::{
    Buf, BufMut, Communicator, DType, Device, Error, HostBytes, ReduceOp, Result, StartExt, Work,
};
use half::{bf16, f16};

use super::adapters::Parameters;
use super::grads::{self, BucketPlan, Reduce, Staging, SyncReport};
use crate::zero::UnitGate;

/// One bucket's all-reduce in flight.
enum Flight {
    /// In its own dtype.
    Plain(Work<HostBytes>),
    /// f32 gradients carried as bf16 or f16 (DDP's compression hook).
    Compressed(Work<HostBytes>),
}

/// The gate a backward pass calls when its gradient synchronisation
/// overlaps it; see the module documentation.
pub(crate) struct OverlapGate<'a> {
    comm: Arc<dyn Communicator>,
    plan: &'a BucketPlan,
    how: Reduce,
    /// Parameter names in visiting order.
    names: Vec<String>,
    /// Per bucket: its members not yet final.
    left: Vec<usize>,
    /// Per parameter: final.
    ready: Vec<bool>,
    /// Per bucket: reduced by the blocking path after the backward.
    deferred: Vec<bool>,
    /// The next bucket to start (buckets start in order).
    next: usize,
    flights: Vec<Option<Flight>>,
    pool: &'a mut Vec<HostBytes>,
    /// The first error met while starting (returned by `finish`).
    error: Option<Error>,
    /// Buckets started before the backward ended.
    early: usize,
}

impl<'a> OverlapGate<'a> {
    pub(crate) fn new(
        comm: Arc<dyn Communicator>,
        model: &dyn Parameters,
        plan: &'a BucketPlan,
        how: Reduce,
        pool: &'a mut Vec<HostBytes>,
    ) -> OverlapGate<'a> {
        let mut names = Vec::new();
        model.visit_params(&mut |p| names.push(p.name.to_string()));
        let caps = comm.capabilities();
        let deferred = plan
            .buckets
            .iter()
            .map(|b| {
                let compressed = matches!((how.compress, b.dtype), (Some(_), DType::F32));
                let narrow = match (compressed, how.compress) {
                    (true, Some(c)) => c,
                    _ => b.dtype,
                };
                // A bucket of one parameter is reduced in place after the
                // backward, as `backward` does: started now it would need
                // a copy in and a copy out (a handle owns its buffer), which
                // on a host engine cost more than the overlap hides (ADR 0033).
                b.device != Device::CPU || !caps.reduce_dtypes.contains(&narrow) || b.members == 1
            })
            .collect();
        let mut left = vec![0; plan.buckets.len()];
        for (bi, _) in plan.slots.iter().flatten() {
            left[*bi] += 1;
        }
        OverlapGate {
            comm,
            plan,
            how,
            ready: vec![false; names.len()],
            names,
            left,
            deferred,
            next: 0,
            flights: (0..plan.buckets.len()).map(|_| None).collect(),
            pool,
            error: None,
            early: 0,
        }
    }

    /// Mark the parameters under `module` (`""`: every one) final, and
    /// start the buckets that became complete, in order.
    fn mark(&mut self, model: &dyn Parameters, module: &str) -> Result<()> {
        let under = |name: &str| crate::zero::gate::is_under(name, module);
        for i in 0..self.names.len() {
            if self.ready[i] || !under(&self.names[i]) {
                continue;
            }
            self.ready[i] = true;
            if let Some((bi, _)) = self.plan.slots[i] {
                self.left[bi] -= 1;
            }
        }
        while self.next < self.left.len() && self.left[self.next] == 0 {
            self.start(model, self.next)?;
            self.next += 1;
        }
        Ok(())
    }

    /// Copy bucket `bi`'s gradients into a bucket buffer and start its
    /// all-reduce (deferred buckets wait for the backward's end).
    fn start(&mut self, model: &dyn Parameters, bi: usize) -> Result<()> {
        if self.deferred[bi] {
            return Ok(());
        }
        let b = &self.plan.buckets[bi];
        let mut buf = self
            .pool
            .pop()
            .unwrap_or_else(|| HostBytes::zeroed(b.dtype, 0));
        buf.reset(b.dtype, b.len);
        let size = b.dtype.size();
        let mut err = None;
        let mut i = 0;
        model.visit_params(&mut |p| {
            if let Some((pb, off)) = self.plan.slots[i] {
                if pb == bi && err.is_none() {
                    match p.grad {
                        Buf::Host(h) => {
                            let n = h.bytes().len();
                            buf.bytes_mut()[off * size..off * size + n].copy_from_slice(h.bytes());
                        }
                        Buf::Device(_) => {
                            err = Some(Error::internal(
                                "all_reduce_gradients",
                                "a device gradient in a host bucket",
                            ))
                        }
                    }
                }
            }
            i += 1;
        });
        if let Some(e) = err {
            return Err(e);
        }
        let op = if self.how.native_avg {
            ReduceOp::Avg
        } else {
            ReduceOp::Sum
        };
        let flight = match (self.how.compress, b.dtype) {
            (Some(c), DType::F32) => {
                let narrow = narrow_copy(&buf, c)?;
                self.pool.push(buf);
                Flight::Compressed(self.comm.start_all_reduce(narrow, ReduceOp::Sum)?)
            }
            _ => Flight::Plain(self.comm.start_all_reduce(buf, op)?),
        };
        self.flights[bi] = Some(flight);
        Ok(())
    }

    /// After the backward: start what is left, wait for every bucket,
    /// copy the averages back into the gradients, and reduce the deferred
    /// buckets through the blocking path.
    /// Returns what the synchronisation did and how many buckets started
    /// before the backward ended.
    pub(crate) fn finish(
        mut self,
        model: &mut dyn Parameters,
        staging: &mut Staging,
    ) -> Result<(SyncReport, usize)> {
        let first_error = self.error.take();
        let early = self.early;
        // Whatever the backward did not report is final now.
        let started = first_error.is_none() && self.mark(model, "").is_ok();
        let world = self.how.world;
        // Each bucket's result, and whether the copy back divides (a plain
        // sum without a native average; a compressed one was divided as it
        // widened).
        let mut done: Vec<Option<(HostBytes, bool)>> =
            (0..self.flights.len()).map(|_| None).collect();
        let mut wait_error = None;
        for (bi, f) in self.flights.iter_mut().enumerate() {
            let r = match f.take() {
                None => continue,
                Some(Flight::Plain(w)) => w.wait().map(|buf| (buf, !self.how.native_avg)),
                Some(Flight::Compressed(w)) => w.wait().and_then(|narrow| {
                    let mut out = self
                        .pool
                        .pop()
                        .unwrap_or_else(|| HostBytes::zeroed(DType::F32, 0));
                    widen_into(&narrow, &mut out, world)?;
                    Ok((out, false))
                }),
            };
            match r {
                Ok(buf) => done[bi] = Some(buf),
                Err(e) => {
                    wait_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error.or(wait_error) {
            return Err(e);
        }
        if !started {
            return Err(Error::internal(
                "all_reduce_gradients",
                "a bucket could not be started after the backward",
            ));
        }
        let size_of = |bi: usize| self.plan.buckets[bi].dtype.size();
        let mut i = 0;
        model.visit_params_mut(&mut |p| {
            if let Some((bi, off)) = self.plan.slots[i] {
                if let (Some((buf, divide)), BufMut::Host(mut h)) = (&done[bi], p.grad) {
                    let s = size_of(bi);
                    let n = h.bytes().len();
                    let src = &buf.bytes()[off * s..off * s + n];
                    if *divide {
                        h.assign_divided(src, world);
                    } else {
                        h.bytes_mut().copy_from_slice(src);
                    }
                }
            }
            i += 1;
        });
        self.pool
            .extend(done.into_iter().flatten().map(|(buf, _)| buf));
        let report = if self.deferred.iter().any(|d| *d) {
            grads::all_reduce_gradients(
                &*self.comm,
                model,
                self.plan,
                staging,
                self.how,
                Some(&self.deferred),
            )?
        } else {
            SyncReport::default()
        };
        let report = SyncReport {
            buckets: self.plan.buckets.len(),
            in_place: report.in_place,
        };
        Ok((report, early))
    }
}

impl UnitGate for OverlapGate<'_> {
    fn gather(&mut self, _: &mut dyn Parameters, _: &str) -> Result<()> {
        Ok(())
    }

    fn release(&mut self, _: &mut dyn Parameters, _: &str) -> Result<()> {
        Ok(())
    }

    /// `module`'s gradients are final: the buckets they complete start
    /// reducing now. An error is kept for the end of the backward (so
    /// that every rank still makes the same calls) and returned here too.
    fn reduce_grads(&mut self, model: &mut dyn Parameters, module: &str) -> Result<()> {
        if self.error.is_some() {
            return Ok(());
        }
        let before = self.next;
        let r = self.mark(model, module);
        self.early += self.next - before;
        if let Err(e) = &r {
            self.error = Some(e.snapshot());
        }
        r
    }
}

/// `buf` (f32) rounded to the 16-bit float `c`.
fn narrow_copy(buf: &HostBytes, c: DType) -> Result<HostBytes> {
    let host = buf.host();
    let src = host.as_slice::<f32>()?;
    let mut out = HostBytes::zeroed(c, src.len());
    let mut dst = out.host_mut();
    match c {
        DType::BF16 => dst
            .as_mut_slice::<bf16>()?
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = bf16::from_f32(*s)),
        DType::F16 => dst
            .as_mut_slice::<f16>()?
            .iter_mut()
            .zip(src)
            .for_each(|(d, s)| *d = f16::from_f32(*s)),
        other => {
            return Err(Error::invalid_config(
                "gradient_compression",
                other.name(),
                "gradients are compressed to bf16 or f16",
            ))
        }
    }
    Ok(out)
}

/// The summed 16-bit values widened to f32 and divided by `world` in f32
/// (as the blocking path's compression hook).
fn widen_into(narrow: &HostBytes, out: &mut HostBytes, world: usize) -> Result<()> {
    out.reset(DType::F32, narrow.len());
    let mut dst = out.host_mut();
    let d = dst.as_mut_slice::<f32>()?;
    let src = narrow.host();
    match narrow.dtype() {
        DType::BF16 => d
            .iter_mut()
            .zip(src.as_slice::<bf16>()?)
            .for_each(|(d, s)| *d = s.to_f32()),
        DType::F16 => d
            .iter_mut()
            .zip(src.as_slice::<f16>()?)
            .for_each(|(d, s)| *d = s.to_f32()),
        other => {
            return Err(Error::internal(
                "all_reduce_gradients",
                format!("a compressed bucket of {other}"),
            ))
        }
    }
    let w = world as f32;
    d.iter_mut().for_each(|x| *x /= w);
    Ok(())
}
