//! Training-loop scenarios (issue 7): sharding, gather-for-metrics,
//! accumulation cadence, W×k equivalence on the demo model, and exact
//! resume in a fresh process group. Each runs the facade's training API
//! over the communicator under test and checks against
//! `accel_sharding::reference` (itself pinned by Accelerate's golden cases
//! in `sharding/tests/golden.rs`) or a one-process computation.

use std::sync::Arc;

use crate::fixtures::{fixture_values, Mlp, ScenarioModel, Synthetic};
use accel::train::{
    try_visit_params_mut, DataLoader, Dataset, IterableDataset, IterableLoader, MixedPrecision,
    Sgd, TrainConfig,
};
use accel::zero::NoGate;
use accel::{Accelerator, CollectivesExt};
use accel_api::Op;
use accel_sharding::reference;
use proptest::prelude::*;

use crate::prop::property;
use crate::Scenario;
use crate::{Ctx, Outcome};

/// The training scenarios, appended to the matrix.
pub(crate) fn train_scenarios() -> Vec<Scenario> {
    scenarios![
        train_sharding: gate_train,
        train_accelerate_golden: gate_train,
        train_resume: gate_train,
        train_streams: gate_train,
    ]
}

/// `0..len` as a stream; only the main process has data when `main_only`
/// (so a loader that did not dispatch would see nothing elsewhere).
#[derive(Clone, Copy)]
struct Stream {
    len: usize,
    main_only: bool,
    main: bool,
}

impl IterableDataset for Stream {
    type Item = u64;
    fn iter(&self, _epoch: u64) -> Box<dyn Iterator<Item = u64> + Send> {
        let n = if self.main_only && !self.main {
            0
        } else {
            self.len as u64
        };
        Box::new(0..n)
    }
    fn len(&self) -> Option<usize> {
        Some(self.len)
    }
}

/// Iterable loaders, sharded and dispatched from the main process: one
/// epoch's gather_for_metrics is the stream (without what drop_last drops),
/// and every rank yields the length it reports.
fn train_streams(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    for dispatch in [false, true] {
        for (len, bs, split, drop_last) in [
            (11, 2, false, false),
            (10, 2, false, true),
            (7, n, true, false),
            (1, 2, false, false),
            (0, 2, false, false),
        ] {
            let case = format!(
                "dispatch {dispatch} len {len} bs {bs} split {split} drop_last {drop_last}"
            );
            let run = || -> Result<(), String> {
                let acc = acc(
                    ctx,
                    TrainConfig {
                        dispatch_batches: Some(dispatch),
                        split_batches: split,
                        ..TrainConfig::default()
                    },
                )?;
                let data = Stream {
                    len,
                    main_only: dispatch,
                    main: acc.is_main_process(),
                };
                let mut l = acc
                    .prepare_iterable_loader(IterableLoader::new(data, bs).drop_last(drop_last))
                    .map_err(err)?;
                let (mut seen, mut count) = (Vec::new(), 0);
                while let Some(b) = l.next_batch().map_err(err)? {
                    seen.extend(acc.gather_for_metrics(&b.items, &b).map_err(err)?);
                    count += 1;
                }
                let global = if split { bs } else { bs * n };
                let kept = if drop_last {
                    len / global * global
                } else {
                    len
                };
                if seen != (0..kept as u64).collect::<Vec<_>>() {
                    return Err(format!("gather_for_metrics gave {seen:?}, want 0..{kept}"));
                }
                if l.len() != Some(count) {
                    return Err(format!(
                        "len() says {:?}, the epoch had {count} batches",
                        l.len()
                    ));
                }
                Ok(())
            };
            if let Err(m) = run() {
                return Outcome::Fail(format!("{case}: {m}"));
            }
        }
    }
    Outcome::Pass
}

pub(crate) fn gate_train(ctx: &Ctx) -> Option<String> {
    crate::ctx::needs(ctx, &[Op::AllReduce, Op::AllGather, Op::Broadcast])
}

