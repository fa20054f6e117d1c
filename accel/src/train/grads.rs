//! Gradients as views: device kernels, host float arithmetic, bucketed
//! all-reduce grouped by (device, dtype), unscaling, norms and clipping.
//!
//! The training loop never owns gradient memory: it sees the framework's
//! buffers through [`ParamMut`](super::ParamMut) views. Host views it
//! reads and writes itself, for every float element type; device views it
//! hands to the communicator as they are and, for arithmetic and for the
//! copies into bucket buffers, to the model's [`GradKernels`].

use accel_api::{
    with_float, Buf, BufMut, Communicator, DType, Device, Error, ErrorKind, HostBuf, HostBufMut,
    ReduceOp, Result,
};
use half::{bf16, f16};
use std::borrow::Cow;

use super::adapters::{ParamMut, Parameters};
use super::kernels::{need_kernels, no_kernels, DeviceScratch, GradKernels, GradStats};

fn not_float(op: &str, name: &str, dtype: DType) -> Error {
    Error::invalid_argument(
        op,
        format!("the gradient of parameter {name:?} is {dtype}; gradients are floating point"),
    )
    .with_fix("keep gradients as f16, bf16, f32 or f64")
}

// ------------------------------------------------------------------ host

/// The host float element types gradients come in, converted through
/// f32 (f64 through f64).
trait HostFloat: accel_api::Element + Copy {
    fn to_f32(self) -> f32;
    fn to_f64(self) -> f64;
    fn from_f32(x: f32) -> Self;
    /// `f32_op` in f32 for the 16- and 32-bit types, `f64_op` for f64.
    fn map(self, f32_op: &dyn Fn(f32) -> f32, _f64_op: &dyn Fn(f64) -> f64) -> Self {
        Self::from_f32(f32_op(self.to_f32()))
    }
}

impl HostFloat for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f32(x: f32) -> f32 {
        x
    }
}

impl HostFloat for f64 {
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f32(x: f32) -> f64 {
        f64::from(x)
    }
    fn map(self, _: &dyn Fn(f32) -> f32, f64_op: &dyn Fn(f64) -> f64) -> f64 {
        f64_op(self)
    }
}

/// The two 16-bit floats: the `half` crate's conversions.
macro_rules! half_host_float {
    ($($t:ident),+) => {
        $(impl HostFloat for $t {
            fn to_f32(self) -> f32 {
                $t::to_f32(self)
            }
            fn to_f64(self) -> f64 {
                $t::to_f64(self)
            }
            fn from_f32(x: f32) -> $t {
                $t::from_f32(x)
            }
        })+
    };
}
half_host_float!(f16, bf16);

/// A host view of any float type as `f32` values (borrowed when it is f32,
/// converted otherwise).
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] for an integer view.
pub fn host_to_f32(buf: HostBuf<'_>) -> Result<Cow<'_, [f32]>> {
    if buf.dtype() == DType::F32 {
        return Ok(Cow::Borrowed(buf.as_slice::<f32>()?));
    }
    with_float!(
        buf.dtype(),
        T => Ok(Cow::Owned(buf.as_slice::<T>()?.iter().map(|x| HostFloat::to_f32(*x)).collect())),
        else Err(not_float("host_to_f32", "?", buf.dtype()))
    )
}

/// Write `f32` values into a host view of any float type (rounding once).
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] for an integer view or another length.
pub fn host_from_f32(dst: &mut HostBufMut<'_>, src: &[f32]) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::invalid_argument(
            "host_from_f32",
            format!("{} values for a view of {}", src.len(), dst.len()),
        ));
    }
    let dtype = dst.dtype();
    with_float!(
        dtype,
        T => {
            let d = dst.as_mut_slice::<T>()?;
            d.iter_mut().zip(src).for_each(|(d, s)| *d = <T as HostFloat>::from_f32(*s));
            Ok(())
        },
        else Err(not_float("host_from_f32", "?", dtype))
    )
}

