//! Gradients as views (mixed dtypes, bucketing, compression), fp16 loss
//! scaling with steps skipped on every rank together, and clipping. Threads
//! as ranks on cpu-gloo, each run under a hard deadline.

use accel::train::*;
use accel::Accelerator;
use half::f16;

mod common;
use common::{ranks, single, Data, Linear};

/// All-reduce `m`'s gradients; the buckets used and those reduced in place.
fn sync<M: Parameters>(m: &mut PreparedModel<M>) -> (usize, usize) {
    m.all_reduce_gradients().unwrap();
    (m.last_sync_buckets(), m.last_sync_in_place())
}

/// `Linear` with an f64 bias and its gradient: two dtypes in one model.
#[derive(Clone, Debug, PartialEq)]
struct Mixed {
    w: Vec<f32>,
    gw: Vec<f32>,
    b: Vec<f64>,
    gb: Vec<f64>,
}

common::host_parameters!(Mixed { "w": w, gw; "b": b, gb; });

/// f32 master weights with f16 gradients (what an fp16 framework hands).
#[derive(Clone, Debug, PartialEq)]
struct Half {
    w: Vec<f32>,
    gw: Vec<f16>,
}

impl Half {
    /// Gradient of `sum_i (w_i - target_i)^2 / 2`, times `scale`, added in f16.
    fn grad(&mut self, target: &[f32], scale: f32) {
        for ((g, w), t) in self.gw.iter_mut().zip(&self.w).zip(target) {
            *g = f16::from_f32(g.to_f32() + scale * (w - t));
        }
    }
}

impl Parameters for Half {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        f(ParamRef::host("w", &self.w, &self.gw));
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        f(ParamMut::host("w", &mut self.w, &mut self.gw));
    }
}

fn fp16() -> TrainConfig {
    TrainConfig {
        mixed_precision: Some(MixedPrecision::Fp16),
        ..TrainConfig::default()
    }
}

#[test]
fn gradients_of_two_dtypes_are_averaged_in_buckets_of_their_own_dtype() {
    let got = ranks(2, |acc| {
        acc.set_training_config(TrainConfig {
            bucket_cap_bytes: 8,
            ..TrainConfig::default()
        })
        .unwrap();
        let r = acc.rank() as f32;
        let mut m = acc
            .prepare_model(Mixed {
                w: vec![0.0; 5],
                gw: (0..5).map(|i| i as f32 + 10.0 * r).collect(),
                b: vec![0.0],
                gb: vec![1.0 + 2.0 * f64::from(r)],
            })
            .unwrap();
        let report = sync(&mut m);
        (m.gw.clone(), m.gb.clone(), report)
    });
    for (gw, gb, (buckets, in_place)) in &got {
        let want: Vec<f32> = (0..5).map(|i| i as f32 + 5.0).collect();
        assert_eq!(gw, &want);
        assert_eq!(gb, &vec![2.0]);
        // w (20 bytes) exceeds the 8-byte cap: a bucket of its own, in place;
        // b is another dtype: another bucket, in place too.
        assert_eq!((*buckets, *in_place), (2, 2));
    }
}

#[test]
fn small_gradients_share_one_bucket_buffer_and_compression_averages_in_f32() {
    for compress in [None, Some(accel::DType::BF16)] {
        let got = ranks(2, move |acc| {
            acc.set_training_config(TrainConfig {
                gradient_compression: compress,
                ..TrainConfig::default()
            })
            .unwrap();
            let r = acc.rank() as f32;
            let mut m = acc.prepare_model(Linear::new(3)).unwrap();
            m.gw = vec![1.0 + r, 0.1 + r, 3.0];
            m.gb = vec![-1.0 - 3.0 * r];
            let report = sync(&mut m);
            (m.gw.clone(), m.gb.clone(), report)
        });
        for (gw, gb, (buckets, in_place)) in &got {
            assert_eq!((*buckets, *in_place), (1, 0), "one shared bucket");
            let want = [1.5f32, 0.6, 3.0, -2.5];
            let tol = if compress.is_some() { 1e-2 } else { 1e-6 };
            for (a, b) in gw.iter().chain(gb).zip(want) {
                assert!(
                    (a - b).abs() <= tol * (1.0 + b.abs()),
                    "{compress:?}: {gw:?} {gb:?}"
                );
            }
        }
        assert_eq!(got[0].0, got[1].0, "ranks agree");
    }
}

