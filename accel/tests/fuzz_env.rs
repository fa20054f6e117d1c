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
use proptest::collection::{hash_map, vec};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

#[path = "../../fuzz/budget.rs"]
mod budget;

/// Every variable the parser reads, by family.
const RANKS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_RANK",
    "MV2_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "PMIX_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "ACCEL_RESTART_COUNT",
    "TORCHELASTIC_RESTART_COUNT",
    "MASTER_PORT",
];
const OTHERS: &[&str] = &[
    "SLURM_TASKS_PER_NODE",
    "ACCEL_TIMEOUT",
    "ACCEL_BACKEND",
    "ACCEL_DEBUG",
    "ACCEL_SHARE_DEVICES",
    "ACCEL_LAUNCHER",
    "MASTER_ADDR",
    "ACCEL_STORE_URL",
    "ACCEL_RUN_ID",
    "TORCHELASTIC_RUN_ID",
    "ACCEL_RUN_TOKEN",
    "ACCEL_ERROR_FILE",
    "TORCHELASTIC_ERROR_FILE",
];

/// What the generators may produce. `known_crashes` adds the inputs that
/// crash today's parser (issue 22 items 5 and 11, fixed elsewhere): huge
/// timeouts and huge Slurm repeat counts.
#[derive(Debug, Clone, Copy)]
struct Reach {
    known_crashes: bool,
}

fn number(reach: Reach) -> BoxedStrategy<String> {
    let small = prop_oneof![
        (0u64..8).prop_map(|n| n.to_string()),
        (0u64..100_000).prop_map(|n| n.to_string()),
    ];
    let odd = proptest::sample::select(vec![
        "",
        " ",
        "-1",
        "+1",
        " 3 ",
        "0x10",
        "1e3",
        "1.0",
        "٣",
        "18446744073709551616",
        "99999999999999999999999",
        "4294967296",
        "65535",
        "65536",
        "0",
    ])
    .prop_map(str::to_string);
    let _ = reach;
    prop_oneof![
        6 => small,
        2 => odd,
        1 => any::<u64>().prop_map(|n| n.to_string()),
        1 => "[ -~]{0,6}",
    ]
    .boxed()
}

fn duration(reach: Reach) -> BoxedStrategy<String> {
    let unit = proptest::sample::select(vec!["", "s", "ms", "m", "min", "h", " s", "d", "S", "us"]);
    let amount = prop_oneof![
        (0u64..100_000).prop_map(|n| n.to_string()),
        (0u64..1000, 0u64..1000).prop_map(|(a, b)| format!("{a}.{b}")),
        proptest::sample::select(vec![
            ".", "..", "1..2", ".5", "-5", "+5", "nan", "inf", "1e3"
        ])
        .prop_map(str::to_string),
    ];
    let well = (amount, unit).prop_map(|(a, u)| format!("{a}{u}"));
    if reach.known_crashes {
        let huge = proptest::sample::select(vec![
            "100000000000000000000",
            "9223372036854775808",
            "18446744073709551616s",
            "1e400",
            "99999999999999999999h",
        ])
        .prop_map(str::to_string);
        prop_oneof![6 => well, 2 => huge, 1 => any::<u64>().prop_map(|n| n.to_string()), 1 => "[ -~]{0,8}"]
            .boxed()
    } else {
        prop_oneof![6 => well, 1 => "[ -~]{0,8}"].boxed()
    }
}

fn tasks_per_node(reach: Reach) -> BoxedStrategy<String> {
    let rep_max = if reach.known_crashes { u64::MAX } else { 64 };
    let part = prop_oneof![
        (0u64..8).prop_map(|n| n.to_string()),
        (0u64..8, 0u64..rep_max).prop_map(|(n, r)| format!("{n}(x{r})")),
        "[0-9(x),]{0,5}",
    ];
    vec(part, 1..4).prop_map(|v| v.join(",")).boxed()
}

fn value_for(name: &'static str, reach: Reach) -> BoxedStrategy<String> {
    let free = "[ -~]{0,12}".boxed();
    match name {
        "ACCEL_TIMEOUT" => prop_oneof![4 => duration(reach), 1 => free].boxed(),
        "SLURM_TASKS_PER_NODE" => prop_oneof![4 => tasks_per_node(reach), 1 => free].boxed(),
        "ACCEL_DEBUG" | "ACCEL_SHARE_DEVICES" => prop_oneof![
            4 => proptest::sample::select(vec!["", "0", "1", "true", "no", "YES", " on ", "2"])
                .prop_map(str::to_string),
            1 => free,
        ]
        .boxed(),
        "ACCEL_LAUNCHER" => prop_oneof![Just("accel".to_string()), free].boxed(),
        "ACCEL_BACKEND" => prop_oneof![
            proptest::sample::select(vec!["cpu-gloo", "mpi,single", ",", "", " Single "])
                .prop_map(str::to_string),
            free
        ]
        .boxed(),
        n if RANKS.contains(&n) => number(reach),
        _ => free,
    }
}

/// A coherent launch of one family (so that the accepting path is
/// reached), then a few variables overwritten or added at random.
fn vars(reach: Reach) -> impl Strategy<Value = HashMap<String, String>> {
    let family = (0usize..5, 1usize..9, 0usize..8, 1usize..5).prop_map(|(f, size, rank, local)| {
        let rank = rank % size;
        let local = local.min(size);
        let names: &[&str] = match f {
            0 => &["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
            1 => &[
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            ],
            2 => &[
                "MV2_COMM_WORLD_RANK",
                "MV2_COMM_WORLD_SIZE",
                "MV2_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_SIZE",
            ],
            3 => &["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
            _ => &["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
        };
        let values = [rank, size, rank % local, local];
        names
            .iter()
            .zip(values)
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect::<HashMap<_, _>>()
    });
    let all: Vec<&'static str> = RANKS.iter().chain(OTHERS).copied().collect();
    let extra = vec(
        proptest::sample::select(all).prop_flat_map(move |n| (Just(n), value_for(n, reach))),
        0..5,
    );
    let noise = hash_map("[A-Z_]{1,8}", "[ -~]{0,6}", 0..2);
    (proptest::option::weighted(0.8, family), extra, noise).prop_map(|(family, extra, noise)| {
        let mut m = family.unwrap_or_default();
        m.extend(noise);
        for (n, v) in extra {
            m.insert(n.to_string(), v);
        }
        m
    })
}

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