/// Apply `f` to every element of a float host view, in f32 for the 16- and
/// 32-bit types and in f64 for f64.
fn map_host(buf: &mut HostBufMut<'_>, f32_op: impl Fn(f32) -> f32, f64_op: impl Fn(f64) -> f64) {
    let dtype = buf.dtype();
    with_float!(
        dtype,
        T => buf
            .as_mut_slice::<T>()
            .expect("dtype checked")
            .iter_mut()
            .for_each(|x| *x = x.map(&f32_op, &f64_op)),
        else ()
    )
}

fn host_stats(buf: HostBuf<'_>, norm_type: f64) -> GradStats {
    fn acc(it: impl Iterator<Item = f64>, p: f64) -> GradStats {
        let mut s = GradStats::default();
        for x in it {
            if !x.is_finite() {
                s.non_finite = true;
            }
            let a = x.abs();
            if p.is_infinite() {
                // NaN must win over every number, as torch's max does.
                if a.is_nan() || a > s.norm_part {
                    s.norm_part = a;
                }
            } else if p == 2.0 {
                s.norm_part += a * a;
            } else if p == 1.0 {
                s.norm_part += a;
            } else {
                s.norm_part += a.powf(p);
            }
        }
        s
    }
    with_float!(
        buf.dtype(),
        T => acc(
            buf.as_slice::<T>().expect("dtype").iter().map(|x| HostFloat::to_f64(*x)),
            norm_type
        ),
        else GradStats::default()
    )
}

// ------------------------------------------------------------------ per view

/// Scale one gradient view by `factor`.
fn scale_view(
    k: Option<&dyn GradKernels>,
    name: &str,
    g: BufMut<'_>,
    factor: f64,
    op: &str,
) -> Result<()> {
    match g {
        BufMut::Host(mut h) => {
            let f = factor as f32;
            map_host(&mut h, |x| x * f, |x| x * factor);
            Ok(())
        }
        BufMut::Device(d) => need_kernels(k, op, name, d.device())?.scale(d, factor),
    }
}

fn stats_view(
    k: Option<&dyn GradKernels>,
    name: &str,
    g: Buf<'_>,
    norm_type: f64,
    op: &str,
) -> Result<GradStats> {
    match g {
        Buf::Host(h) => Ok(host_stats(h, norm_type)),
        Buf::Device(d) => need_kernels(k, op, name, d.device())?.stats(d, norm_type),
    }
}

/// Check that every gradient is floating point.
fn check_float(model: &dyn Parameters, op: &str) -> Result<()> {
    let mut bad = None;
    model.visit_params(&mut |p| {
        if bad.is_none() && !p.grad.dtype().is_float() {
            bad = Some(not_float(op, p.name, p.grad.dtype()));
        }
    });
    bad.map_or(Ok(()), Err)
}

/// `Unsupported` naming the first parameter whose gradient is in device
/// memory when the model gives no [`Parameters::grad_kernels`]:
/// checked by `prepare`, so that no later step meets it halfway.
pub(crate) fn check_kernels(model: &dyn Parameters, op: &str) -> Result<()> {
    if model.grad_kernels().is_some() {
        return Ok(());
    }
    let mut bad = None;
    model.visit_params(&mut |p| {
        if bad.is_none() {
            if let Buf::Device(d) = &p.grad {
                bad = Some(no_kernels(op, p.name, d.device()));
            }
        }
    });
    bad.map_or(Ok(()), Err)
}

/// Multiply every gradient by `factor`; returns whether some element was
/// infinite or NaN after (or before) scaling.
pub(crate) fn scale_and_check(model: &mut dyn Parameters, factor: f64) -> Result<bool> {
    check_float(model, "unscale_gradients")?;
    let k = model.grad_kernels();
    let k = k.as_deref();
    let mut out = Ok(false);
    model.visit_params_mut(&mut |mut p| {
        if out.is_err() {
            return;
        }
        let r = (|| {
            if factor != 1.0 {
                scale_view(k, p.name, p.grad.reborrow(), factor, "unscale_gradients")?;
            }
            stats_view(k, p.name, p.grad.as_buf(), 1.0, "unscale_gradients")
        })();
        match r {
            Ok(s) => {
                if s.non_finite {
                    out = Ok(true);
                }
            }
            Err(e) => out = Err(e),
        }
    });
    out
}

