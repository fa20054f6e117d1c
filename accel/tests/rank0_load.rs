//! `load_model_broadcast`: on 4 ranks the checkpoint is read once (by the
//! main process; counted) and every rank ends with the parameters a direct
//! `load_model` gives; a bad checkpoint is an error on every rank. One
//! test in its own binary: the read count is per process.

use accel::train::{model_reads, DEFAULT_MAX_SHARD_SIZE};

mod common;
use common::{ranks, single, Linear};

#[test]
fn one_reader_gives_every_rank_the_parameters_of_a_direct_load() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let mut saved = Linear::new(6);
    saved
        .w
        .iter_mut()
        .enumerate()
        .for_each(|(i, w)| *w = 0.5 + i as f32);
    saved.b[0] = -3.25;
    single()
        .save_model(&saved, &dir, DEFAULT_MAX_SHARD_SIZE)
        .unwrap();

    let before = model_reads();
    let d = dir.clone();
    let broadcast = ranks(4, move |acc| {
        let mut m = Linear::new(6);
        acc.load_model_broadcast(&mut m, &d).unwrap();
        m.flat()
    });
    assert_eq!(model_reads() - before, 1, "one read for 4 ranks");

    let before = model_reads();
    let d = dir.clone();
    let direct = ranks(4, move |acc| {
        let mut m = Linear::new(6);
        acc.load_model(&mut m, &d).unwrap();
        m.flat()
    });
    assert_eq!(model_reads() - before, 4, "load_model reads on every rank");
    assert_eq!(broadcast, direct);
    assert_eq!(broadcast[3], saved.flat());

    // A checkpoint the main process cannot read fails every rank.
    let missing = tmp.path().join("nothing-here");
    let errors = ranks(2, move |acc| {
        let mut m = Linear::new(6);
        acc.load_model_broadcast(&mut m, &missing)
            .unwrap_err()
            .to_string()
    });
    assert!(errors[0].contains("nothing-here"), "{}", errors[0]);
    assert!(errors[1].contains("rank 0 failed"), "{}", errors[1]);
}
