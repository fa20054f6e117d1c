//! libtorch's gradient-accumulator hooks ([`TchModel::backward_reporting`]):
//!
//! * one backward reports every parameter it reaches exactly once, in
//!   reverse topological order (the last layer first), from inside
//!   `backward()` (the first layer's gradient is still zero when the last
//!   layer is reported), with one hook per parameter while it runs and
//!   none after (a later plain backward reports nothing); the gradients
//!   are those of a plain `backward()`, bit for bit;
//! * a gate's error is returned after a complete backward, naming the
//!   parameter whose hook reported it; a gate's panic is resumed after the
//!   backward; a loss without a gradient is an error; a parameter frozen
//!   after wrapping is an error naming it, before any backward; all with
//!   the hooks removed;
//! * 20 steps on 2 ranks with several buckets, over cpu-gloo (threads) and
//!   mpi (`mpirun -n 2` of this binary, when Open MPI is installed): the
//!   overlapped synchronisation (buckets started from the hooks) gives the
//!   parameters of the blocking one and of a plain `acc.backward`, bit for
//!   bit, in f32 and with bf16 compression, and buckets started before the
//!   backward returned.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use accel::train::{Parameters, Sgd, TrainConfig};
use accel::zero::UnitGate;
use accel::{Accelerator, DType, Error, ErrorKind, Result};
use accel_tch::ffi::grad_post_hooks;
use accel_tch::TchModel;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

use accel_test_support::child;
mod common;
use accel_test_support::ranks;
use accel_test_support::skips;
use common::det;
use ranks::two_ranks;

const IN: i64 = 4;
const HIDDEN: i64 = 8;
const BS: usize = 3;
const STEPS: usize = 20;

/// `a` (IN → HIDDEN, tanh), `b` (HIDDEN → HIDDEN, tanh), `c` (HIDDEN → 1);
/// the model of [`build`] may also hold `unused`, which the loss does not
/// depend on.
struct Net {
    a: nn::Linear,
    b: nn::Linear,
    c: nn::Linear,
}

impl Net {
    fn loss(&self, x: &Tensor, y: &Tensor) -> Tensor {
        let h = self.b.forward(&self.a.forward(x).tanh()).tanh();
        (self.c.forward(&h) - y)
            .pow_tensor_scalar(2)
            .mean(Kind::Float)
    }
}

/// The model with fixed weights (no draw from libtorch's global generator,
/// which the rank threads share), its network, and a handle to each
/// variable by name. With `unused`, the model also holds a layer the loss
/// does not depend on: it is never reported, so its gradients are final
/// only when the backward returns (it is visited last, so it would hold
/// back DDP's first bucket and every bucket after it).
fn build_with(unused: bool) -> (TchModel, Net, Vec<(String, Tensor)>) {
    let vs = nn::VarStore::new(Device::Cpu);
    let lin = |name: &str, i, o| nn::linear(vs.root() / name, i, o, Default::default());
    let net = Net {
        a: lin("a", IN, HIDDEN),
        b: lin("b", HIDDEN, HIDDEN),
        c: lin("c", HIDDEN, 1),
    };
    if unused {
        let _ = lin("unused", 2, 2);
    }
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|x, y| x.0.cmp(&y.0));
    tch::no_grad(|| {
        for (i, (_, t)) in vars.iter_mut().enumerate() {
            let v: Vec<f32> = (0..t.numel()).map(|j| 0.5 * det(i + 1, j)).collect();
            t.copy_(&Tensor::from_slice(&v).view(t.size().as_slice()));
        }
    });
    (TchModel::new(vs).expect("a CPU f32 model"), net, vars)
}

/// The model of [`build_with`], with an `unused` layer.
fn build() -> (TchModel, Net, Vec<(String, Tensor)>) {
    build_with(true)
}

/// Samples `range`: inputs (`len × IN`) and targets.
fn samples(range: std::ops::Range<usize>) -> (Tensor, Tensor) {
    let len = range.len() as i64;
    let x: Vec<f32> = range
        .clone()
        .flat_map(|i| (0..IN as usize).map(move |j| det(1000 + i, j)))
        .collect();
    let y: Vec<f32> = range.map(|i| (det(2000 + i, 0) * 2.0).sin()).collect();
    (
        Tensor::from_slice(&x).view([len, IN]),
        Tensor::from_slice(&y).view([len, 1]),
    )
}

fn grads(model: &dyn Parameters) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| out.push((p.name.to_string(), p.grad_f32().unwrap().to_vec())));
    out
}

fn values(model: &dyn Parameters) -> Vec<f32> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| out.extend_from_slice(p.value_f32().unwrap()));
    out
}

fn hooks_on(vars: &[(String, Tensor)]) -> Vec<usize> {
    vars.iter()
        .map(|(_, t)| grad_post_hooks(t).unwrap())
        .collect()
}