#[test]
fn compression_to_an_integer_type_is_refused() {
    let acc = single();
    let e = acc
        .set_training_config(TrainConfig {
            gradient_compression: Some(accel::DType::I8),
            ..TrainConfig::default()
        })
        .unwrap_err();
    assert!(e.to_string().contains("gradient_compression"), "{e}");
}

/// The fp16 loop of `docs/training.md` on `Linear`, with `poison(rank,
/// step, model)` run on every rank after backward (and its all-reduce),
/// before the step. Returns per step: (stepped, skipped, scale, scheduler
/// steps so far, parameters).
type Trace = Vec<(bool, bool, f32, u64, Vec<f32>)>;

fn fp16_run(acc: &Accelerator, poison: impl Fn(usize, usize, &mut Linear)) -> Trace {
    acc.set_training_config(TrainConfig {
        grad_scaler: GradScalerConfig {
            init_scale: 1024.0,
            growth_interval: 3,
            ..GradScalerConfig::default()
        },
        ..fp16()
    })
    .unwrap();
    let data = Data { len: 48, d: 3 };
    let mut model = acc.prepare_model(Linear::new(3)).unwrap();
    let mut opt = acc.prepare_optimizer(Sgd::new(0.05)).unwrap();
    let mut sched = acc.prepare_scheduler(ConstantSchedule::new(0.05)).unwrap();
    let mut loader = acc.prepare_loader(DataLoader::new(data, 4)).unwrap();
    let mut trace = Vec::new();
    let mut step = 0;
    while let Some(b) = loader.next_batch() {
        acc.accumulate(&b);
        acc.backward(&mut model, |m, s| m.grad(&b.items, s))
            .unwrap();
        poison(acc.rank(), step, &mut model);
        let stepped = opt.step(&mut model).unwrap();
        sched.step(&mut opt);
        opt.zero_grad(&mut model);
        assert_eq!(opt.step_was_skipped(), acc.optimizer_step_was_skipped());
        trace.push((
            stepped,
            acc.optimizer_step_was_skipped(),
            acc.grad_scaler().unwrap().scale,
            sched.steps,
            model.flat(),
        ));
        step += 1;
    }
    trace
}

#[test]
fn an_fp16_overflow_on_one_rank_skips_that_step_on_every_rank() {
    // Rank 1 overflows at step 2 *after* the all-reduce, so only its own
    // check sees it: the ranks must still agree.
    let got = ranks(2, |acc| {
        fp16_run(&acc, |rank, step, m| {
            if rank == 1 && step == 2 {
                m.gw[0] = f32::INFINITY;
            }
        })
    });
    assert_eq!(got[0].len(), got[1].len());
    for trace in &got {
        let (stepped, skipped, scale, sched, ref params) = trace[2];
        assert!(!stepped && skipped, "step 2 is skipped: {:?}", trace[2]);
        assert_eq!(scale, 512.0, "the scale backs off");
        assert_eq!(sched, trace[1].3, "the scheduler did not step");
        assert_eq!(params, &trace[1].4, "the parameters did not move");
        for (i, t) in trace.iter().enumerate() {
            if i != 2 {
                assert!(t.0 && !t.1, "step {i} ran: {t:?}");
            }
        }
        // Three clean steps after the backoff: the scale grows again.
        assert_eq!(trace[5].2, 1024.0);
    }
    // Rank 0's parameters stay those of rank 1 at every step.
    for (a, b) in got[0].iter().zip(&got[1]) {
        assert_eq!(a.4, b.4);
    }
}

