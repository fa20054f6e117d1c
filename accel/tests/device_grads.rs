//! The device path of the gradient sync, on a fake device: "device memory"
//! is a map from address to values that only the fake kernels and the fake
//! communicator look into (addresses are never dereferenced). Two ranks on
//! cpu-gloo underneath.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use accel::train::*;
use accel::{
    Accelerator, Buf, BufMut, Capabilities, Communicator, DType, Device, DeviceBuf, DeviceBufMut,
    DeviceKind, ReduceOp, Result,
};

mod common;
use common::ranks;

const GPU: Device = Device {
    kind: DeviceKind::Cuda,
    index: 0,
};

/// One rank's fake device memory.
#[derive(Default)]
struct Mem {
    bufs: Mutex<HashMap<u64, Vec<f32>>>,
    next: AtomicU64,
}

impl Mem {
    fn alloc(&self, v: Vec<f32>) -> u64 {
        let a = 0x1000 * (1 + self.next.fetch_add(1, Ordering::Relaxed));
        self.bufs.lock().unwrap().insert(a, v);
        a
    }
    fn get(&self, a: u64) -> Vec<f32> {
        self.bufs.lock().unwrap()[&a].clone()
    }
    fn with<T>(&self, a: u64, f: impl FnOnce(&mut Vec<f32>) -> T) -> T {
        f(self
            .bufs
            .lock()
            .unwrap()
            .get_mut(&a)
            .expect("a fake device address"))
    }
}

struct Kernels(Arc<Mem>);

struct Scratch(u64, usize);
impl DeviceScratch for Scratch {
    fn view_mut(&mut self) -> DeviceBufMut<'_> {
        // SAFETY: the address is a key of the fake device's map, never
        // dereferenced; the view borrows the scratch that owns the entry.
        unsafe { DeviceBufMut::from_raw(self, self.0, self.1, DType::F32, GPU, 0) }
    }
}

impl GradKernels for Kernels {
    fn alloc(&self, _: Device, _: DType, len: usize) -> Result<Box<dyn DeviceScratch>> {
        let a = self.0.alloc(vec![0.0; len]);
        Ok(Box::new(Scratch(a, len)))
    }
    fn copy(&self, src: Buf<'_>, so: usize, dst: BufMut<'_>, d_o: usize, n: usize) -> Result<()> {
        let vals: Vec<f32> = match src {
            Buf::Host(h) => h.as_slice::<f32>()?[so..so + n].to_vec(),
            Buf::Device(d) => self.0.get(d.addr())[so..so + n].to_vec(),
        };
        match dst {
            BufMut::Host(mut h) => h.as_mut_slice::<f32>()?[d_o..d_o + n].copy_from_slice(&vals),
            BufMut::Device(d) => self
                .0
                .with(d.addr(), |v| v[d_o..d_o + n].copy_from_slice(&vals)),
        }
        Ok(())
    }
    fn scale(&self, b: DeviceBufMut<'_>, f: f64) -> Result<()> {
        self.0
            .with(b.addr(), |v| v.iter_mut().for_each(|x| *x *= f as f32));
        Ok(())
    }
    fn fill(&self, b: DeviceBufMut<'_>, value: f64) -> Result<()> {
        self.0.with(b.addr(), |v| v.fill(value as f32));
        Ok(())
    }
    fn stats(&self, b: DeviceBuf<'_>, p: f64) -> Result<GradStats> {
        let v = self.0.get(b.addr());
        Ok(GradStats {
            norm_part: v.iter().map(|x| f64::from(x.abs()).powf(p)).sum(),
            non_finite: v.iter().any(|x| !x.is_finite()),
        })
    }
    fn clamp(&self, b: DeviceBufMut<'_>, l: f64) -> Result<()> {
        let l = l as f32;
        self.0
            .with(b.addr(), |v| v.iter_mut().for_each(|x| *x = x.clamp(-l, l)));
        Ok(())
    }
}

/// A model whose parameters live on the fake device.
struct DevModel {
    mem: Arc<Mem>,
    /// (name, value address, gradient address, length)
    params: Vec<(String, u64, u64, usize)>,
}

impl DevModel {
    fn new(mem: Arc<Mem>, sizes: &[usize], rank: usize) -> DevModel {
        let params = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let v = mem.alloc((0..n).map(|j| (i * 10 + j) as f32 + rank as f32).collect());
                let g = mem.alloc(
                    (0..n)
                        .map(|j| (j as f32 + 1.0) * (1.0 + rank as f32))
                        .collect(),
                );
                (format!("p{i}"), v, g, n)
            })
            .collect();
        DevModel { mem, params }
    }
    fn grads(&self) -> Vec<Vec<f32>> {
        self.params.iter().map(|p| self.mem.get(p.2)).collect()
    }
    fn values(&self) -> Vec<Vec<f32>> {
        self.params.iter().map(|p| self.mem.get(p.1)).collect()
    }
}

