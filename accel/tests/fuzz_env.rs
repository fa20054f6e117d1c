//! Bounded fuzzing of the environment parser through its public entries:
//! `ProcessState::from_vars` (what `from_env` does with the real
//! environment) and `state::parse_duration`. Inputs are maps over the
//! variables of every launcher family with arbitrary, numeric-looking and
//! edge values. Properties: no panic; a state that parses is coherent; a
//! refusal is an `InvalidConfig` error that names a variable that was set.
//!
//! `ACCEL_FUZZ_SECONDS=600 cargo test -p accel --test fuzz_env --
//! --test-threads=1 --nocapture` runs each property for that long.

use std::collections::HashMap;
use std::time::Duration;

use accel::state::parse_duration;
use accel::{ErrorKind, ProcessState};
use env_cases::generate::{duration, vars, Reach};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use accel_test_support::{env_cases, fuzz::budget};

fn check_state(vars: &HashMap<String, String>) -> Result<(), TestCaseError> {
    match ProcessState::from_vars(vars.clone()) {
        Ok(s) => {
            prop_assert!(s.world_size >= 1);
            prop_assert!(s.rank < s.world_size, "rank {} of {}", s.rank, s.world_size);
            prop_assert!(s.local_world_size >= 1);
            prop_assert!(s.local_rank < s.local_world_size.max(s.world_size));
            prop_assert!(s.timeout > Duration::ZERO);
            if let Some(b) = &s.backend {
                prop_assert!(!b.is_empty() && b.iter().all(|x| !x.is_empty()));
            }
            prop_assert!(s.token.as_deref() != Some(""));
        }
        Err(e) => {
            prop_assert_eq!(e.kind(), &ErrorKind::InvalidConfig, "{}", e);
            // The refusal names a variable of the input, so the user knows
            // what to fix.
            let text = e.to_string();
            prop_assert!(
                vars.keys().any(|k| text.contains(k.as_str())),
                "the error names no variable that was set: {}",
                text
            );
        }
    }
    Ok(())
}

#[test]
fn the_environment_never_panics_and_refusals_name_a_variable() {
    budget::fuzz(
        "env/from_vars",
        3000,
        vars(Reach {
            known_crashes: false,
        }),
        |v| check_state(&v),
    );
}

#[test]
fn durations_never_panic_and_are_positive() {
    let input = prop_oneof![
        duration(Reach {
            known_crashes: false
        }),
        any::<String>(),
    ];
    budget::fuzz("env/duration", 5000, input, |v| {
        match parse_duration("ACCEL_TIMEOUT", &v) {
            Ok(d) => prop_assert!(d > Duration::ZERO, "{:?} -> {:?}", v, d),
            Err(e) => prop_assert!(e.to_string().contains("ACCEL_TIMEOUT"), "{}", e),
        }
        Ok(())
    });
}

/// Also the inputs that crash today's parser: `ACCEL_TIMEOUT=1e20` (issue
/// 22 item 5) and `SLURM_TASKS_PER_NODE=1(x18446744073709551615)` (a
/// repeat count that is allocated). Enable when those fixes land.
#[test]
fn the_environment_never_panics_even_on_huge_values() {
    let reach = Reach {
        known_crashes: true,
    };
    budget::fuzz("env/from_vars-huge", 3000, vars(reach), |v| check_state(&v));
    budget::fuzz("env/duration-huge", 3000, duration(reach), |v| {
        if let Ok(d) = parse_duration("ACCEL_TIMEOUT", &v) {
            prop_assert!(d > Duration::ZERO);
        }
        Ok(())
    });
}
