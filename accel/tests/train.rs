//! The training loop end to end: one process on the `single` backend, and
//! threads as ranks on cpu-gloo (each under a hard deadline).

use std::path::Path;
use std::sync::{Arc, Mutex};

use accel::train::*;
use accel::zero::UnitGate;
use accel::{Accelerator, ErrorKind, Wrapper};
use accel_sharding::reference;

mod common;
use common::{ranks, single, Data, Linear};

/// What [`run_loop`] drives: a model, its optimizer and scheduler, a loader.
type Prepared = (
    PreparedModel<Linear>,
    PreparedOptimizer<Sgd>,
    PreparedScheduler<LinearSchedule>,
    PreparedLoader<Data>,
);

/// The loop of `docs/training.md`, `epochs` epochs or until `stop_after`
/// optimizer steps; saves into `ckpt` after `save_at` steps.
fn run_loop(
    acc: &Accelerator,
    objects: &mut Prepared,
    epochs: u64,
    save: Option<(&Path, u64)>,
    stop_after: Option<u64>,
) -> u64 {
    let (model, opt, sched, loader) = objects;
    let mut steps = 0;
    while loader.epoch() < epochs {
        while let Some(batch) = loader.next_batch() {
            let d = acc.accumulate(&batch);
            acc.backward(model, |m, s| m.grad(&batch.items, s)).unwrap();
            opt.step(model).unwrap();
            sched.step(opt);
            opt.zero_grad(model);
            if d.optimizer_step {
                steps += 1;
                if let Some((dir, at)) = save {
                    if steps == at {
                        acc.save_state(dir, &[&*model, &*opt, &*sched, &*loader])
                            .unwrap();
                    }
                }
                if stop_after == Some(steps) {
                    return steps;
                }
            }
        }
    }
    steps
}

// ------------------------------------------------------------------ one process

#[test]
fn prepare_is_idempotent_and_into_inner_gives_the_object_back() {
    let acc = single();
    let model = acc.prepare_model(Linear::new(3)).unwrap();
    assert!(model.is_prepared());
    assert_eq!(model.key(), "model_0");
    let again = acc.prepare_model(model).unwrap();
    assert_eq!(
        again.key(),
        "model_0",
        "a prepared model is returned unchanged"
    );
    let generic: PreparedModel<Linear> = acc.prepare(again).unwrap();
    assert_eq!(generic.into_inner(), Linear::new(3));
    let second = acc.prepare_model(Linear::new(2)).unwrap();
    assert_eq!(second.key(), "model_1");

    let opt = acc.prepare_optimizer(Sgd::new(0.1)).unwrap();
    let opt = acc.prepare_optimizer(opt).unwrap();
    assert_eq!(opt.key(), "optimizer_0");
    assert_eq!(opt.into_inner().lr, 0.1);
    let sched = acc.prepare_scheduler(ConstantSchedule::new(0.5)).unwrap();
    let sched = acc.prepare_scheduler(sched).unwrap();
    assert_eq!(sched.key(), "scheduler_0");
    let loader = acc
        .prepare_loader(DataLoader::new(Data { len: 10, d: 2 }, 3))
        .unwrap();
    let loader = acc.prepare_loader(loader).unwrap();
    assert_eq!((loader.key(), loader.len()), ("loader_0", 4));
    assert_eq!(loader.into_inner().batch_size, 3);
}