#[test]
fn fp16_matches_f32_when_nothing_overflows() {
    let f32_run = ranks(2, |acc| {
        let data = Data { len: 48, d: 3 };
        let mut model = acc.prepare_model(Linear::new(3)).unwrap();
        let mut opt = acc.prepare_optimizer(Sgd::new(0.05)).unwrap();
        let mut loader = acc.prepare_loader(DataLoader::new(data, 4)).unwrap();
        while let Some(b) = loader.next_batch() {
            acc.accumulate(&b);
            acc.backward(&mut model, |m, s| m.grad(&b.items, s))
                .unwrap();
            opt.step(&mut model).unwrap();
            opt.zero_grad(&mut model);
        }
        model.flat()
    });
    let fp16_run = ranks(2, |acc| fp16_run(&acc, |_, _, _| {}));
    for (a, t) in f32_run.iter().zip(&fp16_run) {
        let b = &t.last().unwrap().4;
        for (x, y) in a.iter().zip(b) {
            // Scaling by a power of two and back is exact in f32.
            assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{a:?} vs {b:?}");
        }
    }
}

#[test]
fn f16_gradients_overflow_back_off_and_then_train() {
    let acc = single().with_training(fp16()).unwrap();
    let target = [3.0f32, -2.0, 0.5];
    let mut m = acc
        .prepare_model(Half {
            w: vec![0.0; 3],
            gw: vec![f16::ZERO; 3],
        })
        .unwrap();
    let mut opt = acc.prepare_optimizer(Sgd::new(0.2)).unwrap();
    let mut skipped = 0;
    for _ in 0..60 {
        acc.accumulate_step(false);
        acc.backward(&mut m, |m, s| m.grad(&target, s)).unwrap();
        if !opt.step(&mut m).unwrap() {
            skipped += 1;
        }
        opt.zero_grad(&mut m);
    }
    // 65536 * 3 overflows f16 (max 65504): the scale halves until it fits.
    let scale = acc.grad_scaler().unwrap().scale;
    assert!(skipped >= 2, "skipped {skipped}");
    assert!(scale <= 32768.0, "scale {scale}");
    for (w, t) in m.w.iter().zip(target) {
        assert!((w - t).abs() < 1e-2, "{:?}", m.w);
    }
}

#[test]
fn the_scaler_state_is_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    let acc = single().with_training(fp16()).unwrap();
    let mut m = acc.prepare_model(Linear::new(2)).unwrap();
    let mut opt = acc.prepare_optimizer(Sgd::new(0.1)).unwrap();
    acc.accumulate_step(false);
    acc.backward(&mut m, |m, _| m.gw[0] = f32::NAN).unwrap();
    assert!(!opt.step(&mut m).unwrap());
    opt.zero_grad(&mut m);
    assert_eq!(acc.grad_scaler().unwrap().scale, 32768.0);
    acc.save_state(dir.path().join("c"), &[&m, &opt]).unwrap();

    let acc2 = single().with_training(fp16()).unwrap();
    let mut m2 = acc2.prepare_model(Linear::new(2)).unwrap();
    let mut opt2 = acc2.prepare_optimizer(Sgd::new(0.1)).unwrap();
    assert_eq!(acc2.grad_scaler().unwrap().scale, 65536.0);
    acc2.load_state(dir.path().join("c"), &mut [&mut m2, &mut opt2])
        .unwrap();
    assert_eq!(acc2.grad_scaler().unwrap().scale, 32768.0);
}

#[test]
fn clip_grad_norm_gives_the_same_norm_on_every_rank_and_clips_to_it() {
    let got = ranks(2, |acc| {
        let mut m = acc.prepare_model(Linear::new(3)).unwrap();
        let r = acc.rank() as f32;
        m.gw = vec![3.0 + 2.0 * r, 0.0, -4.0];
        m.gb = vec![2.0 * r];
        acc.accumulate_step(false);
        acc.backward(&mut m, |_, _| ()).unwrap(); // averages: [4, 0, -4], [1]
        let n2 = acc.clip_grad_norm(&mut m, 3.0, 2.0).unwrap();
        let after: f64 =
            m.gw.iter()
                .chain(&m.gb)
                .map(|g| f64::from(*g).powi(2))
                .sum::<f64>()
                .sqrt();
        let ninf = acc.clip_grad_norm(&mut m, 100.0, f64::INFINITY).unwrap();
        acc.clip_grad_value(&mut m, 0.5).unwrap();
        (n2, after, ninf, m.gw.clone())
    });
    for (n2, after, ninf, gw) in &got {
        assert!((n2 - 33f64.sqrt()).abs() < 1e-6, "{n2}");
        assert!((after - 3.0).abs() < 1e-4, "{after}");
        assert!((ninf - 4.0 * 3.0 / 33f64.sqrt()).abs() < 1e-4, "{ninf}");
        assert_eq!(gw, &vec![0.5, 0.0, -0.5]);
    }
    assert_eq!(got[0].0, got[1].0, "the same norm on both ranks");
    let acc = single();
    let mut m = acc.prepare_model(Linear::new(1)).unwrap();
    assert!(acc.clip_grad_norm(&mut m, -1.0, 2.0).is_err());
    assert!(acc.clip_grad_norm(&mut m, 1.0, 0.0).is_err());
}