fn acc(ctx: &Ctx, config: TrainConfig) -> Result<Accelerator, String> {
    let acc = Accelerator::from_communicator(ctx.comm.clone(), ctx.store.clone())
        .map_err(|e| e.to_string())?;
    acc.set_training_config(config).map_err(|e| e.to_string())?;
    Ok(acc)
}

fn err(e: accel_api::Error) -> String {
    e.to_string()
}

/// Sample `i` is `i`.
#[derive(Clone, Copy, Debug)]
struct Indices(usize);

impl Dataset for Indices {
    type Item = usize;
    fn len(&self) -> usize {
        self.0
    }
    fn get(&self, i: usize) -> usize {
        i
    }
}

/// One epoch of a prepared loader on every rank: the batches of every rank
/// (gathered through the communicator) and, when every rank has the same
/// number of steps, what gather_for_metrics returned over the epoch.
type Epoch = (Vec<Vec<Vec<usize>>>, Option<Vec<usize>>);

/// A data-loader case: dataset length, batch size and the loader's flags.
#[derive(Clone, Copy)]
struct Case {
    len: usize,
    bs: usize,
    drop_last: bool,
    split: bool,
    even: bool,
}

impl Case {
    fn new(len: usize, bs: usize, drop_last: bool, split: bool, even: bool) -> Case {
        Case {
            len,
            bs,
            drop_last,
            split,
            even,
        }
    }
}

fn one_epoch(ctx: &Ctx, case: Case, metrics: bool) -> Result<Epoch, String> {
    let (len, bs) = (case.len, case.bs);
    let acc = acc(
        ctx,
        TrainConfig {
            split_batches: case.split,
            even_batches: case.even,
            ..TrainConfig::default()
        },
    )?;
    let mut loader = acc
        .prepare_loader(DataLoader::new(Indices(len), bs).drop_last(case.drop_last))
        .map_err(err)?;
    // Every rank's batch count, computed locally (sharding is pure): the
    // per-step gathers of gather_for_metrics need the same count on every
    // rank (with uneven shards, Accelerate users need join_uneven_inputs).
    let cfg = loader.config().clone();
    let counts: Vec<usize> = (0..ctx.world_size())
        .map(|r| {
            accel_sharding::shard_len(len, cfg.layout(), cfg.shard_options(r)).unwrap_or(usize::MAX)
        })
        .collect();
    let equal = metrics && counts.windows(2).all(|w| w[0] == w[1]);
    let mut mine = Vec::new();
    let mut metrics = Vec::new();
    while let Some(b) = loader.next_batch() {
        if b.items != b.indices {
            return Err(format!(
                "items {:?} differ from indices {:?}",
                b.items, b.indices
            ));
        }
        if equal {
            let idx: Vec<i64> = b.indices.iter().map(|&i| i as i64).collect();
            metrics.extend(
                acc.gather_for_metrics(&idx, &b)
                    .map_err(err)?
                    .into_iter()
                    .map(|i| i as usize),
            );
        }
        mine.push(b.indices);
    }
    let all = ctx.comm.gather_object(&mine).map_err(err)?;
    Ok((all, equal.then_some(metrics)))
}

fn check_epoch(ctx: &Ctx, c: Case, metrics: bool) -> Result<(), String> {
    let n = ctx.world_size();
    let (got, metrics) = one_epoch(ctx, c, metrics)?;
    let Case {
        len,
        bs,
        drop_last,
        split,
        even,
    } = c;
    let case = format!("len {len} bs {bs} drop_last {drop_last} split {split} even {even}");
    let want = reference::loader_all(len, bs, drop_last, n, split, even);
    if got != want {
        return Err(format!("{case}: shards {got:?}, reference {want:?}"));
    }
    if even && !got.windows(2).all(|w| w[0].len() == w[1].len()) {
        return Err(format!("{case}: even_batches but counts differ: {got:?}"));
    }
    if let Some(m) = metrics {
        let want = reference::metrics_order(len, bs, drop_last, n, split);
        if m != want {
            return Err(format!(
                "{case}: gather_for_metrics gave {m:?}, want {want:?}"
            ));
        }
    }
    Ok(())
}

