//! The worker-environment cases the facade's tests and the launcher's
//! `accel env` test share: malformed or contradictory environments over
//! the five launcher families (each refused naming a variable), and
//! legitimate nestings (each read).

use accel::LaunchSource;

pub mod generate;

/// Variables of one case.
pub type Env = &'static [(&'static str, &'static str)];

/// (case, variables, the variable the message must name)
pub const BAD: &[(&str, Env, &str)] = &[
    // ---- ranges and edge values (issue 32 item 4) ----
    (
        "machine rank beyond the machines",
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "7"),
        ],
        "GROUP_RANK",
    ),
    (
        "slurm node id beyond the node list",
        &[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODEID", "5"),
            ("SLURM_TASKS_PER_NODE", "1(x2)"),
        ],
        "SLURM_NODEID",
    ),
    (
        "slurm node id beyond the tasks",
        &[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODEID", "5"),
        ],
        "SLURM_NODEID",
    ),
    (
        "timeout below 1 ms",
        &[("ACCEL_TIMEOUT", "100ns")],
        "ACCEL_TIMEOUT",
    ),
    (
        "timeout of 999 us",
        &[("ACCEL_TIMEOUT", "999us")],
        "ACCEL_TIMEOUT",
    ),
    // ---- accel / torchrun ----
    (
        "rank with a plus sign",
        &[("RANK", "+1"), ("WORLD_SIZE", "2")],
        "RANK",
    ),
    (
        "negative rank",
        &[("RANK", "-1"), ("WORLD_SIZE", "2")],
        "RANK",
    ),
    (
        "rank not a number",
        &[("RANK", "x"), ("WORLD_SIZE", "2")],
        "RANK",
    ),
    (
        "rank in hex",
        &[("RANK", "0x1"), ("WORLD_SIZE", "2")],
        "RANK",
    ),
    (
        "rank with an exponent",
        &[("RANK", "1e0"), ("WORLD_SIZE", "2")],
        "RANK",
    ),
    ("empty rank", &[("RANK", ""), ("WORLD_SIZE", "2")], "RANK"),
    ("rank without world size", &[("RANK", "0")], "WORLD_SIZE"),
    ("world size without rank", &[("WORLD_SIZE", "2")], "RANK"),
    (
        "world size zero",
        &[("RANK", "0"), ("WORLD_SIZE", "0")],
        "WORLD_SIZE",
    ),
    (
        "world size overflows",
        &[("RANK", "0"), ("WORLD_SIZE", "99999999999999999999999")],
        "WORLD_SIZE",
    ),
    (
        "rank not below world size",
        &[("RANK", "2"), ("WORLD_SIZE", "2")],
        "RANK",
    ),
    (
        "local rank not below local world size",
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ],
        "LOCAL_RANK",
    ),
    (
        "local rank not below world size",
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "2")],
        "LOCAL_RANK",
    ),
    (
        "local world size zero",
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "0"),
        ],
        "LOCAL_WORLD_SIZE",
    ),
    (
        "local world size above world size",
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "3"),
        ],
        "LOCAL_WORLD_SIZE",
    ),
    (
        "local rank with a plus sign",
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "+0")],
        "LOCAL_RANK",
    ),
    (
        "group rank not a number",
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("GROUP_RANK", "one")],
        "GROUP_RANK",
    ),
    (
        "master port out of range",
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")],
        "MASTER_PORT",
    ),
    (
        "master port negative",
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "-1")],
        "MASTER_PORT",
    ),
    (
        "master port zero with peers",
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "0"),
        ],
        "MASTER_PORT",
    ),
    (
        "timeout not a duration",
        &[("ACCEL_TIMEOUT", "soon")],
        "ACCEL_TIMEOUT",
    ),
    ("timeout zero", &[("ACCEL_TIMEOUT", "0")], "ACCEL_TIMEOUT"),
    (
        "timeout negative",
        &[("ACCEL_TIMEOUT", "-5s")],
        "ACCEL_TIMEOUT",
    ),
    (
        "timeout unknown unit",
        &[("ACCEL_TIMEOUT", "5 fortnights")],
        "ACCEL_TIMEOUT",
    ),
    (
        "timeout huge",
        &[("ACCEL_TIMEOUT", "100000000000000000000")],
        "ACCEL_TIMEOUT",
    ),
    (
        "timeout above a year",
        &[("ACCEL_TIMEOUT", "400d")],
        "ACCEL_TIMEOUT",
    ),
    (
        "debug not a boolean",
        &[("ACCEL_DEBUG", "maybe")],
        "ACCEL_DEBUG",
    ),
    (
        "share devices not a boolean",
        &[("ACCEL_SHARE_DEVICES", "2")],
        "ACCEL_SHARE_DEVICES",
    ),
    (
        "restart count negative",
        &[("ACCEL_RESTART_COUNT", "-1")],
        "ACCEL_RESTART_COUNT",
    ),
    (
        "torchelastic restart count malformed",
        &[("TORCHELASTIC_RESTART_COUNT", "x")],
        "TORCHELASTIC_RESTART_COUNT",
    ),
    (
        "torchelastic max restarts malformed",
        &[("TORCHELASTIC_MAX_RESTARTS", "+3")],
        "TORCHELASTIC_MAX_RESTARTS",
    ),
    // ---- Open MPI ----
    (
        "open mpi rank without size",
        &[("OMPI_COMM_WORLD_RANK", "0")],
        "OMPI_COMM_WORLD_SIZE",
    ),
    (
        "open mpi size without rank",
        &[("OMPI_COMM_WORLD_SIZE", "2")],
        "OMPI_COMM_WORLD_RANK",
    ),
    (
        "open mpi rank not below size",
        &[("OMPI_COMM_WORLD_RANK", "4"), ("OMPI_COMM_WORLD_SIZE", "4")],
        "OMPI_COMM_WORLD_RANK",
    ),
    (
        "open mpi size zero",
        &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "0")],
        "OMPI_COMM_WORLD_SIZE",
    ),
    (
        "open mpi rank with a plus sign",
        &[
            ("OMPI_COMM_WORLD_RANK", "+1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ],
        "OMPI_COMM_WORLD_RANK",
    ),
    (
        "open mpi local rank not below local size",
        &[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
        ],
        "OMPI_COMM_WORLD_LOCAL_RANK",
    ),
    (
        "open mpi local size malformed",
        &[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "two"),
        ],
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        "open mpi contradicts RANK set by hand",
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ],
        "OMPI_COMM_WORLD_SIZE",
    ),
    (
        "open mpi contradicts PMI",
        &[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "4"),
        ],
        "PMI_RANK",
    ),
    // ---- MPICH / Intel MPI ----
    (
        "pmi rank negative",
        &[("PMI_RANK", "-1"), ("PMI_SIZE", "3")],
        "PMI_RANK",
    ),
    (
        "pmi size malformed",
        &[("PMI_RANK", "0"), ("PMI_SIZE", "3x")],
        "PMI_SIZE",
    ),
    ("pmi rank without size", &[("PMI_RANK", "0")], "PMI_SIZE"),
    (
        "mpich local rank not below local size",
        &[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "3"),
            ("MPI_LOCALRANKID", "3"),
            ("MPI_LOCALNRANKS", "3"),
        ],
        "MPI_LOCALRANKID",
    ),
    (
        "pmi contradicts RANK set by hand",
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "3"),
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "3"),
        ],
        "PMI_RANK",
    ),
    // ---- MVAPICH ----
    (
        "mvapich rank not below size",
        &[("MV2_COMM_WORLD_RANK", "2"), ("MV2_COMM_WORLD_SIZE", "2")],
        "MV2_COMM_WORLD_RANK",
    ),
    (
        "mvapich size without rank",
        &[("MV2_COMM_WORLD_SIZE", "2")],
        "MV2_COMM_WORLD_RANK",
    ),
    (
        "mvapich local rank malformed",
        &[
            ("MV2_COMM_WORLD_RANK", "0"),
            ("MV2_COMM_WORLD_SIZE", "2"),
            ("MV2_COMM_WORLD_LOCAL_RANK", "-0"),
        ],
        "MV2_COMM_WORLD_LOCAL_RANK",
    ),
    (
        "mvapich contradicts open mpi",
        &[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MV2_COMM_WORLD_RANK", "1"),
            ("MV2_COMM_WORLD_SIZE", "3"),
        ],
        "MV2_COMM_WORLD_SIZE",
    ),
    // ---- Slurm ----
    (
        "slurm rank not below tasks",
        &[("SLURM_PROCID", "7"), ("SLURM_NTASKS", "7")],
        "SLURM_PROCID",
    ),
    (
        "slurm tasks without rank",
        &[("SLURM_NTASKS", "4")],
        "SLURM_PROCID",
    ),
    (
        "slurm rank with a plus sign",
        &[("SLURM_PROCID", "+0"), ("SLURM_NTASKS", "4")],
        "SLURM_PROCID",
    ),
    (
        "slurm local id malformed",
        &[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "x"),
        ],
        "SLURM_LOCALID",
    ),
    (
        "slurm node id malformed",
        &[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NODEID", "n1"),
        ],
        "SLURM_NODEID",
    ),
    (
        "slurm tasks per node malformed",
        &[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "2(x"),
        ],
        "SLURM_TASKS_PER_NODE",
    ),
    (
        "slurm contradicts RANK set by hand",
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
        ],
        "SLURM_PROCID",
    ),
    (
        "slurm size contradicts WORLD_SIZE set by hand",
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
        ],
        "SLURM_NTASKS",
    ),
];