#[test]
fn accumulation_cadence_matches_the_reference_and_gates_the_optimizer() {
    for (k, len) in [(1, 10), (2, 10), (3, 10), (4, 7), (5, 3)] {
        let acc = single()
            .with_training(TrainConfig {
                gradient_accumulation_steps: k,
                ..TrainConfig::default()
            })
            .unwrap();
        let mut model = acc.prepare_model(Linear::new(2)).unwrap();
        let mut opt = acc.prepare_optimizer(Sgd::new(0.1)).unwrap();
        let mut sched = acc.prepare_scheduler(ConstantSchedule::new(0.1)).unwrap();
        let mut loader = acc
            .prepare_loader(DataLoader::new(Data { len, d: 2 }, 1))
            .unwrap();
        let mut got = Vec::new();
        let mut stepped = 0;
        while let Some(b) = loader.next_batch() {
            let d = acc.accumulate(&b);
            assert_eq!(acc.sync_gradients(), d.sync_gradients);
            let scale = acc
                .backward(&mut model, |m, s| {
                    m.grad(&b.items, s);
                    s
                })
                .unwrap();
            assert_eq!(scale, 1.0 / k as f32);
            if opt.step(&mut model).unwrap() {
                stepped += 1;
            }
            sched.step(&mut opt);
            let zeroed = opt.zero_grad(&mut model);
            assert_eq!(zeroed, d.zero_grad);
            got.push(d);
        }
        let want = reference::accumulation(k, len, 1, false, false);
        assert_eq!(got, want, "k={k} len={len}");
        assert_eq!(stepped, want.iter().filter(|d| d.optimizer_step).count());
        assert_eq!(opt.steps_taken(), stepped as u64);
        assert_eq!(
            sched.steps, stepped as u64,
            "one process: one scheduler step per optimizer step"
        );
        assert_eq!(
            model.gradient_syncs(),
            stepped as u64,
            "no all-reduce inside a group"
        );
    }
}

#[test]
fn reduce_rejects_unknown_names_and_metrics_work_on_one_rank() {
    let acc = single();
    let e = acc.reduce(&[1.0f32], "median").unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("median"), "{e}");
    for r in ["sum", "mean", "max", "min"] {
        assert_eq!(acc.reduce(&[2.0f32], r).unwrap(), vec![2.0]);
    }
    let (p, s) = acc
        .pad_across_processes(&[1i32, 2], &[2], 0, 0, false)
        .unwrap();
    assert_eq!((p, s), (vec![1, 2], vec![2]));
    acc.set_trigger();
    assert!(acc.check_trigger().unwrap());
    assert!(!acc.check_trigger().unwrap(), "the trigger resets");
}

#[test]
fn set_seed_is_reproducible_and_rng_is_checkpointed() {
    let acc = single();
    acc.set_seed(5, false);
    let a: Vec<u64> = (0..3).map(|_| acc.rng().unwrap().next_u64()).collect();
    acc.set_seed(5, true); // rank 0: same seed
    let b: Vec<u64> = (0..3).map(|_| acc.rng().unwrap().next_u64()).collect();
    assert_eq!(a, b);

    let dir = tempfile::tempdir().unwrap();
    acc.save_state(dir.path(), &[]).unwrap();
    let next = acc.rng().unwrap().next_u64();
    acc.rng().unwrap().next_u64();
    acc.load_state(dir.path(), &mut []).unwrap();
    assert_eq!(
        acc.rng().unwrap().next_u64(),
        next,
        "load_state restores the RNG"
    );
}

#[test]
fn checkpoints_number_continue_after_load_and_prune_by_number() {
    let dir = tempfile::tempdir().unwrap();
    let acc = single()
        .with_training(TrainConfig {
            total_limit: Some(3),
            ..TrainConfig::default()
        })
        .unwrap();
    let model = acc.prepare_model(Linear::new(2)).unwrap();
    for i in 0..12u64 {
        let p = acc.save_state(dir.path(), &[&model]).unwrap();
        assert_eq!(p, dir.path().join(format!("checkpoint_{i}")));
    }
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["checkpoint_10", "checkpoint_11", "checkpoint_9"]);

    // A fresh process: saving before loading would collide, loading
    // continues the numbering.
    let acc2 = single();
    let mut model2 = acc2.prepare_model(Linear::new(2)).unwrap();
    let e = acc2.save_state(dir.path(), &[&model2]).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("checkpoint_11"), "{e}");
    let acc3 = single();
    let mut model3 = acc3.prepare_model(Linear::new(2)).unwrap();
    let loaded = acc3.load_state(dir.path(), &mut [&mut model3]).unwrap();
    assert_eq!(loaded, dir.path().join("checkpoint_11"));
    assert_eq!(acc3.save_iteration(), 12);
    let p = acc3.save_state(dir.path(), &[&model3]).unwrap();
    assert_eq!(p, dir.path().join("checkpoint_12"));
    // an explicit directory also works and restores values
    model2.w[0] = 42.0;
    acc2.save_state_to(dir.path().join("best"), &[&model2])
        .unwrap();
    acc3.load_state(dir.path().join("best"), &mut [&mut model3])
        .unwrap();
    assert_eq!(model3.w[0], 42.0);
}