/// Random (length, batch size, split, even, drop_last): the union over
/// ranks equals the reference, even_batches gives equal counts, and
/// gather_for_metrics returns exactly the dataset in order.
fn train_sharding(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (
        0usize..40,
        1usize..5,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    );
    property(
        ctx,
        "train_sharding",
        strat,
        |&(len, b, split, even, drop_last)| {
            // split_batches needs a batch size the world size divides.
            let bs = if split { b * n } else { b };
            let case = Case::new(len, bs, drop_last, split, even);
            check_epoch(ctx, case, true)
        },
    )
}

/// Accelerate's data-loader golden cases (lengths 24, 21, 22, 20 and 2,
/// batch size 3 or, split, 2 per rank; every flag combination) against the
/// reference that `sharding/tests/golden.rs` pins with Accelerate's numbers
/// for two processes. (gather_for_metrics is left to `train_sharding`, to
/// keep this one to one gather per case.)
fn train_accelerate_golden(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    for len in [24, 21, 22, 20, 2] {
        for split in [false, true] {
            for even in [false, true] {
                for drop_last in [false, true] {
                    let bs = if split { 2 * n } else { 3 };
                    let case = Case::new(len, bs, drop_last, split, even);
                    if let Err(m) = check_epoch(ctx, case, false) {
                        return Outcome::Fail(m);
                    }
                }
            }
        }
    }
    Outcome::Pass
}

/// Random (k, batches, split, sync_each_batch): the decisions equal the
/// reference on every rank, and gradients are all-reduced exactly when the
/// decision says so.
pub(crate) fn train_accumulation_cadence<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (1usize..6, 1usize..10, any::<bool>(), any::<bool>());
    property(
        ctx,
        "train_accumulation_cadence",
        strat,
        |&(k, batches, split, each)| {
            let acc = acc(
                ctx,
                TrainConfig {
                    gradient_accumulation_steps: k,
                    split_batches: split,
                    sync_each_batch: each,
                    ..TrainConfig::default()
                },
            )?;
            let mut model = acc.prepare_model(M::build(2, 1)).map_err(err)?;
            let mut got = Vec::new();
            for i in 0..batches {
                let d = acc.accumulate_step(i + 1 == batches);
                acc.backward(&mut model, |_, _| ()).map_err(err)?;
                got.push(d);
            }
            let want = reference::accumulation(k, batches, n, split, each);
            if got != want {
                return Err(format!("k {k} batches {batches}: {got:?}, want {want:?}"));
            }
            let reduces = want.iter().filter(|d| d.all_reduce).count() as u64;
            if model.gradient_syncs() != reduces {
                return Err(format!(
                    "{} gradient all-reduces, the cadence asked for {reduces}",
                    model.gradient_syncs()
                ));
            }
            let everyone = ctx.comm.gather_object(&got).map_err(err)?;
            if everyone.iter().any(|g| *g != got) {
                return Err("ranks took different decisions".into());
            }
            Ok(())
        },
    )
}

/// `model` and `sgd` prepared by `acc`, trained over `data` in batches of
/// `bs` with the loss computed in `precision`; the parameters at the end.
fn train_prepared<M: ScenarioModel>(
    acc: &Accelerator,
    model: M,
    sgd: Sgd,
    data: Synthetic,
    bs: usize,
    precision: MixedPrecision,
) -> Result<Vec<f32>, String> {
    let mut model = acc.prepare_model(model).map_err(err)?;
    let mut opt = acc.prepare_optimizer(sgd).map_err(err)?;
    let mut loader = acc.prepare_loader(DataLoader::new(data, bs)).map_err(err)?;
    while let Some(b) = loader.next_batch() {
        acc.accumulate(&b);
        acc.backward(&mut model, |m, s| {
            m.loss_and_grad_gated(&b.items, s, precision, &mut NoGate)
        })
        .map_err(err)?
        .map_err(err)?;
        opt.step(&mut model).map_err(err)?;
        opt.zero_grad(&mut model);
    }
    Ok(fixture_values(&*model))
}

