//! The adapters on one process (the `single` backend): views alias tensor
//! memory, every dtype round-trips through the tensor collectives, a
//! VarStore trains through the prepared wrappers and checkpoints restore
//! it exactly.

use accel::train::{GradKernels, MixedPrecision, Optimizer, Parameters, TrainConfig};
use accel::{Accelerator, ReduceOp};
use accel_tch::{ffi, set_seed, AdamW, TchModel, TchOptimizer, TensorCollectives};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// libtorch's generator is global and the tests run in parallel threads:
/// whoever seeds it, or draws from it (layer initialisation), holds this.
fn rng() -> std::sync::MutexGuard<'static, ()> {
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    RNG.lock().unwrap_or_else(|e| e.into_inner())
}

fn acc() -> Accelerator {
    // No launcher variables: one process, the exact `single` backend.
    Accelerator::new().expect("a one-process accelerator")
}

#[test]
fn host_views_alias_the_tensor_memory() {
    let mut t = Tensor::arange(6, (Kind::Float, Device::Cpu));
    {
        let s = ffi::host_slice_mut::<f32>(&mut t).unwrap();
        assert_eq!(s, &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        s[2] = 42.0;
    }
    assert_eq!(t.double_value(&[2]), 42.0);
    // A view of a column slice is refused, not silently wrong.
    let m = Tensor::zeros([3, 4], (Kind::Float, Device::Cpu));
    let col = m.narrow(1, 1, 1);
    assert!(ffi::host_view(&col).is_err());
    // A wrong element type is refused.
    assert!(ffi::host_slice::<f64>(&t).is_err());
    // A row slice is contiguous: its view starts at the storage offset.
    let rows = Tensor::arange(12, (Kind::Int64, Device::Cpu)).view([3, 4]);
    let second = rows.narrow(0, 1, 1);
    assert_eq!(ffi::host_slice::<i64>(&second).unwrap(), &[4, 5, 6, 7]);
    // An empty tensor's view is an empty slice of its element type.
    let mut empty = Tensor::zeros([0], (Kind::Float, Device::Cpu));
    assert!(ffi::host_slice::<f32>(&empty).unwrap().is_empty());
    assert!(ffi::host_slice_mut::<f32>(&mut empty).unwrap().is_empty());
    // Unsupported kinds and CUDA views on the CPU are typed errors.
    let b = Tensor::zeros([2], (Kind::Bool, Device::Cpu));
    assert_eq!(
        ffi::host_view(&b).unwrap_err().kind(),
        &accel::ErrorKind::Unsupported
    );
    assert!(ffi::device_view(&t).is_err());
}

#[test]
fn every_dtype_round_trips_through_the_collectives() {
    let acc = acc();
    for kind in [
        Kind::Half,
        Kind::BFloat16,
        Kind::Float,
        Kind::Double,
        Kind::Int8,
        Kind::Uint8,
        Kind::Int,
        Kind::Int64,
    ] {
        let t = Tensor::arange(6, (kind, Device::Cpu)).view([3, 2]);
        let g = acc.gather_tensor(&t).unwrap();
        assert_eq!(g.size(), vec![3, 2], "{kind:?}");
        assert_eq!(g.kind(), kind);
        assert!(g.equal(&t), "{kind:?}");
        let r = acc.reduce_tensor(&t, "sum").unwrap();
        assert!(r.equal(&t), "{kind:?}");
        let mut a = t.copy();
        acc.all_reduce_tensor(&mut a, ReduceOp::Sum).unwrap();
        assert!(a.equal(&t), "{kind:?}");
        let p = acc.pad_tensor_across_processes(&t, 0, 0.0, false).unwrap();
        assert!(p.equal(&t), "{kind:?}");
    }
    assert!(acc
        .reduce_tensor(&Tensor::from_slice(&[1.0f32]), "median")
        .is_err());
}

#[test]
fn non_contiguous_tensors_are_gathered_from_a_copy() {
    let acc = acc();
    let t = Tensor::arange(6, (Kind::Float, Device::Cpu))
        .view([2, 3])
        .transpose(0, 1);
    let g = acc.gather_tensor(&t).unwrap();
    assert!(g.equal(&t));
    let s = acc.gather_tensor(&Tensor::from(3.5f64)).unwrap();
    assert_eq!(s.size(), vec![1]);
}

fn net(vs: &nn::Path<'_>) -> impl Module {
    nn::seq()
        .add(nn::linear(vs / "a", 4, 8, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(vs / "b", 8, 1, Default::default()))
}

#[test]
fn var_store_parameters_are_views_with_defined_gradients() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = {
        let _rng = rng();
        net(&vs.root())
    };
    let model = TchModel::new(vs).unwrap();
    let mut names = Vec::new();
    model.visit_params(&mut |p| {
        assert_eq!(p.value.len(), p.grad.len());
        assert!(p.grad_f32().unwrap().iter().all(|&g| g == 0.0));
        names.push(p.name.to_string());
    });
    assert_eq!(names, ["a.bias", "a.weight", "b.bias", "b.weight"]);
    assert_eq!(model.num_params(), 8 + 32 + 1 + 8);
    assert!(model.grad_kernels().is_none(), "CPU tensors are host views");
    // bf16 variables are bf16 host views.
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = vs.root().zeros("w", &[2]);
    let mut vs = vs;
    vs.bfloat16();
    let model = TchModel::new(vs).unwrap();
    model.visit_params(&mut |p| {
        assert_eq!(p.value.dtype(), accel::DType::BF16);
        assert_eq!(p.grad.dtype(), accel::DType::BF16);
    });
}

/// Train a few steps through the prepared wrappers; return the parameters.
fn train(acc: &Accelerator, steps: usize, adamw: bool) -> (Vec<f32>, accel::train::StateDict) {
    let _rng = rng();
    set_seed(acc, 7, false);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = net(&vs.root());
    let opt: Box<dyn Optimizer> = if adamw {
        Box::new(AdamW::new(0.01))
    } else {
        Box::new(TchOptimizer::new(&vs, nn::Sgd::default(), 0.1).unwrap())
    };
    let mut model = acc.prepare_model(TchModel::new(vs).unwrap()).unwrap();
    let mut opt = acc.prepare_optimizer(BoxOpt(opt)).unwrap();
    let x = Tensor::from_slice(&[0.1f32, -0.2, 0.3, 0.5, 1.0, 0.0, -1.0, 0.25]).view([2, 4]);
    let y = Tensor::from_slice(&[1.0f32, -1.0]).view([2, 1]);
    for _ in 0..steps {
        acc.accumulate_step(false);
        acc.backward(&mut model, |_, scale| {
            let loss = (net.forward(&x) - &y).square().mean(Kind::Float);
            (&loss * f64::from(scale)).backward();
        })
        .unwrap();
        assert!(opt.step(&mut model).unwrap());
        opt.zero_grad(&mut model);
    }
    let mut out = Vec::new();
    model.visit_params(&mut |p| out.extend_from_slice(p.value_f32().unwrap()));
    (out, opt.state_dict())
}

struct BoxOpt(Box<dyn Optimizer>);
impl Optimizer for BoxOpt {
    fn step(&mut self, p: &mut dyn Parameters) -> accel::Result<()> {
        self.0.step(p)
    }
    fn lr(&self) -> f64 {
        self.0.lr()
    }
    fn set_lr(&mut self, lr: f64) {
        self.0.set_lr(lr)
    }
    fn state_dict(&self) -> accel::train::StateDict {
        self.0.state_dict()
    }
    fn load_state_dict(&mut self, s: &accel::train::StateDict) -> accel::Result<()> {
        self.0.load_state_dict(s)
    }
}

#[test]
fn prepared_libtorch_sgd_and_adamw_reduce_the_loss_and_are_deterministic() {
    let acc = acc().with_training(TrainConfig::default()).unwrap();
    for adamw in [false, true] {
        let (a, state) = train(&acc, 5, adamw);
        let (b, _) = train(&acc, 5, adamw);
        assert_eq!(a, b, "adamw={adamw}: same seed, same parameters");
        let steps: u64 = state.get("steps").unwrap();
        assert_eq!(steps, 5);
        if adamw {
            assert_eq!(state.tensors.len(), 8, "two moments per parameter");
        }
    }
}

#[test]
fn checkpoints_restore_the_var_store_and_adamw_exactly() {
    let acc = acc().with_training(TrainConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let _rng = rng();
    set_seed(&acc, 3, false);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = net(&vs.root());
    let mut model = acc.prepare_model(TchModel::new(vs).unwrap()).unwrap();
    let mut opt = acc.prepare_optimizer(AdamW::new(0.05)).unwrap();
    let x = Tensor::from_slice(&[0.5f32, 0.1, -0.3, 0.9]).view([1, 4]);
    let step = |model: &mut accel::train::PreparedModel<TchModel>,
                opt: &mut accel::train::PreparedOptimizer<AdamW>| {
        acc.accumulate_step(false);
        acc.backward(model, |_, s| {
            (net.forward(&x).sum(Kind::Float) * f64::from(s)).backward()
        })
        .unwrap();
        opt.step(model).unwrap();
        opt.zero_grad(model);
    };
    step(&mut model, &mut opt);
    let saved = acc.save_state(dir.path(), &[&model, &opt]).unwrap();
    // The VarStore's variables and AdamW's moments, in safetensors.
    assert!(saved.join("model_0.safetensors").is_file());
    assert!(saved.join("optimizer_0.safetensors").is_file());
    let snapshot = |m: &TchModel| {
        let mut v = Vec::new();
        m.visit_params(&mut |p| v.extend_from_slice(p.value_f32().unwrap()));
        v
    };
    step(&mut model, &mut opt);
    let after_two = snapshot(&model);
    // Scribble over the parameters, restore, and take the second step again.
    tch::no_grad(|| {
        for (_, p) in model.named_parameters() {
            let _ = p.shallow_clone().fill_(9.0);
        }
    });
    acc.load_state(&saved, &mut [&mut model, &mut opt]).unwrap();
    step(&mut model, &mut opt);
    assert_eq!(snapshot(&model), after_two);
}

#[test]
fn autocast_runs_linear_layers_in_bf16_on_the_cpu_and_returns_f32() {
    let vs = nn::VarStore::new(Device::Cpu);
    let lin = {
        let _rng = rng();
        nn::linear(vs.root() / "l", 4, 3, Default::default())
    };
    let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
    assert!(!accel_tch::autocast_enabled(false));
    let inside = accel_tch::autocast_with(MixedPrecision::Bf16, Device::Cpu, || {
        (accel_tch::autocast_enabled(false), lin.forward(&x))
    })
    .unwrap();
    assert!(inside.0, "autocast was on inside the region");
    assert_eq!(
        inside.1.kind(),
        Kind::BFloat16,
        "a linear layer under CPU autocast"
    );
    assert!(!accel_tch::autocast_enabled(false), "and off after it");
    let plain =
        accel_tch::autocast_with(MixedPrecision::No, Device::Cpu, || lin.forward(&x)).unwrap();
    assert_eq!(plain.kind(), Kind::Float);
    // autocast_forward converts the output back to f32, close to the f32 result.
    let acc = acc();
    acc.set_training_config(TrainConfig {
        mixed_precision: Some(MixedPrecision::Bf16),
        ..TrainConfig::default()
    })
    .unwrap();
    let out = accel_tch::autocast_forward(&acc, Device::Cpu, || lin.forward(&x)).unwrap();
    assert_eq!(out.kind(), Kind::Float);
    let diff = (&out - &plain).abs().max().double_value(&[]);
    assert!(diff < 0.05, "bf16 forward differs from f32 by {diff}");
}

#[test]
fn tch_kernels_scale_measure_clamp_and_copy_device_views() {
    // The kernels take device views; a CPU tensor seen as a "device" view
    // of the CPU exercises the same libtorch code path as CUDA memory.
    let k = accel_tch::TchKernels;
    let mut t = Tensor::from_slice(&[3.0f32, -4.0, 0.0, 12.0]);
    fn view(t: &mut Tensor) -> accel::DeviceBufMut<'_> {
        let addr = t.data_ptr() as u64;
        // SAFETY: (a test) `t` is a contiguous CPU f32 tensor of 4 elements,
        // borrowed mutably (alive, unaliased) for the view's lifetime.
        unsafe {
            accel::DeviceBufMut::from_raw(t, addr, 4, accel::DType::F32, accel::Device::CPU, 0)
        }
    }
    let s = k.stats(view(&mut t).as_buf(), 2.0).unwrap();
    assert_eq!(s.norm_part, 9.0 + 16.0 + 144.0);
    assert!(!s.non_finite);
    assert_eq!(
        k.stats(view(&mut t).as_buf(), f64::INFINITY)
            .unwrap()
            .norm_part,
        12.0
    );
    k.scale(view(&mut t), 0.5).unwrap();
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![1.5, -2.0, 0.0, 6.0]);
    k.clamp(view(&mut t), 1.0).unwrap();
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![1.0, -1.0, 0.0, 1.0]);
    let mut host = vec![0f32; 2];
    k.copy(
        accel::Buf::Device(view(&mut t).as_buf()),
        1,
        accel::BufMut::from(&mut host[..]),
        0,
        2,
    )
    .unwrap();
    assert_eq!(host, vec![-1.0, 0.0]);
    k.fill(view(&mut t), f64::NAN).unwrap();
    assert!(k.stats(view(&mut t).as_buf(), 2.0).unwrap().non_finite);
}