#[test]
fn corrupted_or_truncated_checkpoint_files_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let acc = single();
    let model = acc.prepare_model(Linear::new(4)).unwrap();
    let opt = acc
        .prepare_optimizer(Sgd::new(0.1).with_momentum(0.9))
        .unwrap();
    let ck = acc.save_state(dir.path(), &[&model, &opt]).unwrap();

    let file = ck.join("model_0.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let acc2 = single();
    let mut m2 = acc2.prepare_model(Linear::new(4)).unwrap();
    let e = acc2.load_state(&ck, &mut [&mut m2]).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Corrupt, "{e}");
    assert!(e.to_string().contains("model_0.safetensors"), "{e}");

    bytes.truncate(10);
    std::fs::write(&file, &bytes).unwrap();
    let e = acc2.load_state(dir.path(), &mut [&mut m2]).unwrap_err();
    assert!(e.to_string().contains("model_0.safetensors"), "{e}");
    assert!(e.to_string().contains("truncated"), "{e}");

    // Asking for an object the checkpoint does not hold names it.
    let acc3 = single();
    let mut m3 = acc3.prepare_model(Linear::new(4)).unwrap();
    let ck2 = acc3
        .save_state_to(dir.path().join("plain"), &[&m3])
        .unwrap();
    let mut sched = acc3.prepare_scheduler(ConstantSchedule::new(1.0)).unwrap();
    let e = acc3
        .load_state(&ck2, &mut [&mut m3, &mut sched])
        .unwrap_err();
    assert!(e.to_string().contains("scheduler_0"), "{e}");
    let e = acc3
        .load_state(dir.path().join("nothing"), &mut [])
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
}

#[test]
fn registered_objects_are_saved_and_restored() {
    #[derive(Default)]
    struct Counter(u64, Vec<f32>);
    impl Stateful for Counter {
        fn state_dict(&self) -> accel::Result<StateDict> {
            let mut s = StateDict::default();
            s.put("n", &self.0);
            s.put_tensor("t", self.1.clone());
            Ok(s)
        }
        fn load_state_dict(&mut self, s: StateDict) -> accel::Result<()> {
            self.0 = s.get("n")?;
            self.1 = s.tensor("t")?.data.clone();
            Ok(())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let acc = single();
    let c = Arc::new(Mutex::new(Counter(7, vec![1.5, 2.5])));
    acc.register_for_checkpointing(c.clone());
    acc.save_state(dir.path(), &[]).unwrap();
    let acc2 = single();
    let c2 = Arc::new(Mutex::new(Counter::default()));
    acc2.register_for_checkpointing(c2.clone());
    acc2.load_state(dir.path(), &mut []).unwrap();
    let c2 = c2.lock().unwrap();
    assert_eq!((c2.0, c2.1.clone()), (7, vec![1.5, 2.5]));
}

// ------------------------------------------------------------------ threads as ranks

/// One process on the global batch: the reference for the equivalence test.
fn reference_params(world: usize, k: usize, bs: usize, data: Data, steps_epochs: u64) -> Vec<f32> {
    let mut m = Linear::new(data.d);
    let mut opt = Sgd::new(0.1).with_momentum(0.5);
    let global = world * k * bs;
    for _ in 0..steps_epochs {
        for start in (0..data.len).step_by(global) {
            let batch: Vec<_> = (start..start + global).map(|i| data.get(i)).collect();
            m.grad(&batch, 1.0);
            opt.step(&mut m).unwrap();
            opt.zero_grad(&mut m);
        }
    }
    m.flat()
}

#[test]
fn w_ranks_times_k_steps_equal_one_process_on_the_global_batch() {
    for (world, k) in [(2, 1), (2, 3), (3, 2)] {
        let bs = 4;
        let data = Data {
            len: world * k * bs * 5,
            d: 3,
        };
        let want = reference_params(world, k, bs, data, 2);
        let got = ranks(world, move |acc| {
            acc.set_training_config(TrainConfig {
                gradient_accumulation_steps: k,
                bucket_cap_bytes: 8, // two floats: several buckets
                ..TrainConfig::default()
            })
            .unwrap();
            let mut model = acc.prepare_model(Linear::new(data.d)).unwrap();
            let mut opt = acc
                .prepare_optimizer(Sgd::new(0.1).with_momentum(0.5))
                .unwrap();
            let mut loader = acc.prepare_loader(DataLoader::new(data, bs)).unwrap();
            let mut steps = 0;
            while loader.epoch() < 2 {
                while let Some(b) = loader.next_batch() {
                    let d = acc.accumulate(&b);
                    acc.backward(&mut model, |m, s| m.grad(&b.items, s))
                        .unwrap();
                    opt.step(&mut model).unwrap();
                    opt.zero_grad(&mut model);
                    steps += d.optimizer_step as usize;
                }
            }
            assert_eq!(steps, 10);
            assert!(
                model.last_sync_buckets() >= 2,
                "{}",
                model.last_sync_buckets()
            );
            model.flat()
        });
        for (r, p) in got.iter().enumerate() {
            for (a, b) in p.iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "world {world} k {k} rank {r}: {p:?} vs {want:?}"
                );
            }
        }
        assert!(
            got.windows(2).all(|w| w[0] == w[1]),
            "ranks agree bit for bit"
        );
    }
}

