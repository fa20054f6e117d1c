//! The generators of random worker environments: a coherent launch of one
//! family, then variables overwritten or added at random (the facade's
//! fuzzing and the launcher's `accel env` comparison share them).

use std::collections::HashMap;

use proptest::collection::{hash_map, vec};
use proptest::prelude::*;

/// Every variable the parser reads, by family.
pub const RANKS: &[&str] = &[
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
/// The other variables the parser reads (no count or index).
pub const OTHERS: &[&str] = &[
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
pub struct Reach {
    /// Also the inputs that once crashed the parser.
    pub known_crashes: bool,
}

/// A count or index, well formed or not.
pub fn number(reach: Reach) -> BoxedStrategy<String> {
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

/// A duration, well formed or not.
pub fn duration(reach: Reach) -> BoxedStrategy<String> {
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

/// A `SLURM_TASKS_PER_NODE` value, well formed or not.
pub fn tasks_per_node(reach: Reach) -> BoxedStrategy<String> {
    let rep_max = if reach.known_crashes { u64::MAX } else { 64 };
    let part = prop_oneof![
        (0u64..8).prop_map(|n| n.to_string()),
        (0u64..8, 0u64..rep_max).prop_map(|(n, r)| format!("{n}(x{r})")),
        "[0-9(x),]{0,5}",
    ];
    vec(part, 1..4).prop_map(|v| v.join(",")).boxed()
}

/// A value for variable `name`.
pub fn value_for(name: &'static str, reach: Reach) -> BoxedStrategy<String> {
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
pub fn vars(reach: Reach) -> impl Strategy<Value = HashMap<String, String>> {
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