#[test]
fn mixed_precision_comes_from_the_config_or_the_launcher_variable() {
    let acc = single();
    assert_eq!(acc.mixed_precision(), MixedPrecision::No);
    assert!(acc.grad_scaler().is_none());
    acc.set_training_config(TrainConfig {
        mixed_precision: Some(MixedPrecision::Bf16),
        ..TrainConfig::default()
    })
    .unwrap();
    assert_eq!(acc.mixed_precision(), MixedPrecision::Bf16);
    assert!(acc.grad_scaler().is_none(), "no loss scaling in bf16");
}

// ------------------------------------------------------------------ settings that do not apply

/// Runs `f` with tracing output captured; returns its result and the text.
fn captured<T>(f: impl FnOnce() -> T) -> (T, String) {
    use std::sync::{Arc, Mutex};
    #[derive(Clone)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink(Arc::new(Mutex::new(Vec::new())));
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let out = tracing::subscriber::with_default(subscriber, f);
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    (out, text)
}

#[test]
fn bf16_on_a_model_that_computes_in_f32_is_a_warning_and_an_error_when_strict() {
    let dir = tempfile::tempdir().unwrap();
    let acc = single();
    acc.set_training_config(TrainConfig {
        mixed_precision: Some(MixedPrecision::Bf16),
        ..TrainConfig::default()
    })
    .unwrap();
    acc.init_trackers("run", dir.path(), &["jsonl"], &acc.training_config())
        .unwrap();
    let (prepared, log) = captured(|| acc.prepare_model(Linear::new(2)));
    prepared.unwrap();
    let notices = acc.settings_not_applied();
    assert_eq!(notices.len(), 1, "{notices:?}");
    let want =
        "TrainConfig::mixed_precision = bf16 does not apply: the prepared model computes in f32";
    assert!(notices[0].starts_with(want), "{}", notices[0]);
    assert!(log.contains("WARN") && log.contains(want), "{log}");
    // Reported once, however many models.
    let (_, again) = captured(|| acc.prepare_model(Linear::new(2)).unwrap());
    assert!(!again.contains("does not apply"), "{again}");
    // The trackers' config records what applied.
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("run/config.json")).unwrap())
            .unwrap();
    assert_eq!(config["mixed_precision"], "no", "{config}");
    assert!(
        config["not_applied"]["mixed_precision"]
            .as_str()
            .is_some_and(|s| s.starts_with(want)),
        "{config}"
    );

    // A model with half-precision gradients (compute copies) uses it.
    let half = single();
    half.set_training_config(TrainConfig {
        mixed_precision: Some(MixedPrecision::Fp16),
        ..TrainConfig::default()
    })
    .unwrap();
    half.prepare_model(Half {
        w: vec![0.0; 2],
        gw: vec![f16::ZERO; 2],
    })
    .unwrap();
    assert!(half.settings_not_applied().is_empty());

    let strict = single();
    strict
        .set_training_config(TrainConfig {
            mixed_precision: Some(MixedPrecision::Fp16),
            strict: true,
            ..TrainConfig::default()
        })
        .unwrap();
    let e = strict.prepare_model(Linear::new(2)).unwrap_err();
    assert_eq!(e.kind(), &accel::ErrorKind::InvalidConfig, "{e}");
    let text = e.to_string();
    assert!(
        text.contains("TrainConfig::mixed_precision = fp16 does not apply")
            && text.contains("only the loss scaler runs")
            && text.contains("ACCEL_STRICT"),
        "{text}"
    );
}