/// The total `norm_type`-norm of all gradients (the norm of the per-tensor
/// norms, as torch's `clip_grad_norm_`).
pub(crate) fn total_norm(model: &dyn Parameters, norm_type: f64) -> Result<f64> {
    check_float(model, "clip_grad_norm")?;
    let k = model.grad_kernels();
    let k = k.as_deref();
    let mut acc = 0.0f64;
    let mut err = None;
    model.visit_params(&mut |p| {
        if err.is_some() {
            return;
        }
        match stats_view(k, p.name, p.grad, norm_type, "clip_grad_norm") {
            Ok(s) if norm_type.is_infinite() => {
                if s.norm_part.is_nan() || s.norm_part > acc {
                    acc = s.norm_part;
                }
            }
            Ok(s) => acc += s.norm_part,
            Err(e) => err = Some(e),
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    Ok(if norm_type.is_infinite() {
        acc
    } else if norm_type == 2.0 {
        acc.sqrt()
    } else if norm_type == 1.0 {
        acc
    } else {
        acc.powf(1.0 / norm_type)
    })
}

/// Scale every gradient by `factor` (clipping by norm).
pub(crate) fn scale_all(model: &mut dyn Parameters, factor: f64, op: &str) -> Result<()> {
    let k = model.grad_kernels();
    let k = k.as_deref();
    let mut err = None;
    model.visit_params_mut(&mut |p| {
        if err.is_none() {
            if let Err(e) = scale_view(k, p.name, p.grad, factor, op) {
                err = Some(e);
            }
        }
    });
    err.map_or(Ok(()), Err)
}

/// Clamp every gradient into `[-limit, limit]`.
pub(crate) fn clamp_all(model: &mut dyn Parameters, limit: f64) -> Result<()> {
    check_float(model, "clip_grad_value")?;
    let k = model.grad_kernels();
    let k = k.as_deref();
    let mut err = None;
    let l32 = limit as f32;
    model.visit_params_mut(&mut |p| {
        if err.is_some() {
            return;
        }
        let r = match p.grad {
            BufMut::Host(mut h) => {
                map_host(&mut h, |x| x.clamp(-l32, l32), |x| x.clamp(-limit, limit));
                Ok(())
            }
            BufMut::Device(d) => need_kernels(k, "clip_grad_value", p.name, d.device())
                .and_then(|k| k.clamp(d, limit)),
        };
        if let Err(e) = r {
            err = Some(e);
        }
    });
    err.map_or(Ok(()), Err)
}

// ------------------------------------------------------------------ buckets

/// How one rank's gradients are grouped for the all-reduce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BucketPlan {
    pub(crate) buckets: Vec<Bucket>,
    /// Per parameter in visiting order: `(bucket, element offset)`, `None`
    /// for an empty gradient.
    pub(crate) slots: Vec<Option<(usize, usize)>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bucket {
    pub(crate) device: Device,
    pub(crate) dtype: DType,
    /// Elements.
    pub(crate) len: usize,
    pub(crate) members: usize,
    /// Byte offset in the host staging buffer (8-aligned); host multi-member
    /// buckets only.
    pub(crate) host_offset: usize,
}

impl BucketPlan {
    /// Call `f` on each of `model`'s parameters that has a slot, in
    /// visiting order, with its bucket index and element offset; after the
    /// first error `f` is not called again and that error is returned.
    fn visit_slots(
        &self,
        model: &mut dyn Parameters,
        mut f: impl FnMut(ParamMut<'_>, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let mut idx = 0;
        let mut err: Option<Error> = None;
        model.visit_params_mut(&mut |p| {
            let i = idx;
            idx += 1;
            if err.is_some() {
                return;
            }
            let Some(Some((bi, off))) = self.slots.get(i).copied() else {
                return;
            };
            if let Err(e) = f(p, bi, off) {
                err = Some(e);
            }
        });
        err.map_or(Ok(()), Err)
    }

    /// Group the gradients by (device, dtype) into buckets, as DDP does:
    /// in reverse visiting order (the order a backward pass finishes
    /// them), the first bucket of each group of at most `first_cap_bytes`
    /// (so that communication starts early), the others of at most
    /// `cap_bytes`; a larger gradient gets a bucket of its own. Bucket 0
    /// holds the last parameters.
    pub(crate) fn new(
        model: &dyn Parameters,
        cap_bytes: usize,
        first_cap_bytes: usize,
    ) -> Result<BucketPlan> {
        check_float(model, "all_reduce_gradients")?;
        let mut grads = Vec::new();
        model.visit_params(&mut |p| grads.push((p.grad.device(), p.grad.dtype(), p.grad.len())));
        let mut buckets: Vec<Bucket> = Vec::new();
        // Per (device, dtype): the open bucket and whether it is the first.
        let mut open: Vec<((Device, DType), usize)> = Vec::new();
        let mut slots = vec![None; grads.len()];
        for (i, &(dev, dt, n)) in grads.iter().enumerate().rev() {
            if n == 0 {
                continue;
            }
            let key = (dev, dt);
            let pos = open.iter().position(|(k, _)| *k == key);
            let bytes = n * dt.size();
            let cap = |b: usize| {
                let first = buckets.iter().position(|x| (x.device, x.dtype) == key) == Some(b);
                if first {
                    first_cap_bytes
                } else {
                    cap_bytes
                }
            };
            let b = match pos {
                Some(j) if (buckets[open[j].1].len * dt.size()) + bytes <= cap(open[j].1) => {
                    open[j].1
                }
                _ => {
                    buckets.push(Bucket {
                        device: dev,
                        dtype: dt,
                        len: 0,
                        members: 0,
                        host_offset: 0,
                    });
                    let b = buckets.len() - 1;
                    match pos {
                        Some(j) => open[j].1 = b,
                        None => open.push((key, b)),
                    }
                    b
                }
            };
            slots[i] = Some((b, buckets[b].len));
            buckets[b].len += n;
            buckets[b].members += 1;
        }
        let mut off = 0;
        for b in buckets.iter_mut() {
            if b.members > 1 && b.device == Device::CPU {
                b.host_offset = off;
                off += (b.len * b.dtype.size()).div_ceil(8) * 8;
            }
        }
        Ok(BucketPlan { buckets, slots })
    }

    /// Bytes of host staging the multi-member host buckets need.
    pub(crate) fn host_bytes(&self) -> usize {
        self.buckets
            .iter()
            .filter(|b| b.members > 1 && b.device == Device::CPU)
            .map(|b| b.host_offset + (b.len * b.dtype.size()).div_ceil(8) * 8)
            .max()
            .unwrap_or(0)
    }

    /// Buckets holding device gradients of several parameters (they need a
    /// device bucket buffer).
    fn device_multi(&self) -> impl Iterator<Item = (usize, &Bucket)> {
        self.buckets
            .iter()
            .enumerate()
            .filter(|(_, b)| b.members > 1 && b.device != Device::CPU)
    }
}

/// How the gradients travel: the reduction and the optional compression.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reduce {
    pub(crate) world: usize,
    pub(crate) native_avg: bool,
    /// Communicate f32 host gradients as this type (bf16 or f16), average
    /// in f32.
    pub(crate) compress: Option<DType>,
}

impl Reduce {
    /// All-reduce `buf` to the average over the ranks, in place.
    fn run(
        &self,
        comm: &dyn Communicator,
        k: Option<&dyn GradKernels>,
        mut buf: BufMut<'_>,
    ) -> Result<()> {
        if let (Some(c), BufMut::Host(h)) = (self.compress, &mut buf) {
            if h.dtype() == DType::F32 {
                return self.run_compressed(comm, h, c);
            }
        }
        if let BufMut::Host(h) = &mut buf {
            let dt = h.dtype();
            if matches!(dt, DType::F16 | DType::BF16)
                && !comm.capabilities().reduce_dtypes.contains(&dt)
            {
                // The engine moves but cannot add this type (Gloo and bf16).
                return self.gather_average(comm, h);
            }
        }
        if self.native_avg {
            return comm.all_reduce(buf, ReduceOp::Avg);
        }
        comm.all_reduce(buf.reborrow(), ReduceOp::Sum)?;
        match buf {
            BufMut::Host(mut h) => {
                h.divide_by(self.world);
                Ok(())
            }
            BufMut::Device(d) => match k {
                Some(k) => k.scale(d, 1.0 / self.world as f64),
                None => Err(no_kernels("all_reduce_gradients", "?", d.device())
                    .with_fix("use a backend with a native Avg, or return GradKernels from Parameters::grad_kernels")),
            },
        }
    }

    /// A 16-bit float buffer the engine cannot add: gather every rank's
    /// values and average them in f32, in rank order (the same result on
    /// every rank), rounding once.
    fn gather_average(&self, comm: &dyn Communicator, h: &mut HostBufMut<'_>) -> Result<()> {
        let n = h.len();
        let mine = host_to_f32(h.as_buf())?.into_owned();
        let sums = gather_sum(comm, &mine, h.dtype())?;
        let w = self.world as f32;
        let avg: Vec<f32> = sums.iter().take(n).map(|s| s / w).collect();
        host_from_f32(h, &avg)
    }

    /// DDP's bf16 (fp16) compression hook: cast to the narrow type, sum,
    /// cast back, divide by the world size in f32. On an engine that moves
    /// but cannot add the narrow type, each rank's narrow values are
    /// gathered and summed in f32.
    fn run_compressed(
        &self,
        comm: &dyn Communicator,
        h: &mut HostBufMut<'_>,
        c: DType,
    ) -> Result<()> {
        let native = comm.capabilities().reduce_dtypes.contains(&c);
        let g = h.as_mut_slice::<f32>()?;
        match c {
            DType::BF16 | DType::F16 if !native => {
                let sums = gather_sum(comm, g, c)?;
                g.copy_from_slice(&sums);
            }
            DType::BF16 => {
                let mut w: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
                comm.all_reduce(BufMut::from(&mut w[..]), ReduceOp::Sum)?;
                g.iter_mut().zip(&w).for_each(|(d, s)| *d = s.to_f32());
            }
            DType::F16 => {
                let mut w: Vec<f16> = g.iter().map(|&x| f16::from_f32(x)).collect();
                comm.all_reduce(BufMut::from(&mut w[..]), ReduceOp::Sum)?;
                g.iter_mut().zip(&w).for_each(|(d, s)| *d = s.to_f32());
            }
            other => {
                return Err(Error::invalid_config(
                    "gradient_compression",
                    other.name(),
                    "gradients are compressed to bf16 or f16",
                ))
            }
        }
        let inv = self.world as f32;
        g.iter_mut().for_each(|x| *x /= inv);
        Ok(())
    }
}

/// Every rank's `values`, rounded to the 16-bit float `narrow`, gathered
/// and summed in f32 in rank order.
fn gather_sum(comm: &dyn Communicator, values: &[f32], narrow: DType) -> Result<Vec<f32>> {
    let n = values.len();
    let world = comm.world_size();
    let mut sums = vec![0f32; n];
    macro_rules! go {
        ($t:ty) => {{
            let send: Vec<$t> = values.iter().map(|&x| <$t>::from_f32(x)).collect();
            let mut recv = vec![<$t>::ZERO; n * world];
            comm.all_gather(Buf::from(&send[..]), BufMut::from(&mut recv[..]))?;
            for chunk in recv.chunks(n) {
                sums.iter_mut()
                    .zip(chunk)
                    .for_each(|(s, x)| *s += x.to_f32());
            }
        }};
    }
    match narrow {
        DType::BF16 => go!(bf16),
        DType::F16 => go!(f16),
        other => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("gathered averages are for f16 and bf16, not {other}"),
            ))
        }
    }
    Ok(sums)
}

