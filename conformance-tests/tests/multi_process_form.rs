//! `conformance_tests!`'s multi-process form, as docs/conformance.md shows
//! it: one `#[test]` per scenario, each world one process per rank through
//! the harness and this crate's worker binary (a plugin's `.so` goes in
//! `plugin = Some(path)`).

accel_conformance::conformance_tests!(
    backend = "cpu-gloo",
    plugin = None::<&str>,
    worker = env!("CARGO_BIN_EXE_accel-conformance-worker"),
    world_sizes = [1, 2],
    scenarios = [all_reduce, broadcast, barrier_ordering, lost_rank_is_named],
);