/// Records each report: the name, the sum of `|a.weight.grad|` then, and
/// the hooks armed on every variable then; fails or panics on a chosen
/// report.
#[derive(Default)]
struct Recorder {
    vars: Vec<(String, Tensor)>,
    reports: Vec<(String, f32, Vec<usize>)>,
    fail_at: Option<usize>,
    panic_at: Option<usize>,
}

impl UnitGate for Recorder {
    fn gather(&mut self, _: &mut dyn Parameters, _: &str) -> Result<()> {
        Ok(())
    }
    fn release(&mut self, _: &mut dyn Parameters, _: &str) -> Result<()> {
        Ok(())
    }
    fn reduce_grads(&mut self, model: &mut dyn Parameters, name: &str) -> Result<()> {
        let mut first = 0.0;
        model.visit_params(&mut |p| {
            if p.name == "a.weight" {
                first = p.grad_f32().unwrap().iter().map(|g| g.abs()).sum();
            }
        });
        self.reports
            .push((name.to_string(), first, hooks_on(&self.vars)));
        let n = self.reports.len();
        if self.panic_at == Some(n) {
            panic!("the gate panics at report {n}");
        }
        if self.fail_at == Some(n) {
            return Err(Error::new(
                ErrorKind::Backend,
                format!("the gate fails at report {n}"),
            ));
        }
        Ok(())
    }
}

/// The gradients of one plain `backward()` of the first batch.
fn plain_grads() -> Vec<(String, Vec<f32>)> {
    let (model, net, _) = build();
    let (x, y) = samples(0..BS);
    net.loss(&x, &y).backward();
    grads(&model)
}

#[test]
fn every_parameter_is_reported_once_from_inside_the_backward_last_layer_first() {
    let (mut model, net, vars) = build();
    assert!(
        hooks_on(&vars).iter().all(|&h| h == 0),
        "no hook before: {:?}",
        hooks_on(&vars)
    );
    let mut gate = Recorder {
        vars: vars
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect(),
        ..Recorder::default()
    };
    let (x, y) = samples(0..BS);
    model
        .backward_reporting(&net.loss(&x, &y), &mut gate)
        .unwrap();
    let names: Vec<&str> = gate.reports.iter().map(|r| r.0.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        ["a.bias", "a.weight", "b.bias", "b.weight", "c.bias", "c.weight"],
        "each parameter the loss reaches, once; not `unused`: {names:?}"
    );
    let layer = |n: &str| n.split('.').next().unwrap().to_string();
    let layers: Vec<String> = names.iter().map(|n| layer(n)).collect();
    let mut want = layers.clone();
    want.sort_by(|p, q| q.cmp(p));
    assert_eq!(layers, want, "reverse topological order: c, b, then a");
    // From inside backward(): `a` had no gradient yet when `c` was
    // reported, and one hook per variable was armed meanwhile.
    let (first, a_then, hooks_then) = &gate.reports[0];
    assert!(first.starts_with("c."), "{first}");
    assert_eq!(*a_then, 0.0, "a.weight's gradient before a's backward");
    let a_weight = gate.reports.iter().find(|r| r.0 == "a.weight").unwrap();
    assert!(a_weight.1 > 0.0, "a.weight's gradient when it is reported");
    assert!(hooks_then.iter().all(|&h| h == 1), "{hooks_then:?}");
    assert_eq!(
        grads(&model),
        plain_grads(),
        "the gradients of a plain backward()"
    );
    // No hook remains: a second, plain backward reports nothing.
    assert!(
        hooks_on(&vars).iter().all(|&h| h == 0),
        "{:?}",
        hooks_on(&vars)
    );
    let (x, y) = samples(BS..2 * BS);
    net.loss(&x, &y).backward();
    assert_eq!(gate.reports.len(), 6, "a plain backward reported something");
    // And a second reporting backward reports every parameter again.
    model
        .backward_reporting(&net.loss(&x, &y), &mut gate)
        .unwrap();
    assert_eq!(gate.reports.len(), 12);
}

#[test]
fn a_gate_error_is_returned_after_a_complete_backward() {
    let (mut model, net, vars) = build();
    let mut gate = Recorder {
        fail_at: Some(2),
        ..Recorder::default()
    };
    let (x, y) = samples(0..BS);
    let e = model
        .backward_reporting(&net.loss(&x, &y), &mut gate)
        .unwrap_err();
    assert!(e.to_string().contains("the gate fails at report 2"), "{e}");
    let second = &gate.reports[1].0;
    assert!(
        e.to_string()
            .contains(&format!("the gradient hook of parameter {second:?}")),
        "the error names the parameter: {e}"
    );
    assert_eq!(
        gate.reports.len(),
        2,
        "the gate is not called after an error"
    );
    assert_eq!(grads(&model), plain_grads(), "the backward completed");
    assert!(hooks_on(&vars).iter().all(|&h| h == 0));
}

