//! The burn digits demo as separate processes on 2 ranks over cpu-gloo
//! (every one under a hard timeout): it reaches 95 % held-out accuracy in
//! 10 epochs, every held-out image counted once; a run stopped 3 optimizer
//! steps after a checkpoint (mid-epoch, mid-accumulation) and resumed ends
//! with the parameter checksum of an uninterrupted run.
//!
//! Ranks are started directly with torchrun-style variables and a file
//! store, so the tests need no launcher binary (`make demo-burn` runs the
//! demo through `accel launch`).

use accel_example_burn_digits::Digits;

accel_test_support::digits_demo_tests!(
    exe = env!("CARGO_BIN_EXE_burn-digits"),
    data = Digits::default_path(),
);