/// Scratch memory the gradient all-reduce keeps between calls.
#[derive(Default)]
pub(crate) struct Staging {
    /// Host bucket buffers (8-aligned storage).
    host: Vec<f64>,
    /// Device bucket buffers by bucket index.
    device: Vec<(usize, Box<dyn DeviceScratch>)>,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("host_bytes", &(self.host.len() * 8))
            .field("device_buffers", &self.device.len())
            .finish()
    }
}

fn host_region<'s>(storage: &'s mut [f64], b: &Bucket) -> Result<HostBufMut<'s>> {
    let bytes = HostBufMut::from(storage).into_bytes();
    HostBufMut::from_bytes(
        b.dtype,
        &mut bytes[b.host_offset..b.host_offset + b.len * b.dtype.size()],
    )
}

/// What one gradient all-reduce did, for tests and logging.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SyncReport {
    pub(crate) buckets: usize,
    /// Buckets of one gradient, reduced in the gradient's own memory.
    pub(crate) in_place: usize,
}

/// Average every gradient across the ranks (with `only`, the buckets it
/// marks): buckets of one gradient in place, the others through one bucket
/// buffer on the gradients' device.
pub(crate) fn all_reduce_gradients(
    comm: &dyn Communicator,
    model: &mut dyn Parameters,
    plan: &BucketPlan,
    staging: &mut Staging,
    how: Reduce,
    only: Option<&[bool]>,
) -> Result<SyncReport> {
    let chosen = |bi: usize| only.is_none_or(|o| o[bi]);
    let kernels = model.grad_kernels();
    let k = kernels.as_deref();
    let need = plan.host_bytes().div_ceil(8);
    if staging.host.len() < need {
        staging.host.resize(need, 0.0);
    }
    for (i, b) in plan.device_multi().filter(|(i, _)| chosen(*i)) {
        let fits = staging.device.iter_mut().any(|(j, s)| {
            *j == i && s.view_mut().len() == b.len && s.view_mut().dtype() == b.dtype
        });
        if !fits {
            let Some(k) = k else {
                return Err(no_kernels("all_reduce_gradients", "(bucket)", b.device));
            };
            staging.device.retain(|(j, _)| *j != i);
            staging.device.push((i, k.alloc(b.device, b.dtype, b.len)?));
        }
    }
    let (host, device) = (&mut staging.host, &mut staging.device);
    let mut report = SyncReport {
        buckets: (0..plan.buckets.len()).filter(|&bi| chosen(bi)).count(),
        in_place: 0,
    };
    // Pass 1: single-gradient buckets in place, the others copied in.
    plan.visit_slots(model, |p, bi, off| {
        let b = &plan.buckets[bi];
        if !chosen(bi) {
            Ok(())
        } else if b.members == 1 {
            report.in_place += 1;
            how.run(comm, k, p.grad)
        } else {
            copy_in_out(k, p.name, p.grad, b, bi, off, host, device, true)
        }
    })?;
    // The bucket buffers.
    for (bi, b) in plan.buckets.iter().enumerate() {
        if b.members < 2 || !chosen(bi) {
            continue;
        }
        if b.device == Device::CPU {
            how.run(comm, k, BufMut::Host(host_region(host, b)?))?;
        } else {
            let s = device
                .iter_mut()
                .find(|(j, _)| *j == bi)
                .map(|(_, s)| s)
                .expect("allocated above");
            how.run(comm, k, BufMut::Device(s.view_mut()))?;
        }
    }
    // Pass 2: copy the bucket buffers back.
    plan.visit_slots(model, |p, bi, off| {
        let b = &plan.buckets[bi];
        if b.members > 1 && chosen(bi) {
            copy_in_out(k, p.name, p.grad, b, bi, off, host, device, false)?;
        }
        Ok(())
    })?;
    Ok(report)
}