/// The W×k equivalence runs: the demo model trained with `sgd` by the
/// prepared loop over the communicator under test (`config`,
/// `precision`), 3 steps of batches of 3 per rank and micro-step
/// (`config`'s accumulation steps k), and the fixture's model trained with
/// `sgd` by one process on the global batches of the same data (seeded
/// `seed`): both parameter lists, in that order.
fn versus_one_process<M: ScenarioModel>(
    ctx: &Ctx,
    seed: u64,
    config: TrainConfig,
    sgd: Sgd,
    precision: MixedPrecision,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let (bs, steps, hidden) = (3, 3, 6);
    let global = ctx.world_size() * config.gradient_accumulation_steps * bs;
    let data = Synthetic {
        len: global * steps,
        seed,
    };
    let acc = acc(ctx, config)?;
    let got = train_prepared::<M>(&acc, M::build(hidden, 3), sgd.clone(), data, bs, precision)?;
    // One process, global batches of n * k * bs.
    let mut m = Mlp::new(hidden, 3);
    let mut opt = sgd;
    for s in 0..steps {
        let batch: Vec<_> = (s * global..(s + 1) * global)
            .map(|i| data.get(i))
            .collect();
        m.loss_and_grad(&batch, 1.0);
        accel::train::Optimizer::step(&mut opt, &mut m).map_err(|e| e.to_string())?;
        accel::train::Optimizer::zero_grad(&mut opt, &mut m);
    }
    Ok((got, m.flat_values()))
}

/// W ranks × k accumulation steps of the demo model give the parameters of
/// one process stepping on the global batch, within f32 tolerance.
pub(crate) fn train_equivalence<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    for k in [1, 2, 3] {
        let config = TrainConfig {
            gradient_accumulation_steps: k,
            bucket_cap_bytes: 64, // several buckets
            ..TrainConfig::default()
        };
        let sgd = Sgd::new(0.2).with_momentum(0.5);
        let (got, want) = match versus_one_process::<M>(ctx, 7, config, sgd, MixedPrecision::No) {
            Ok(v) => v,
            Err(m) => return Outcome::Fail(format!("k {k}: {m}")),
        };
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            if (a - b).abs() > 1e-4 * (1.0 + b.abs()) {
                return Outcome::Fail(format!(
                    "k {k}: parameter {i} is {a}, one process on the global batch gives {b}"
                ));
            }
        }
        // `want` holds every parameter of the one-process model.
        if want.len() != got.len() {
            return Outcome::Fail("parameter count differs".into());
        }
    }
    Outcome::Pass
}

/// 20 steps with the gradient synchronisation overlapping the backward
/// ([`Accelerator::backward_overlapped`]: buckets started as the modules
/// report their gradients) give the parameters of the blocking path bit
/// for bit, with several buckets, in f32 and with bf16 compression; with
/// more than one rank, some bucket started before the backward ended.
pub(crate) fn train_overlap_bit_identical<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    for compress in [None, Some(accel_api::DType::BF16)] {
        let mut runs = Vec::new();
        for overlap in [true, false] {
            let config = TrainConfig {
                bucket_cap_bytes: 64,
                first_bucket_cap_bytes: 16,
                overlap_grad_sync: overlap,
                gradient_compression: compress,
                ..TrainConfig::default()
            };
            match overlapped_run::<M>(ctx, config) {
                Ok(r) => runs.push(r),
                Err(m) => {
                    return Outcome::Fail(format!(
                        "overlap {overlap}, compression {compress:?}: {m}"
                    ))
                }
            }
        }
        let ((a, early), (b, _)) = (&runs[0], &runs[1]);
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            return Outcome::Fail(format!(
                "compression {compress:?}: parameter {i} is {} overlapped, {} blocking",
                a[i], b[i]
            ));
        }
        if a.len() != b.len() {
            return Outcome::Fail("parameter count differs".into());
        }
        if ctx.world_size() > 1 && *early == 0 {
            return Outcome::Fail(format!(
                "compression {compress:?}: no bucket started before the backward ended"
            ));
        }
    }
    Outcome::Pass
}