#[test]
fn a_gate_panic_is_resumed_after_the_backward_with_the_hooks_removed() {
    let (mut model, net, vars) = build();
    let mut gate = Recorder {
        panic_at: Some(3),
        ..Recorder::default()
    };
    let (x, y) = samples(0..BS);
    let loss = net.loss(&x, &y);
    let p = catch_unwind(AssertUnwindSafe(|| {
        model.backward_reporting(&loss, &mut gate)
    }))
    .unwrap_err();
    let msg = p.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("panics at report 3"), "{msg:?}");
    assert_eq!(gate.reports.len(), 3, "no report after the panic");
    assert_eq!(grads(&model), plain_grads(), "the backward completed");
    assert!(hooks_on(&vars).iter().all(|&h| h == 0));
}

#[test]
fn a_loss_without_a_gradient_is_an_error_and_leaves_no_hook() {
    let (mut model, net, vars) = build();
    let (x, y) = samples(0..BS);
    let loss = tch::no_grad(|| net.loss(&x, &y));
    let e = model
        .backward_reporting(&loss, &mut Recorder::default())
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Backend), "{e}");
    assert!(e.to_string().contains("libtorch backward"), "{e}");
    assert!(hooks_on(&vars).iter().all(|&h| h == 0));
}

#[test]
fn a_parameter_frozen_after_wrapping_is_an_error_naming_it() {
    let (mut model, net, vars) = build();
    let before = grads(&model);
    let b_weight = vars.iter().find(|(n, _)| n == "b.weight").unwrap();
    let _ = b_weight.1.set_requires_grad(false);
    let (x, y) = samples(0..BS);
    let mut gate = Recorder::default();
    let e = model
        .backward_reporting(&net.loss(&x, &y), &mut gate)
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidArgument), "{e}");
    assert!(e.to_string().contains("\"b.weight\""), "{e}");
    assert!(e.to_string().contains("does not require a gradient"), "{e}");
    assert!(gate.reports.is_empty(), "nothing was reported");
    assert_eq!(grads(&model), before, "no backward ran");
    assert!(hooks_on(&vars).iter().all(|&h| h == 0));
}

/// How a rank's step runs its backward.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// `backward_overlapped` with the hooks reporting to its gate.
    Overlapped,
    /// The same with `overlap_grad_sync` off.
    Blocking,
    /// `acc.backward` around a plain `backward()`.
    Plain,
}

/// One rank's 20 steps: the parameters, and the buckets started before
/// the backward returned.
fn run(acc: &Accelerator, sync: Mode, compress: Option<DType>) -> Result<(Vec<f32>, usize)> {
    acc.set_training_config(TrainConfig {
        bucket_cap_bytes: 128,
        first_bucket_cap_bytes: 32,
        overlap_grad_sync: sync == Mode::Overlapped,
        gradient_compression: compress,
        ..TrainConfig::default()
    })?;
    let (model, net, _) = build_with(false);
    let mut model = acc.prepare_model(model)?;
    let mut opt = acc.prepare_optimizer(Sgd::new(0.1).with_momentum(0.9))?;
    let (n, rank) = (acc.world_size(), acc.rank());
    let mut early = 0;
    for s in 0..STEPS {
        let start = (s * n + rank) * BS;
        let (x, y) = samples(start..start + BS);
        acc.accumulate_step(false);
        let loss = net.loss(&x, &y);
        if sync == Mode::Plain {
            acc.backward(&mut model, |_, scale| (&loss * f64::from(scale)).backward())?;
        } else {
            acc.backward_overlapped(&mut model, |m, scale, gate| {
                m.backward_reporting(&(&loss * f64::from(scale)), gate)
            })??;
        }
        early += model.last_sync_started_early();
        opt.step(&mut model)?;
        opt.zero_grad(&mut model);
    }
    Ok((values(&*model), early))
}

