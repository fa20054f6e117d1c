//! `save_state_async`: the state of the moment of the call, written in
//! the background while training goes on, committed as `save_state`
//! commits; a second save waits for the first; a failed background write
//! (a full disk) is an error at the next call on every rank, and the
//! checkpoint before it still loads.

use std::path::Path;
use std::process::Command;

use accel::train::*;

mod common;
use common::{ranks, Data, Linear};

/// Train `steps` optimizer steps of batches 2 (no accumulation).
fn train(
    acc: &accel::Accelerator,
    model: &mut PreparedModel<Linear>,
    opt: &mut PreparedOptimizer<Sgd>,
    loader: &mut PreparedLoader<Data>,
    steps: usize,
) {
    for _ in 0..steps {
        let b = loader.next_batch().expect("a batch");
        acc.accumulate(&b);
        acc.backward(model, |m, s| m.grad(&b.items, s)).unwrap();
        opt.step(model).unwrap();
        opt.zero_grad(model);
    }
}

/// Every file of checkpoint `dir`, by name, with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let name = p.strip_prefix(dir).unwrap().display().to_string();
                out.push((name, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn an_async_save_holds_the_state_of_its_call_and_the_bytes_of_a_sync_save() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("async"), tmp.path().join("sync"));
    let out = ranks(2, move |acc| {
        let mut model = acc.prepare_model(Linear::new(4)).unwrap();
        let mut opt = acc.prepare_optimizer(Sgd::new(0.05)).unwrap();
        let mut loader = acc
            .prepare_loader(DataLoader::new(Data { len: 64, d: 4 }, 2))
            .unwrap();
        train(&acc, &mut model, &mut opt, &mut loader, 3);
        let at_save = model.flat();
        let sync = acc.save_state(&b, &[&model, &opt, &loader]).unwrap();
        acc.set_save_iteration(0);
        let path = acc.save_state_async(&a, &[&model, &opt, &loader]).unwrap();
        // Training goes on while it writes.
        train(&acc, &mut model, &mut opt, &mut loader, 3);
        assert_ne!(model.flat(), at_save);
        assert_eq!(acc.wait_for_save().unwrap(), Some(path.clone()));
        assert_eq!(acc.wait_for_save().unwrap(), None, "nothing in flight");
        // Loading it gives back the parameters of the moment of the call.
        acc.load_state(&path, &mut [&mut model, &mut opt, &mut loader])
            .unwrap();
        assert_eq!(model.flat(), at_save);
        (path, sync)
    });
    let (path, sync) = &out[0];
    assert_eq!(files(path), files(sync), "the same files as save_state's");
}

#[test]
fn the_async_save_setting_makes_save_state_write_in_the_background() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let got = ranks(2, move |acc| {
        let model = acc.prepare_model(Linear::new(3)).unwrap();
        // Off (the default): nothing is left in flight.
        let first = acc.save_state(&root, &[&model]).unwrap();
        let none = acc.wait_for_save().unwrap();
        acc.set_training_config(accel::train::TrainConfig {
            async_save: true,
            ..Default::default()
        })
        .unwrap();
        let second = acc.save_state(&root, &[&model]).unwrap();
        let waited = acc.wait_for_save().unwrap();
        (first, none, second, waited)
    });
    for (first, none, second, waited) in got {
        assert!(first.ends_with("checkpoint_0") && none.is_none());
        assert!(second.ends_with("checkpoint_1"), "{second:?}");
        assert_eq!(
            waited.as_deref(),
            Some(second.as_path()),
            "saved in the background"
        );
        assert!(second.is_dir(), "{second:?} committed");
    }
}

#[test]
fn a_second_async_save_waits_for_the_first_and_the_numbering_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let paths = ranks(2, move |acc| {
        let model = acc.prepare_model(Linear::new(3)).unwrap();
        let first = acc.save_state_async(&root, &[&model]).unwrap();
        let second = acc.save_state_async(&root, &[&model]).unwrap();
        acc.end_training().unwrap();
        (first, second, acc.latest_checkpoint(&root).unwrap())
    });
    let (first, second, latest) = &paths[0];
    assert!(first.ends_with("checkpoint_0") && second.ends_with("checkpoint_1"));
    assert_eq!(latest.as_ref(), Some(second));
    assert!(first.join("accelerator.json").exists());
}

/// A tmpfs of 64 KiB: a small checkpoint fits, a model of 80 KB does not.
#[test]
fn a_full_disk_during_a_background_write_is_an_error_at_the_next_call() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("small");
    std::fs::create_dir(&root).unwrap();
    if !accel_test_support::skips::is_root() {
        accel_test_support::skips::skip_needs_root("mounting a full tmpfs");
        return;
    }
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(&root)
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        accel_test_support::skips::skip_absent_hardware("mount -t tmpfs is not permitted here");
        return;
    }
    let r = root.clone();
    let out = ranks(2, move |acc| {
        let small = acc.save_state(&r, &[]).unwrap();
        let big = acc.prepare_model(Linear::new(20_000)).unwrap();
        // The call returns: the state is in memory, the disk not touched yet.
        acc.save_state_async(&r, &[&big]).unwrap();
        let e = acc.wait_for_save().unwrap_err();
        let latest = acc.latest_checkpoint(&r).unwrap();
        (small, e.to_string(), latest)
    });
    let _ = Command::new("umount").arg(&root).status();
    for (rank, (small, e, latest)) in out.iter().enumerate() {
        assert!(
            e.contains("checkpoint_1") || e.contains("rank 0 failed"),
            "rank {rank}: {e}"
        );
        assert_eq!(
            latest.as_ref(),
            Some(small),
            "rank {rank}: the one before stays"
        );
    }
    assert!(out[0].1.contains("No space left"), "{}", out[0].1);
}