/// Copy one gradient into (`into`) or out of its bucket buffer.
#[allow(clippy::too_many_arguments)]
fn copy_in_out(
    k: Option<&dyn GradKernels>,
    name: &str,
    g: BufMut<'_>,
    b: &Bucket,
    bi: usize,
    off: usize,
    host: &mut [f64],
    device: &mut [(usize, Box<dyn DeviceScratch>)],
    into: bool,
) -> Result<()> {
    match g {
        BufMut::Host(mut h) => {
            let mut region = host_region(host, b)?;
            let s = b.dtype.size();
            let n = h.len() * s;
            let r = &mut region.bytes_mut()[off * s..off * s + n];
            if into {
                r.copy_from_slice(h.bytes());
            } else {
                h.bytes_mut().copy_from_slice(r);
            }
            Ok(())
        }
        BufMut::Device(mut d) => {
            let Some(k) = k else {
                return Err(no_kernels("all_reduce_gradients", name, d.device()));
            };
            let s = device
                .iter_mut()
                .find(|(j, _)| *j == bi)
                .map(|(_, s)| s)
                .expect("allocated before the copies");
            let n = d.len();
            let mut bucket = s.view_mut();
            if into {
                k.copy(
                    Buf::Device(d.as_buf()),
                    0,
                    BufMut::Device(bucket.reborrow()),
                    off,
                    n,
                )
            } else {
                k.copy(
                    Buf::Device(bucket.as_buf()),
                    off,
                    BufMut::Device(d.reborrow()),
                    0,
                    n,
                )
            }
        }
    }
}