#[test]
fn overlapped_and_blocking_sync_give_the_same_parameters_on_two_ranks() {
    tch::set_num_threads(1);
    let start = values(&build_with(false).0);
    for compress in [None, Some(DType::BF16)] {
        let runs: Vec<Vec<(Vec<f32>, usize)>> = [Mode::Overlapped, Mode::Blocking, Mode::Plain]
            .into_iter()
            .map(|sync| two_ranks(move |acc| run(acc, sync, compress)))
            .collect();
        let (overlapped, blocking, plain) = (&runs[0], &runs[1], &runs[2]);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let want = bits(&plain[0].0);
        assert_ne!(bits(&start), want, "{compress:?}: the run trained");
        for (sync, ranks) in [
            ("overlapped", overlapped),
            ("blocking", blocking),
            ("plain", plain),
        ] {
            for (rank, (params, _)) in ranks.iter().enumerate() {
                assert_eq!(
                    bits(params),
                    want,
                    "{compress:?}: {sync} rank {rank} differs from plain rank 0"
                );
            }
        }
        for (rank, (_, early)) in overlapped.iter().enumerate() {
            assert!(
                *early > 0,
                "{compress:?}: rank {rank} started no bucket during a backward"
            );
        }
        assert!(blocking.iter().chain(plain).all(|(_, early)| *early == 0));
    }
}

/// Where [`mpi_rank`] writes its results; set only for the ranks that
/// [`overlapped_and_blocking_sync_give_the_same_parameters_on_mpi`]
/// starts.
const MPI_OUT: &str = "ACCEL_TCH_OVERLAP_MPI_OUT";

const MODES: [Mode; 3] = [Mode::Overlapped, Mode::Blocking, Mode::Plain];
const COMPRESSIONS: [Option<DType>; 2] = [None, Some(DType::BF16)];

/// One rank under mpirun (nothing otherwise): every mode and compression
/// on the mpi engine, each on a fresh accelerator over the one world
/// communicator; a line per run in `$ACCEL_TCH_OVERLAP_MPI_OUT/rank<r>`:
/// the mode, the compression, the buckets started early and the
/// parameters' bits.
#[test]
fn mpi_rank() {
    let Some(out) = std::env::var_os(MPI_OUT) else {
        return;
    };
    tch::set_num_threads(1);
    let base = Accelerator::new().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(base.backend_name(), "mpi");
    let mut lines = String::new();
    for compress in COMPRESSIONS {
        for mode in MODES {
            let acc = Accelerator::from_communicator(base.comm().clone(), base.store().clone())
                .unwrap_or_else(|e| panic!("{e}"));
            let (params, early) = run(&acc, mode, compress).unwrap_or_else(|e| panic!("{e}"));
            let bits: Vec<String> = params
                .iter()
                .map(|v| format!("{:08x}", v.to_bits()))
                .collect();
            lines += &format!("{mode:?} {compress:?} {early} {}\n", bits.join(","));
        }
    }
    let path = Path::new(&out).join(format!("rank{}", base.rank()));
    std::fs::write(&path, lines).unwrap();
}

#[test]
fn overlapped_and_blocking_sync_give_the_same_parameters_on_mpi() {
    if std::env::var_os(MPI_OUT).is_some() || !skips::mpirun_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("mpirun");
    skips::allow_root(&mut cmd);
    cmd.args(["--oversubscribe", "-n", "2"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "mpi_rank", "--nocapture", "--test-threads=1"])
        .env(MPI_OUT, dir.path())
        .env("ACCEL_BACKEND", "mpi")
        .env("OMPI_MCA_mpi_yield_when_idle", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut ranks = cmd.spawn().expect("mpirun starts");
    let status = child::wait_within(&mut ranks, Duration::from_secs(120));
    let text = child::output_text(&ranks.wait_with_output().unwrap());
    assert!(
        status.is_some_and(|s| s.success()),
        "mpirun -n 2 ({status:?}):\n{text}"
    );
    // Per rank: (mode, compression) -> (early, bits).
    let read = |rank: usize| -> Vec<(String, String, usize, String)> {
        let path = dir.path().join(format!("rank{rank}"));
        let body = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()));
        body.lines()
            .map(|l| {
                let f: Vec<&str> = l.splitn(4, ' ').collect();
                (f[0].into(), f[1].into(), f[2].parse().unwrap(), f[3].into())
            })
            .collect()
    };
    let (r0, r1) = (read(0), read(1));
    assert_eq!(r0.len(), MODES.len() * COMPRESSIONS.len());
    for (i, run) in r0.iter().chain(&r1).enumerate() {
        let (mode, compress, early, bits) = run;
        // The plain run of the same compression, on rank 0.
        let plain = r0
            .iter()
            .find(|p| p.0 == "Plain" && &p.1 == compress)
            .unwrap();
        assert_eq!(
            bits,
            &plain.3,
            "{compress}: {mode} on rank {} differs from plain rank 0",
            i / r0.len()
        );
        match mode.as_str() {
            "Overlapped" => assert!(*early > 0, "{compress}: {mode} started no bucket early"),
            _ => assert_eq!(*early, 0, "{compress}: {mode}"),
        }
    }
    let start: Vec<String> = values(&build_with(false).0)
        .iter()
        .map(|v| format!("{:08x}", v.to_bits()))
        .collect();
    assert_ne!(start.join(","), r0[0].3, "the run trained");
}