#[test]
fn gather_for_metrics_returns_the_dataset_exactly_once_in_order() {
    for (world, len, bs) in [(2, 21, 3), (3, 23, 4), (4, 5, 2)] {
        let got = ranks(world, move |acc| {
            let mut loader = acc
                .prepare_loader(DataLoader::new(Data { len, d: 1 }, bs))
                .unwrap();
            let mut seen = Vec::new();
            while let Some(b) = loader.next_batch() {
                let idx: Vec<i64> = b.indices.iter().map(|&i| i as i64).collect();
                seen.extend(acc.gather_for_metrics(&idx, &b).unwrap());
                let objs: Vec<String> = b.indices.iter().map(|i| format!("s{i}")).collect();
                let all = acc.gather_objects_for_metrics(&objs, &b).unwrap();
                assert_eq!(all.len(), acc.gather_for_metrics(&idx, &b).unwrap().len());
            }
            seen
        });
        let want: Vec<i64> = (0..len as i64).collect();
        for s in got {
            assert_eq!(s, want, "world {world} len {len} bs {bs}");
        }
    }
}

#[test]
fn a_trigger_on_one_rank_stops_every_rank_at_the_same_step() {
    let got = ranks(3, |acc| {
        let mut step = 0;
        loop {
            step += 1;
            if acc.rank() == 2 && step == 4 {
                acc.set_trigger();
            }
            if acc.check_trigger().unwrap() {
                return step;
            }
            assert!(step < 10);
        }
    });
    assert_eq!(got, vec![4, 4, 4]);
}

#[test]
fn synchronize_rng_states_gives_every_rank_rank0s_state() {
    let got = ranks(2, |acc| {
        acc.set_seed(9, true);
        let differ = acc.rng().unwrap().next_u64();
        acc.synchronize_rng_states().unwrap();
        (differ, acc.rng().unwrap().next_u64())
    });
    assert_ne!(got[0].0, got[1].0, "device-specific seeds differ");
    assert_eq!(got[0].1, got[1].1);
}

#[test]
fn resume_in_a_fresh_group_finishes_with_the_same_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let data = Data { len: 50, d: 3 };
    let setup = move |acc: &Accelerator| -> Prepared {
        acc.set_training_config(TrainConfig {
            gradient_accumulation_steps: 2,
            ..TrainConfig::default()
        })
        .unwrap();
        let model = acc.prepare_model(Linear::new(data.d)).unwrap();
        let opt = acc
            .prepare_optimizer(Sgd::new(0.05).with_momentum(0.9))
            .unwrap();
        let sched = acc
            .prepare_scheduler(LinearSchedule::new(0.05, 2, 40))
            .unwrap();
        let loader = acc
            .prepare_loader(DataLoader::new(data, 3).shuffle(11))
            .unwrap();
        (model, opt, sched, loader)
    };
    let full = {
        let root = root.join("full");
        ranks(2, move |acc| {
            let mut t = setup(&acc);
            run_loop(&acc, &mut t, 3, Some((&root, 7)), None);
            t.0.flat()
        })
    };
    let stopped = {
        let root = root.join("resumed");
        ranks(2, move |acc| {
            let mut t = setup(&acc);
            run_loop(&acc, &mut t, 3, Some((&root, 7)), Some(9))
        })
    };
    assert_eq!(stopped, vec![9, 9]);
    let resumed = {
        let root = root.join("resumed");
        ranks(2, move |acc| {
            let mut t = setup(&acc);
            let (m, o, s, l) = &mut t;
            acc.load_state(&root, &mut [m, o, s, l]).unwrap();
            assert_eq!(acc.save_iteration(), 1);
            run_loop(&acc, &mut t, 3, None, None);
            t.0.flat()
        })
    };
    assert_eq!(full, resumed, "bit-identical after an exact resume");
}

