//! The facade end to end in one process: state → registry → single backend.

use std::collections::HashMap;
use std::sync::Arc;

use accel::{Accelerator, CollectivesExt, ErrorKind, ProcessState, ReduceOp, Registry};

fn state(kv: &[(&str, &str)]) -> Arc<ProcessState> {
    let vars: HashMap<String, String> = kv
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Arc::new(ProcessState::from_vars(vars).unwrap())
}

#[test]
fn one_process_run_selects_single_and_runs_collectives() {
    let acc = Accelerator::connect(state(&[]), &Registry::builtin()).unwrap();
    assert_eq!(acc.backend_name(), "single");
    assert!(acc.is_main_process() && acc.is_local_main_process() && acc.is_last_process());
    let mut v = vec![1.5f32, -2.0];
    acc.all_reduce(&mut v, ReduceOp::Avg).unwrap();
    assert_eq!(v, vec![1.5, -2.0]);
    assert_eq!(acc.gather(&[3i64]).unwrap(), vec![3]);
    assert_eq!(acc.on_main_process(|| 7), Some(7));
    assert_eq!(acc.on_process(1, || 7), None);
    assert_eq!(acc.main_process_first(|| "x").unwrap(), "x");
    acc.wait_for_everyone().unwrap();
    assert_eq!(acc.split_between_processes(&[1, 2, 3]), &[1, 2, 3]);
    assert_eq!(
        acc.comm().gather_object(&("a".to_string(), 1)).unwrap(),
        vec![("a".to_string(), 1)]
    );
}

#[test]
fn forcing_an_unknown_backend_is_a_clear_error() {
    let e = Accelerator::connect(
        state(&[("ACCEL_BACKEND", "warp-drive")]),
        &Registry::builtin(),
    )
    .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidConfig), "{e}");
    assert!(
        e.to_string().contains("warp-drive") && e.to_string().contains("single"),
        "{e}"
    );
}

#[test]
fn debug_mode_wraps_the_communicator() {
    let acc = Accelerator::connect(state(&[("ACCEL_DEBUG", "1")]), &Registry::builtin()).unwrap();
    assert!(format!("{:?}", acc.comm()).contains("single"));
    let mut v = vec![1u8; 3];
    for _ in 0..5 {
        acc.all_reduce(&mut v, ReduceOp::Max).unwrap();
    }
    acc.wait_for_everyone().unwrap();
    assert_eq!(v, vec![1, 1, 1]);
}

#[test]
fn single_refuses_a_multi_process_run() {
    let s = state(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("ACCEL_BACKEND", "single"),
        ("ACCEL_STORE_URL", "memory:"),
    ]);
    let e = Accelerator::connect(s, &Registry::builtin()).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Unavailable), "{e}");
    assert!(e.to_string().contains("one process only"), "{e}");
}