/// 20 steps of the demo model (batches of 2, k = 1) through
/// `backward_overlapped`: the parameters, and the buckets started early
/// over the run.
fn overlapped_run<M: ScenarioModel>(
    ctx: &Ctx,
    config: TrainConfig,
) -> Result<(Vec<f32>, usize), String> {
    let data = Synthetic {
        len: 40 * ctx.world_size(),
        seed: 21,
    };
    let acc = acc(ctx, config)?;
    let mut model = acc.prepare_model(M::build(6, 4)).map_err(err)?;
    let mut opt = acc
        .prepare_optimizer(Sgd::new(0.1).with_momentum(0.9))
        .map_err(err)?;
    let mut loader = acc.prepare_loader(DataLoader::new(data, 2)).map_err(err)?;
    let mut early = 0;
    while let Some(b) = loader.next_batch() {
        acc.accumulate(&b);
        acc.backward_overlapped(&mut model, |m, s, gate| {
            m.loss_and_grad_gated(&b.items, s, MixedPrecision::No, gate)
        })
        .map_err(err)?
        .map_err(err)?;
        early += model.last_sync_started_early();
        opt.step(&mut model).map_err(err)?;
        opt.zero_grad(&mut model);
    }
    Ok((fixture_values(&*model), early))
}

/// Stop at a random step, save, load in a fresh process group and finish:
/// the same samples and the same final parameters as an uninterrupted run.
fn train_resume(ctx: &Ctx) -> Outcome {
    match resume(ctx) {
        Ok(None) => Outcome::Pass,
        Ok(Some(why)) => Outcome::Skip(why),
        Err(m) => Outcome::Fail(m),
    }
}

/// `Ok(Some(reason))`: skipped because the backend cannot connect a fresh
/// group.
fn resume(ctx: &Ctx) -> Result<Option<String>, String> {
    let n = ctx.world_size();
    let data = Synthetic {
        len: 10 * n + 3,
        seed: 11,
    };
    let seed = ctx.seed.derive("train_resume");
    let total_steps = 2 * (10usize.div_ceil(2) + 1); // two epochs, k = 2
    let stop = 1 + (seed.0[0] as usize % (total_steps - 1));
    // A folder every rank agrees on (rank 0 picks it).
    let key = "train_resume/dir";
    if ctx.rank() == 0 {
        let dir = std::env::temp_dir().join(format!(
            "accel-conformance-resume-{}-{}",
            std::process::id(),
            &seed.hex()[..12]
        ));
        ctx.store
            .set(key, dir.to_string_lossy().as_bytes())
            .map_err(err)?;
    }
    let dir = std::path::PathBuf::from(
        String::from_utf8_lossy(&ctx.store.get(key, ctx.comm.timeout()).map_err(err)?).into_owned(),
    );
    let out = resume_in(ctx, &dir, data, stop);
    let _ = ctx.comm.barrier();
    if ctx.rank() == 0 {
        let _ = std::fs::remove_dir_all(&dir);
    }
    out
}

type Setup = (
    accel::train::PreparedModel<Mlp>,
    accel::train::PreparedOptimizer<Sgd>,
    accel::train::PreparedScheduler<accel::train::LinearSchedule>,
    accel::train::PreparedLoader<Synthetic>,
);

