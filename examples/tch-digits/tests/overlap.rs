//! The digits model's gradient synchronisation overlaps libtorch's
//! backward: on 2 ranks (threads over cpu-gloo), every synchronising
//! batch started a gradient bucket's all-reduce from libtorch's gradient
//! hooks, before the backward returned
//! (`PreparedModel::last_sync_started_early`, counted in
//! `Report::early_syncs`); none did with `--no-overlap`.

use accel_example_tch_digits::{train, Digits, Options};

use accel_test_support::ranks;
use ranks::two_ranks;

#[test]
fn every_synchronising_batch_starts_a_bucket_during_the_backward() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut opts = Options::default();
    opts.run.data = Digits::default_path();
    assert!(
        opts.run.data.exists(),
        "{} is missing: run scripts/digits_data.sh (or make tch-setup) first",
        opts.run.data.display()
    );
    opts.run.train_len = Some(160);
    opts.run.epochs = 1;
    opts.run.batch_size = 8;
    opts.run.accumulation = 1;
    opts.run.no_eval = true;
    opts.run.save_every = 0;
    opts.run.checkpoint_dir = dir.path().join("ck");
    opts.own.log_dir = None;
    for overlap in [true, false] {
        opts.run.overlap = overlap;
        let o = opts.clone();
        let reports = two_ranks(move |acc| train(acc, &o, |_| {}));
        for (rank, r) in reports.iter().enumerate() {
            assert_eq!(r.steps, 10, "rank {rank}");
            let want = if overlap { r.steps } else { 0 };
            assert_eq!(
                r.early_syncs, want,
                "overlap {overlap}: rank {rank}'s batches with a bucket started during the backward"
            );
        }
    }
}