// ------------------------------------------------------------------ schedules

/// The rate torch gives the optimizer after `step` scheduler steps with
/// transformers' `get_linear_schedule_with_warmup(opt, warmup, total)`:
/// `LambdaLR` sets `base_lr * lr_lambda(last_epoch)`, and its constructor
/// already runs one `step()` (`last_epoch` 0), so the first optimizer step
/// uses `base_lr * lr_lambda(0)` (0 in a warm-up). `lr_lambda` is
/// `step / max(1, warmup)` in the warm-up, then
/// `max(0, (total - step) / max(1, total - warmup))`, in Python floats.
fn torch_linear_warmup_lr(base: f64, warmup: u64, total: u64, step: u64) -> f64 {
    let factor = if step < warmup {
        step as f64 / warmup.max(1) as f64
    } else {
        f64::max(
            0.0,
            (total as i64 - step as i64) as f64 / total.saturating_sub(warmup).max(1) as f64,
        )
    };
    base * factor
}

/// An optimizer that records the rate of every step it takes.
#[derive(Default)]
struct RateLog {
    lr: f64,
    used: Vec<f64>,
}

impl Optimizer for RateLog {
    fn step(&mut self, _: &mut dyn Parameters) -> accel::Result<()> {
        self.used.push(self.lr);
        Ok(())
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    /// The rate, as torch's `param_groups` save it.
    fn state_dict(&self) -> StateDict {
        let mut s = StateDict::default();
        s.put("lr", &self.lr);
        s
    }
    fn load_state_dict(&mut self, s: &StateDict) -> accel::Result<()> {
        self.lr = s.get("lr")?;
        Ok(())
    }
}

impl accel::zero::ShardOptimizer for RateLog {
    fn step_shard(&mut self, _: usize, _: &mut [f32], _: &[f32]) -> accel::Result<()> {
        Ok(())
    }
    fn finish_step(&mut self) {
        self.used.push(self.lr);
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
    fn state_numel(&self) -> usize {
        0
    }
    fn state_dict(&self) -> StateDict {
        StateDict::default()
    }
    fn load_state_dict(&mut self, _: &StateDict) -> accel::Result<()> {
        Ok(())
    }
}

/// One process, 2 batches per optimizer step: a `RateLog` starting at the
/// schedule's peak, the schedule, and a loader of `len` samples in batches
/// of 2.
#[allow(clippy::type_complexity)]
fn scheduled(
    with_optimizer: bool,
    schedule: LinearSchedule,
    len: usize,
) -> (
    accel::Accelerator,
    PreparedModel<Linear>,
    PreparedOptimizer<RateLog>,
    PreparedScheduler<LinearSchedule>,
    PreparedLoader<Data>,
) {
    let acc = single();
    acc.set_training_config(TrainConfig {
        gradient_accumulation_steps: 2,
        step_scheduler_with_optimizer: with_optimizer,
        ..TrainConfig::default()
    })
    .unwrap();
    let model = acc.prepare_model(Linear::new(2)).unwrap();
    let opt = acc
        .prepare_optimizer(RateLog {
            lr: schedule.peak,
            ..RateLog::default()
        })
        .unwrap();
    let sched = acc.prepare_scheduler(schedule).unwrap();
    let loader = acc
        .prepare_loader(DataLoader::new(Data { len, d: 2 }, 2))
        .unwrap();
    (acc, model, opt, sched, loader)
}

#[test]
fn a_warmup_schedule_gives_torchs_rate_at_every_optimizer_step() {
    let (base, warmup, total) = (0.1, 4, 15);
    for with_optimizer in [true, false] {
        let (acc, mut model, mut opt, mut sched, mut loader) =
            scheduled(with_optimizer, LinearSchedule::new(base, warmup, total), 40);
        // The scheduler steps that came before each optimizer step.
        let (mut sched_steps, mut want) = (0, Vec::new());
        for _ in 0..2 {
            while let Some(b) = loader.next_batch() {
                acc.accumulate(&b);
                acc.backward(&mut model, |m, s| m.grad(&b.items, s))
                    .unwrap();
                if opt.step(&mut model).unwrap() {
                    want.push(torch_linear_warmup_lr(base, warmup, total, sched_steps));
                }
                sched_steps += sched.step(&mut opt) as u64;
                opt.zero_grad(&mut model);
            }
        }
        let used = &opt.used;
        assert_eq!(used.len(), 20);
        assert_eq!(
            used, &want,
            "step_scheduler_with_optimizer {with_optimizer}: the rates of the optimizer steps"
        );
        if with_optimizer {
            assert_eq!(
                used[0], 0.0,
                "the first step runs at the warm-up's first rate"
            );
            assert!(used[16..].iter().all(|r| *r == 0.0), "{used:?}");
        } else {
            // The scheduler stepped on the first batch already: its rate, not the first one.
            assert_eq!(used[0], torch_linear_warmup_lr(base, warmup, total, 1));
        }
    }
}

#[test]
fn a_prepared_scheduler_drives_a_zero_optimizer_from_its_first_step() {
    let (base, warmup, total) = (0.1, 3, 20);
    let used = ranks(2, move |acc| {
        acc.set_training_config(TrainConfig {
            gradient_accumulation_steps: 2,
            sharding: Some(accel::zero::Stage::Gradients),
            ..TrainConfig::default()
        })
        .unwrap();
        let mut model = acc.prepare_model(Linear::new(3)).unwrap();
        let mut zero = acc
            .prepare_zero(
                &mut model,
                &accel::zero::WrapPolicy::Whole,
                RateLog {
                    lr: base,
                    ..RateLog::default()
                },
            )
            .unwrap();
        let mut sched = acc
            .prepare_scheduler_for(&mut zero, LinearSchedule::new(base, warmup, total))
            .unwrap();
        assert_eq!(
            zero.optimizer().lr,
            0.0,
            "set when the scheduler is prepared"
        );
        let mut loader = acc
            .prepare_loader(DataLoader::new(Data { len: 32, d: 3 }, 2))
            .unwrap();
        while let Some(b) = loader.next_batch() {
            acc.accumulate(&b);
            acc.backward(&mut model, |m, s| m.grad(&b.items, s))
                .unwrap();
            acc.zero_step(&mut zero, &mut model, None).unwrap();
            sched.step(&mut zero);
            model.gw.fill(0.0);
            model.gb.fill(0.0);
        }
        zero.optimizer().used.clone()
    });
    // Two processes: the scheduler steps twice per optimizer step (Accelerate).
    // 16 batches per rank in groups of 2: 4 optimizer steps.
    let want: Vec<f64> = (0..4)
        .map(|i| torch_linear_warmup_lr(base, warmup, total, 2 * i))
        .collect();
    assert_eq!(used, vec![want.clone(), want]);
}

/// Batches `from..` of a 2-epoch run with 2 batches per optimizer step;
/// when `stop` is `Some(n)`, saves a checkpoint into `dir` after `n`
/// batches and ends there; when `resume`, loads the latest one first.
/// Returns the rates of the optimizer steps taken.
fn resume_run(
    with_optimizer: bool,
    dir: &std::path::Path,
    stop: Option<usize>,
    resume: bool,
) -> Vec<f64> {
    let (acc, mut model, mut opt, mut sched, mut loader) =
        scheduled(with_optimizer, LinearSchedule::new(0.1, 4, 12), 16);
    if resume {
        let latest = acc.latest_checkpoint(dir).unwrap().expect("a checkpoint");
        acc.load_state(
            &latest,
            &mut [&mut model, &mut opt, &mut sched, &mut loader],
        )
        .unwrap();
    }
    let mut batches = 0;
    for _ in 0..2 {
        if stop == Some(batches) {
            break;
        }
        while let Some(b) = loader.next_batch() {
            acc.accumulate(&b);
            acc.backward(&mut model, |m, s| m.grad(&b.items, s))
                .unwrap();
            opt.step(&mut model).unwrap();
            sched.step(&mut opt);
            opt.zero_grad(&mut model);
            batches += 1;
            if stop == Some(batches) {
                break;
            }
        }
    }
    if stop.is_some() {
        acc.save_state(dir, &[&model, &opt, &sched, &loader])
            .unwrap();
    }
    opt.used.clone()
}

/// A checkpoint taken before the first optimizer step resumes on the
/// uninterrupted run's rates: with `step_scheduler_with_optimizer = false`
/// the schedule moves on every batch, also inside the first accumulation
/// group, so the rate the first step takes is the restored schedule's, not
/// the one a fresh `prepare_scheduler` noted.
#[test]
fn a_checkpoint_before_the_first_step_resumes_on_the_same_rates() {
    for with_optimizer in [false, true] {
        let whole = resume_run(
            with_optimizer,
            std::path::Path::new("/nonexistent"),
            None,
            false,
        );
        assert_eq!(whole.len(), 8, "16 batches, 2 per optimizer step");
        // Before any batch, inside the first accumulation group, and inside
        // a later one.
        for stop in [0, 1, 3] {
            let dir = tempfile::tempdir().unwrap();
            let before = resume_run(with_optimizer, dir.path(), Some(stop), false);
            let after = resume_run(with_optimizer, dir.path(), None, true);
            let mut rates = before.clone();
            rates.extend(&after);
            assert_eq!(
                rates, whole,
                "step_scheduler_with_optimizer {with_optimizer}, saved after {stop} batches: \
                 {before:?} then {after:?}"
            );
        }
    }
}

/// HSDP (dp_replicate 2 × dp_shard 2) against ZeRO over all 4 ranks, at
/// stages 2 and 3: the shards average within their group, then across
/// the replicas, so both end on the same parameters (to rounding: the
/// sums are grouped differently).
#[test]
fn hybrid_sharding_trains_as_plain_data_parallel_zero() {
    for stage in [accel::zero::Stage::Gradients, accel::zero::Stage::Full] {
        let run = move |hsdp: bool| {
            ranks(4, move |acc| {
                if hsdp {
                    acc.set_parallelism_config(accel::mesh::ParallelismConfig {
                        dp_replicate: 2,
                        dp_shard: 2,
                        ..accel::mesh::ParallelismConfig::default()
                    })
                    .unwrap();
                }
                acc.set_training_config(TrainConfig {
                    gradient_accumulation_steps: 2,
                    sharding: Some(stage),
                    ..TrainConfig::default()
                })
                .unwrap();
                let mut model = acc.prepare_model(Linear::new(5)).unwrap();
                let policy = accel::zero::WrapPolicy::Whole;
                let opt = accel::zero::ShardedSgd::new(0.05);
                let mut zero = acc.prepare_zero(&mut model, &policy, opt).unwrap();
                let mut loader = acc
                    .prepare_loader(DataLoader::new(Data { len: 64, d: 5 }, 2))
                    .unwrap();
                while let Some(b) = loader.next_batch() {
                    acc.accumulate(&b);
                    zero.gather(&mut *model, "").unwrap();
                    acc.backward(&mut model, |m, s| m.grad(&b.items, s))
                        .unwrap();
                    zero.reduce_grads(&mut *model, "").unwrap();
                    acc.zero_step(&mut zero, &mut model, None).unwrap();
                    model.gw.fill(0.0);
                    model.gb.fill(0.0);
                }
                zero.gather(&mut *model, "").unwrap();
                model.flat()
            })
        };
        let (plain, hybrid) = (run(false), run(true));
        for (rank, (p, h)) in plain.iter().zip(&hybrid).enumerate() {
            for (a, b) in p.iter().zip(h) {
                assert!(
                    (a - b).abs() <= 1e-6 * a.abs().max(1.0),
                    "stage {stage}, rank {rank}: {p:?} against {h:?}"
                );
            }
        }
        assert!(plain[0] != Linear::new(5).flat(), "the parameters moved");
    }
}