fn setup(acc: &Accelerator, data: Synthetic) -> Result<Setup, String> {
    acc.set_seed(5, true);
    Ok((
        acc.prepare_model(Mlp::new(4, 9)).map_err(err)?,
        acc.prepare_optimizer(Sgd::new(0.1).with_momentum(0.9))
            .map_err(err)?,
        acc.prepare_scheduler(accel::train::LinearSchedule::new(0.1, 2, 40))
            .map_err(err)?,
        acc.prepare_loader(DataLoader::new(data, 1).shuffle(3))
            .map_err(err)?,
    ))
}

/// What one rank read: (optimizer steps before the batch, sample indices).
type Log = Vec<(usize, Vec<usize>)>;

/// Train two epochs from optimizer step `from_step`; with `save`, stop
/// right after optimizer step `at`, saving into the folder. Returns (steps,
/// log, final parameters).
fn run(
    acc: &Accelerator,
    s: &mut Setup,
    save: Option<(&std::path::Path, usize)>,
    from_step: usize,
) -> Result<(usize, Log, Vec<f32>), String> {
    let (model, opt, sched, loader) = s;
    let mut steps = from_step;
    let mut log = Vec::new();
    while loader.epoch() < 2 {
        while let Some(b) = loader.next_batch() {
            let d = acc.accumulate(&b);
            // Per-rank noise from the checkpointed RNG.
            let noise = acc.rng().map_err(|e| e.to_string())?.normal() * 0.01;
            let items: Vec<_> = b
                .items
                .iter()
                .map(|x| {
                    let mut x = *x;
                    x.y += noise;
                    x
                })
                .collect();
            log.push((steps, b.indices.clone()));
            acc.backward(model, |m, sc| m.loss_and_grad(&items, sc))
                .map_err(err)?;
            opt.step(model).map_err(err)?;
            sched.step(opt);
            opt.zero_grad(model);
            if d.optimizer_step {
                steps += 1;
                if let Some((dir, at)) = save {
                    if steps == at {
                        acc.save_state(dir, &[&*model, &*opt, &*sched, &*loader])
                            .map_err(err)?;
                        return Ok((steps, log, model.flat_values()));
                    }
                }
            }
        }
    }
    Ok((steps, log, model.flat_values()))
}

fn resume_in(
    ctx: &Ctx,
    dir: &std::path::Path,
    data: Synthetic,
    stop: usize,
) -> Result<Option<String>, String> {
    let cfg = TrainConfig {
        gradient_accumulation_steps: 2,
        ..TrainConfig::default()
    };
    // Uninterrupted.
    let a = acc(ctx, cfg.clone())?;
    let mut s = setup(&a, data)?;
    let (_, log, p_full) = run(&a, &mut s, None, 0)?;
    let tail_full: Vec<usize> = log
        .into_iter()
        .filter(|(st, _)| *st >= stop)
        .flat_map(|(_, i)| i)
        .collect();
    // Stopped after step `stop`, with a checkpoint.
    let b = acc(ctx, cfg.clone())?;
    let mut s = setup(&b, data)?;
    let (at, _, _) = run(&b, &mut s, Some((dir, stop)), 0)?;
    if at != stop {
        return Err(format!("stopped at step {at}, asked for {stop}"));
    }
    // Resumed in a fresh process group.
    let comm = match ctx.fresh_comm("train_resume", ctx.comm.timeout()) {
        Ok(c) => c,
        Err(e) if matches!(e.kind(), accel_api::ErrorKind::Unsupported) => {
            return Ok(Some(format!("no fresh process group: {e}")))
        }
        Err(e) => return Err(err(e)),
    };
    let c = Accelerator::from_communicator(Arc::from(comm), ctx.store.clone()).map_err(err)?;
    c.set_training_config(cfg).map_err(err)?;
    let mut s = setup(&c, data)?;
    {
        let (m, o, sc, l) = &mut s;
        c.load_state(dir, &mut [m, o, sc, l]).map_err(err)?;
    }
    let (_, log, p_resumed) = run(&c, &mut s, None, stop)?;
    let tail_resumed: Vec<usize> = log.into_iter().flat_map(|(_, i)| i).collect();
    if tail_resumed != tail_full {
        return Err(format!(
            "after resuming at step {stop} the samples differ: {tail_resumed:?} vs {tail_full:?}"
        ));
    }
    for (i, (x, y)) in p_resumed.iter().zip(&p_full).enumerate() {
        if (x - y).abs() > 1e-6 * (1.0 + y.abs()) {
            return Err(format!(
                "resumed at step {stop}: parameter {i} is {x}, uninterrupted {y}"
            ));
        }
    }
    Ok(None)
}

