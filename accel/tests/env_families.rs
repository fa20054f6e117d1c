//! The worker environment, malformed or contradictory, over the five
//! launcher families (accel/torchrun, Open MPI, MPICH/Intel MPI, MVAPICH,
//! Slurm): every case is named, and every one is an `InvalidConfig` error
//! whose message names the variable. Legitimate nestings are read, not
//! refused.

use std::collections::HashMap;

use accel_test_support::env_cases;

use accel::{ErrorKind, ProcessState};
use env_cases::{BAD, GOOD};

fn vars(kv: &[(&str, &str)]) -> HashMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn every_malformed_or_contradictory_case_is_an_error_naming_the_variable() {
    let mut wrong = Vec::new();
    for (case, kv, var) in BAD {
        match ProcessState::from_vars(vars(kv)) {
            Ok(s) => wrong.push(format!(
                "{case}: accepted as rank {} of {}",
                s.rank, s.world_size
            )),
            Err(e) if !matches!(e.kind(), ErrorKind::InvalidConfig) => {
                wrong.push(format!("{case}: {:?}, not InvalidConfig: {e}", e.kind()))
            }
            Err(e) if !e.to_string().contains(var) => {
                wrong.push(format!("{case}: the message does not name {var}: {e}"))
            }
            Err(_) => {}
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} cases:\n{}",
        wrong.len(),
        BAD.len(),
        wrong.join("\n")
    );
}

#[test]
fn legitimate_nestings_are_read() {
    for (case, kv, rank, size, source) in GOOD {
        let s = ProcessState::from_vars(vars(kv)).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(
            (s.rank, s.world_size, s.source),
            (*rank, *size, *source),
            "{case}"
        );
    }
}