#[test]
fn sharding_without_prepare_zero_is_reported_at_the_first_step_and_an_error_when_strict() {
    for strict in [false, true] {
        let acc = single();
        acc.set_training_config(TrainConfig {
            sharding: Some(accel::zero::Stage::Gradients),
            strict,
            ..TrainConfig::default()
        })
        .unwrap();
        let mut m = acc.prepare_model(Linear::new(2)).unwrap();
        let mut opt = acc.prepare_optimizer(Sgd::new(0.1)).unwrap();
        assert!(
            acc.settings_not_applied().is_empty(),
            "nothing known before a step"
        );
        acc.backward(&mut m, |m, s| m.grad(&[(vec![1.0, 2.0], 1.0)], s))
            .unwrap();
        let (stepped, log) = captured(|| opt.step(&mut m));
        let want = "TrainConfig::sharding = gradients does not apply: PreparedOptimizer::step \
                    steps a model that Accelerator::prepare_zero did not shard";
        if strict {
            let e = stepped.unwrap_err();
            assert_eq!(e.kind(), &accel::ErrorKind::InvalidConfig, "{e}");
            assert!(e.to_string().contains(want), "{e}");
            assert!(!log.contains("WARN"), "{log}");
        } else {
            assert!(stepped.unwrap());
            assert!(log.contains("WARN") && log.contains(want), "{log}");
            assert_eq!(acc.settings_not_applied().len(), 1);
        }
    }
}

/// Child half of the test below: the launcher's variable, no program setting.
#[test]
fn launcher_child_prepares_a_pure_rust_model() {
    let Some(dir) = std::env::var_os("ACCEL_TEST_TRACKER_DIR") else {
        return; // only as the child of the test below
    };
    let acc = single();
    acc.init_trackers("run", &dir, &["jsonl"], &acc.training_config())
        .unwrap();
    let (r, log) = captured(|| acc.prepare_model(Linear::new(2)));
    r.unwrap();
    eprint!("{log}");
}

#[test]
fn the_launchers_mixed_precision_is_recorded_and_named_by_its_variable() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "launcher_child_prepares_a_pure_rust_model",
            "--exact",
            "--nocapture",
        ])
        .env("ACCEL_TEST_TRACKER_DIR", dir.path())
        .env("ACCEL_MIXED_PRECISION", "bf16")
        .env_remove("ACCEL_SHARDING")
        .env_remove("ACCEL_STRICT")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("WARN")
            && stderr.contains(
                "ACCEL_MIXED_PRECISION=bf16 (accel launch --mixed-precision) does not apply"
            ),
        "{stderr}"
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("run/config.json")).unwrap())
            .unwrap();
    // Before: "mixed_precision": null. Now the value that applied.
    assert_eq!(config["mixed_precision"], "no", "{config}");
    assert!(
        config["not_applied"]["mixed_precision"].is_string(),
        "{config}"
    );
}

/// Child half of the test below: the launcher's accumulation steps, and a
/// program that sets its own.
#[test]
fn launcher_child_reports_its_accumulation_steps() {
    if std::env::var_os("ACCEL_TEST_STEPS_CHILD").is_none() {
        return; // only as the child of the test below
    }
    let acc = single();
    let from_env = acc.training_config().gradient_accumulation_steps;
    acc.set_training_config(TrainConfig::default()).unwrap();
    let left_at_1 = acc.training_config().gradient_accumulation_steps;
    acc.set_training_config(TrainConfig {
        gradient_accumulation_steps: 4,
        ..TrainConfig::default()
    })
    .unwrap();
    let own = acc.training_config().gradient_accumulation_steps;
    println!("STEPS {from_env} {left_at_1} {own}");
}

#[test]
fn the_launchers_accumulation_steps_apply_where_the_program_leaves_them_at_1() {
    let child = |steps: &str| {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "launcher_child_reports_its_accumulation_steps",
                "--exact",
                "--nocapture",
            ])
            .env("ACCEL_TEST_STEPS_CHILD", "1")
            .env("ACCEL_GRADIENT_ACCUMULATION_STEPS", steps)
            .output()
            .unwrap()
    };
    let out = child("3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("STEPS 3 3 4"), "{stdout}");
    // A malformed value is an error naming the variable where the program
    // sets its configuration.
    let out = child("0");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("ACCEL_GRADIENT_ACCUMULATION_STEPS") && text.contains("at least 1"),
        "{text}"
    );
}