/// fp16: the last rank's gradients overflow at one step *after* the
/// gradient all-reduce, so only its own check sees it; every rank must skip
/// that step, back off the same scale and keep identical parameters.
///
/// The forward pass computes in f32 (a model's f16 compute copies would
/// overflow by themselves at the scaler's initial scale, and the scenario
/// plants the only overflow).
pub(crate) fn train_fp16_skip_agreed<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    let run = || -> Result<Option<String>, String> {
        let n = ctx.world_size();
        let acc = acc(
            ctx,
            TrainConfig {
                mixed_precision: Some(MixedPrecision::Fp16),
                ..TrainConfig::default()
            },
        )?;
        let data = Synthetic {
            len: n * 2 * 5,
            seed: 13,
        };
        let mut model = acc.prepare_model(M::build(4, 3)).map_err(err)?;
        let mut opt = acc.prepare_optimizer(Sgd::new(0.1)).map_err(err)?;
        let mut loader = acc.prepare_loader(DataLoader::new(data, 2)).map_err(err)?;
        let (bad_rank, bad_step) = (n - 1, 2);
        let mut step = 0;
        let mut skips = Vec::new();
        while let Some(b) = loader.next_batch() {
            acc.accumulate(&b);
            acc.backward(&mut model, |m, s| {
                m.loss_and_grad_gated(&b.items, s, MixedPrecision::No, &mut NoGate)
            })
            .map_err(err)?
            .map_err(err)?;
            if acc.rank() == bad_rank && step == bad_step {
                try_visit_params_mut(&mut *model, |i, mut p| {
                    if i == 0 {
                        p.f32_mut()?.1[0] = f32::INFINITY;
                    }
                    Ok(())
                })
                .map_err(err)?;
            }
            let before = fixture_values(&*model);
            let stepped = opt.step(&mut model).map_err(err)?;
            opt.zero_grad(&mut model);
            let skipped = acc.optimizer_step_was_skipped();
            if stepped == skipped {
                return Err(format!(
                    "step {step}: stepped {stepped} and skipped {skipped}"
                ));
            }
            if skipped && fixture_values(&*model) != before {
                return Err(format!("step {step} was skipped but the parameters moved"));
            }
            skips.push(skipped);
            step += 1;
        }
        let want: Vec<bool> = (0..step).map(|s| s == bad_step).collect();
        if skips != want {
            return Err(format!(
                "skipped steps {skips:?}, expected only step {bad_step}"
            ));
        }
        let scale = acc.grad_scaler().map(|s| s.scale).unwrap_or(f32::NAN);
        let scales = acc.gather(&[scale]).map_err(err)?;
        if scales.iter().any(|s| *s != 32768.0) {
            return Err(format!("loss scales after one overflow: {scales:?}"));
        }
        let p = fixture_values(&*model);
        let all = acc.gather(&p).map_err(err)?;
        if all.chunks(p.len()).any(|c| c != p.as_slice()) {
            return Err("the ranks' parameters differ after the skipped step".into());
        }
        Ok(None)
    };
    match run() {
        Ok(_) => Outcome::Pass,
        Err(m) => Outcome::Fail(m),
    }
}