/// accel's loss scaler against libtorch's own kernels, the ones torch's
/// `GradScaler` runs: `_amp_update_scale_` for `update()` (an f32 scale
/// tensor, an int32 tracker, the factors as doubles) and
/// `_scale.double().reciprocal().float()` for the unscaling factor. Factors
/// 1.5 and 0.9 and a random overflow pattern: every step bit for bit.
#[test]
fn the_loss_scaler_follows_libtorchs_grad_scaler_kernels_step_for_step() {
    use accel::train::{GradScaler, GradScalerConfig};
    let c = GradScalerConfig {
        init_scale: 16777216.0,
        growth_factor: 1.5,
        backoff_factor: 0.9,
        growth_interval: 3,
    };
    let mut ours = GradScaler::new(c);
    // torch.full((), init_scale, dtype=torch.float32) and an int32 tracker.
    let mut scale = Tensor::from_slice(&[c.init_scale as f32]);
    let tracker = Tensor::from_slice(&[0i32]);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut overflows = 0;
    for step in 0..400 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let found_inf = rng.is_multiple_of(4);
        overflows += usize::from(found_inf);
        let found = Tensor::from_slice(&[if found_inf { 1.0f32 } else { 0.0 }]);
        let _ = scale.internal_amp_update_scale_(
            &tracker,
            &found,
            c.growth_factor,
            c.backoff_factor,
            c.growth_interval as i64,
        );
        ours.update(found_inf);
        let torch_scale = scale.double_value(&[0]) as f32;
        let torch_tracker = tracker.int64_value(&[0]) as u64;
        assert_eq!(
            (ours.scale.to_bits(), ours.growth_tracker),
            (torch_scale.to_bits(), torch_tracker),
            "step {step}: accel {} / {}, libtorch {torch_scale} / {torch_tracker}",
            ours.scale,
            ours.growth_tracker
        );
        let inv = scale
            .to_kind(Kind::Double)
            .reciprocal()
            .to_kind(Kind::Float)
            .double_value(&[0]) as f32;
        assert_eq!(ours.inv_scale().to_bits(), inv.to_bits(), "step {step}");
    }
    assert!(overflows > 50, "{overflows}");
}

#[test]
fn a_tch_model_uses_the_mixed_precision_it_is_given() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _ = nn::linear(vs.root() / "fc", 3, 2, Default::default());
    let acc = acc();
    acc.set_training_config(TrainConfig {
        mixed_precision: Some(MixedPrecision::Bf16),
        strict: true,
        ..TrainConfig::default()
    })
    .unwrap();
    // Strict: a setting that does not apply would be an error here.
    acc.prepare_model(TchModel::new(vs).unwrap()).unwrap();
    assert!(acc.settings_not_applied().is_empty());
}