impl Parameters for DevModel {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        for (name, v, g, n) in &self.params {
            // SAFETY: fake device addresses (map keys), never dereferenced;
            // the views borrow the model that owns the entries.
            let (value, grad) = unsafe {
                (
                    DeviceBuf::from_raw(self, *v, *n, DType::F32, GPU, 0),
                    DeviceBuf::from_raw(self, *g, *n, DType::F32, GPU, 0),
                )
            };
            f(ParamRef {
                name,
                value: value.into(),
                grad: grad.into(),
            });
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        for (name, v, g, n) in self.params.iter_mut() {
            let (va, ga, n) = (*v, *g, *n);
            // SAFETY: as above; each view borrows its own address field, and
            // the two addresses differ, so the writable views never alias.
            let (value, grad) = unsafe {
                (
                    DeviceBufMut::from_raw(v, va, n, DType::F32, GPU, 0),
                    DeviceBufMut::from_raw(g, ga, n, DType::F32, GPU, 0),
                )
            };
            f(ParamMut {
                name,
                value: value.into(),
                grad: grad.into(),
            });
        }
    }
    fn grad_kernels(&self) -> Option<Arc<dyn GradKernels>> {
        Some(Arc::new(Kernels(self.mem.clone())))
    }
}

/// A communicator that takes fake device views (staging them through the
/// host only to reach cpu-gloo, which stands for the device engine) and
/// counts host calls carrying more than one element.
struct DevComm {
    inner: Arc<dyn Communicator>,
    mem: Arc<Mem>,
    caps: Capabilities,
    host_payload_calls: Arc<AtomicUsize>,
}

impl DevComm {
    fn stage(&self, buf: BufMut<'_>, f: impl FnOnce(BufMut<'_>) -> Result<()>) -> Result<()> {
        match buf {
            BufMut::Device(d) => {
                let mut v = self.mem.get(d.addr());
                f(BufMut::from(&mut v[..]))?;
                self.mem.with(d.addr(), |m| *m = v);
                Ok(())
            }
            h => {
                if h.len() > 1 {
                    self.host_payload_calls.fetch_add(1, Ordering::Relaxed);
                }
                f(h)
            }
        }
    }
}