/// bf16: W ranks x k micro-steps with bf16 mixed precision and bf16
/// gradient communication (averaged in f32) give the parameters of one f32
/// process on the global batch within the stated tolerance
/// `|a - b| <= 1e-2 * (1 + |b|)` (bf16 keeps 8 significant bits).
pub(crate) fn train_bf16_equivalence<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    for k in [1, 2] {
        let config = TrainConfig {
            gradient_accumulation_steps: k,
            mixed_precision: Some(MixedPrecision::Bf16),
            gradient_compression: Some(accel_api::DType::BF16),
            bucket_cap_bytes: 64,
            ..TrainConfig::default()
        };
        let bf16 = MixedPrecision::Bf16;
        let (got, want) = match versus_one_process::<M>(ctx, 17, config, Sgd::new(0.2), bf16) {
            Ok(v) => v,
            Err(m) => return Outcome::Fail(format!("k {k}: {m}")),
        };
        for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
            if (a - b).abs() > 1e-2 * (1.0 + b.abs()) {
                return Outcome::Fail(format!(
                    "k {k}: parameter {i} is {a} in bf16, one f32 process gives {b}"
                ));
            }
        }
    }
    Outcome::Pass
}

/// Clipping on synchronised gradients: every rank gets the same total norm
/// (bit for bit), equal to the norm of the averaged gradients, and after
/// clipping the norm is the limit.
pub(crate) fn train_clip_norm_agreed<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    let run = || -> Result<(), String> {
        let n = ctx.world_size();
        let acc = acc(ctx, TrainConfig::default())?;
        let mut model = acc.prepare_model(M::build(3, 5)).map_err(err)?;
        let grad_of = |rank: usize, t: usize, i: usize| -> f32 {
            ((rank * 31 + t * 7 + i * 3) % 11) as f32 - 5.0 + 0.25 * rank as f32
        };
        let rank = acc.rank();
        let mut lens = Vec::new();
        try_visit_params_mut(&mut *model, |t, mut p| {
            let g = p.f32_mut()?.1;
            for (i, x) in g.iter_mut().enumerate() {
                *x = grad_of(rank, t, i);
            }
            lens.push(g.len());
            Ok(())
        })
        .map_err(err)?;
        acc.accumulate_step(false);
        acc.backward(&mut model, |_, _| ()).map_err(err)?;
        let mut want = 0.0f64;
        for (t, len) in lens.iter().enumerate() {
            for i in 0..*len {
                let avg = (0..n).map(|r| f64::from(grad_of(r, t, i))).sum::<f64>() / n as f64;
                want += avg * avg;
            }
        }
        let want = want.sqrt();
        let norm = acc.clip_grad_norm(&mut model, 1.0, 2.0).map_err(err)?;
        let norms = acc.gather(&[norm]).map_err(err)?;
        if norms.iter().any(|x| x.to_bits() != norm.to_bits()) {
            return Err(format!("the ranks' norms differ: {norms:?}"));
        }
        if (norm - want).abs() > 1e-5 * (1.0 + want) {
            return Err(format!(
                "norm {norm}, the averaged gradients' norm is {want}"
            ));
        }
        let mut after = 0.0f64;
        model.visit_params(&mut |p| {
            let g = p
                .grad_f32()
                .expect("scenario models hold f32 host gradients");
            after += g.iter().map(|g| f64::from(*g).powi(2)).sum::<f64>();
        });
        let after = after.sqrt();
        if (after - 1.0).abs() > 1e-4 {
            return Err(format!("after clipping to 1 the norm is {after}"));
        }
        Ok(())
    };
    match run() {
        Ok(()) => Outcome::Pass,
        Err(m) => Outcome::Fail(m),
    }
}