// ------------------------------------------------------------------ values

/// A view's values as `f32` on the host (device views copied through the
/// model's kernels): what checkpoints and `save_model` write.
pub(crate) fn read_f32(k: Option<&dyn GradKernels>, name: &str, v: Buf<'_>) -> Result<Vec<f32>> {
    match v {
        Buf::Host(h) => Ok(host_to_f32(h)
            .map_err(|_| not_float("read values", name, h.dtype()))?
            .into_owned()),
        Buf::Device(d) => {
            let Some(k) = k else {
                return Err(no_kernels("read values", name, d.device()));
            };
            let mut storage = vec![0f64; (d.size_bytes()).div_ceil(8)];
            let bytes = HostBufMut::from(&mut storage[..]).into_bytes();
            let mut host = HostBufMut::from_bytes(d.dtype(), &mut bytes[..d.size_bytes()])?;
            k.copy(Buf::Device(d), 0, BufMut::Host(host.reborrow()), 0, d.len())?;
            Ok(host_to_f32(host.as_buf())
                .map_err(|_| not_float("read values", name, d.dtype()))?
                .into_owned())
        }
    }
}

/// Write `f32` values into a view (device views through the kernels).
pub(crate) fn write_f32(
    k: Option<&dyn GradKernels>,
    name: &str,
    v: BufMut<'_>,
    src: &[f32],
) -> Result<()> {
    match v {
        BufMut::Host(mut h) => host_from_f32(&mut h, src),
        BufMut::Device(mut d) => {
            let Some(k) = k else {
                return Err(no_kernels("write values", name, d.device()));
            };
            let mut storage = vec![0f64; (d.size_bytes()).div_ceil(8)];
            let bytes = HostBufMut::from(&mut storage[..]).into_bytes();
            let mut host = HostBufMut::from_bytes(d.dtype(), &mut bytes[..d.size_bytes()])?;
            host_from_f32(&mut host, src)?;
            let n = d.len();
            k.copy(
                Buf::Host(host.as_buf()),
                0,
                BufMut::Device(d.reborrow()),
                0,
                n,
            )
        }
    }
}