/// (case, variables, expected rank, world size, family)
pub const GOOD: &[(&str, Env, usize, usize, LaunchSource)] = &[
    (
        "leading zeros are decimal",
        &[("RANK", "007"), ("WORLD_SIZE", " 010 ")],
        7,
        10,
        LaunchSource::Torchrun,
    ),
    (
        "a timeout of exactly 1 ms",
        &[("ACCEL_TIMEOUT", "1ms")],
        0,
        1,
        LaunchSource::None,
    ),
    (
        "accel launch worker inside an outer mpirun",
        &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("ACCEL_LAUNCHER", "accel"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
        ],
        1,
        2,
        LaunchSource::Accel,
    ),
    (
        "accel launch worker inside srun",
        &[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("ACCEL_LAUNCHER", "accel"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ],
        3,
        4,
        LaunchSource::Accel,
    ),
    (
        "torchrun worker under srun (one torchrun per node)",
        &[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("TORCHELASTIC_RUN_ID", "j"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
        ],
        5,
        8,
        LaunchSource::Torchrun,
    ),
    (
        "mpirun inside an sbatch allocation",
        &[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
        ],
        3,
        4,
        LaunchSource::OpenMpi,
    ),
    (
        "srun with PMI agreeing",
        &[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "4"),
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
        ],
        2,
        4,
        LaunchSource::Mpich,
    ),
    (
        "spaces around numbers",
        &[("RANK", " 1 "), ("WORLD_SIZE", "2\n")],
        1,
        2,
        LaunchSource::Torchrun,
    ),
];
