//! The conformance harness across machines: two "machines" of two ranks
//! each, one `accel_launch::Machines` coordinator per machine in this test
//! process on loopback (machine 0 hosts the store, machine 1 joins it, as
//! `accel launch --num-machines 2` does), run every scenario of the
//! library on cpu-gloo. The world runs under the harness's hard timeout.

#![cfg(feature = "cpu-gloo")]

use std::path::PathBuf;
use std::time::Duration;

use accel_conformance::all_scenarios;
use accel_conformance::harness::{Matrix, RunSpec};

#[test]
fn the_suite_passes_across_two_coordinators_on_loopback() {
    let worker = PathBuf::from(env!("CARGO_BIN_EXE_accel-conformance-worker"));
    let mut spec = RunSpec::new("cpu-gloo", 4, worker).with_machines(2);
    spec.hard_timeout = Duration::from_secs(240);
    assert_eq!(spec.label(), "cpu-gloo@2x2");
    let matrix = Matrix::run(&[spec]);
    let text = matrix.render();
    println!("{text}");
    let world = &matrix.worlds[0];
    assert_eq!(world.error, None, "{text}");
    let ran: Vec<&str> = world.results.iter().map(|r| r.name.as_str()).collect();
    let all: Vec<&str> = all_scenarios().iter().map(|s| s.name).collect();
    assert_eq!(ran, all, "{text}");
    let s = matrix.summary();
    assert_eq!((s.passed, s.failed, s.skipped), (all.len(), 0, 0), "{text}");
}