impl Communicator for DevComm {
    fn backend_name(&self) -> &str {
        "fake-device"
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn device(&self) -> Device {
        GPU
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let world = self.inner.world_size() as f32;
        self.stage(buf, |b| {
            if op == ReduceOp::Avg {
                // cpu-gloo has no native Avg: sum, then divide.
                let mut h = b.into_host().expect("staged on the host");
                self.inner
                    .all_reduce(BufMut::Host(h.reborrow()), ReduceOp::Sum)?;
                h.as_mut_slice::<f32>()?
                    .iter_mut()
                    .for_each(|x| *x /= world);
                Ok(())
            } else {
                self.inner.all_reduce(b, op)
            }
        })
    }
    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        self.stage(buf, |b| self.inner.reduce(b, op, root))
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.stage(buf, |b| self.inner.broadcast(b, root))
    }
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.inner.all_gather(send, recv)
    }
    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.inner.gather(send, recv, root)
    }
    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        self.inner.scatter(send, recv, root)
    }
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.inner.reduce_scatter(send, recv, op)
    }
    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.inner.all_to_all(send, recv)
    }
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        self.inner.send(buf, dst, tag)
    }
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        self.inner.recv(buf, src, tag)
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
    fn split(&self, _: Option<u32>, _: u32) -> Result<Option<Box<dyn Communicator>>> {
        Err(accel::Error::unsupported("split", "not in this fake"))
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// The L2 norm of every element of `grads`, in f64.
fn l2_norm(grads: &[Vec<f32>]) -> f64 {
    grads
        .iter()
        .flatten()
        .map(|x| f64::from(*x).powi(2))
        .sum::<f64>()
        .sqrt()
}

fn on_device(acc: Accelerator, native_avg: bool) -> (Accelerator, Arc<Mem>, Arc<AtomicUsize>) {
    let mem = Arc::new(Mem::default());
    let mut caps = acc.comm().capabilities().clone();
    caps.device_kinds.insert(DeviceKind::Cuda);
    if native_avg {
        caps.reduce_ops.insert(ReduceOp::Avg);
    } else {
        caps.reduce_ops.remove(&ReduceOp::Avg);
    }
    let count = Arc::new(AtomicUsize::new(0));
    let comm = DevComm {
        inner: acc.comm().clone(),
        mem: mem.clone(),
        caps,
        host_payload_calls: count.clone(),
    };
    let acc = Accelerator::from_communicator(Arc::new(comm), acc.store().clone()).unwrap();
    (acc, mem, count)
}

#[test]
fn device_gradients_are_averaged_on_the_device_without_a_host_round_trip() {
    for native_avg in [true, false] {
        let got = ranks(2, move |acc| {
            let (acc, mem, host_calls) = on_device(acc, native_avg);
            acc.set_training_config(TrainConfig {
                bucket_cap_bytes: 64, // p0 + p1 share a bucket, p2 (160 bytes) alone
                mixed_precision: Some(MixedPrecision::Fp16),
                ..TrainConfig::default()
            })
            .unwrap();
            let rank = acc.rank();
            let mut m = acc
                .prepare_model(DevModel::new(mem, &[2, 3, 40], rank))
                .unwrap();
            let values = m.values();
            m.all_reduce_gradients().unwrap();
            let synced = m.grads();
            let report = (m.last_sync_buckets(), m.last_sync_in_place());
            let unscale_overflow = acc.unscale_gradients(&mut m).unwrap();
            // Unscaled by 1/65536 (fp16): a norm of about 0.0034; clip to 1e-3.
            let norm = acc.clip_grad_norm(&mut m, 1e-3, 2.0).unwrap();
            let clipped = m.grads();
            let mut opt = acc.prepare_optimizer(Sgd::new(0.1)).unwrap();
            zero_grads(&mut *m);
            let zeroed = m.grads();
            let _ = opt.zero_grad(&mut m);
            (
                values,
                synced,
                report,
                unscale_overflow,
                norm,
                clipped,
                zeroed,
                host_calls.load(Ordering::Relaxed),
            )
        });
        let (v0, g0, report, overflow, norm, clipped, zeroed, host) = &got[0];
        assert_eq!(v0, &got[1].0, "prepare broadcast rank 0's device values");
        // Gradients (j + 1) * (1 + rank): the average is 1.5 * (j + 1).
        for (i, g) in g0.iter().enumerate() {
            let want: Vec<f32> = (0..g.len()).map(|j| 1.5 * (j as f32 + 1.0)).collect();
            assert_eq!(g, &want, "parameter {i}, native avg {native_avg}");
        }
        assert_eq!(g0, &got[1].1);
        assert_eq!(*report, (2, 1), "two buckets, the large gradient in place");
        assert!(!overflow);
        assert_eq!(
            norm.to_bits(),
            got[1].4.to_bits(),
            "the same norm on both ranks"
        );
        let synced_norm = l2_norm(g0);
        assert!(
            (norm - synced_norm / 65536.0).abs() < 1e-9,
            "the norm of the unscaled gradients: {norm} vs {}",
            synced_norm / 65536.0
        );
        let after = l2_norm(clipped);
        // torch: max_norm / (norm + 1e-6), so a hair under the limit.
        assert!((after - 1e-3).abs() < 1e-6, "clipped to {after}");
        assert!(zeroed.iter().flatten().all(|x| *x == 0.0));
        assert_eq!(*host, 0, "no gradient or value went through host memory");
    }
}

#[test]
fn a_device_model_is_checkpointed_through_its_kernels() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    ranks(1, move |acc| {
        let (acc, mem, _) = on_device(acc, true);
        let mut m = acc
            .prepare_model(DevModel::new(mem.clone(), &[3], 0))
            .unwrap();
        let before = m.values();
        acc.save_state(path.join("c"), &[&m]).unwrap();
        mem.with(m.params[0].1, |v| v.fill(9.0));
        acc.load_state(path.join("c"), &mut [&mut m]).unwrap();
        assert_eq!(m.values(), before);
        assert!(m.grads()[0].iter().all(|g| *g == 0.0), "gradients zeroed");
        // The reference Sgd needs host values and says so.
        let mut opt = acc.prepare_optimizer(Sgd::new(0.1)).unwrap();
        acc.accumulate_step(false);
        let e = opt.step(&mut m).unwrap_err();
        assert!(e.to_string().contains("\"p0\""), "{e}");
    });
}

/// [`DevModel`] without its kernels: device views the facade cannot touch.
struct NoKernels(DevModel);

impl Parameters for NoKernels {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        self.0.visit_params(f)
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        self.0.visit_params_mut(f)
    }
}

#[test]
fn a_device_model_without_kernels_is_refused_by_prepare() {
    ranks(2, move |acc| {
        // Both ranks connected before either refuses and drops its
        // communicator (which would break the other's connect).
        acc.wait_for_everyone().unwrap();
        let (acc, mem, _) = on_device(acc, true);
        let e = acc
            .prepare_model(NoKernels(DevModel::new(mem, &[3, 2], acc.rank())))
            .unwrap_err();
        assert_eq!(e.kind(), &accel::ErrorKind::Unsupported, "{e}");
        let text = e.to_string();
        assert!(text.contains("prepare_model"), "{text}");
        assert!(text.contains("\"p0\""), "{text}");
        assert!(text.contains("grad_kernels"), "{text}");
    });
}
