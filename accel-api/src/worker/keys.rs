//! The variable names of the contract (accel's and torchrun's).

/// Global rank.
pub const RANK: &str = "RANK";
/// Processes in the run.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank on this machine.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Processes on this machine.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// This machine's rank (torchrun's node rank).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// Machines in the run.
pub const GROUP_WORLD_SIZE: &str = "GROUP_WORLD_SIZE";
/// torchrun's role rank (= RANK: accel has one role).
pub const ROLE_RANK: &str = "ROLE_RANK";
/// torchrun's role world size (= WORLD_SIZE).
pub const ROLE_WORLD_SIZE: &str = "ROLE_WORLD_SIZE";
/// Where the store listens (host).
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Where the store listens (port).
pub const MASTER_PORT: &str = "MASTER_PORT";
/// `accel` when `accel launch` started the worker.
pub const ACCEL_LAUNCHER: &str = "ACCEL_LAUNCHER";
/// The launcher's pid (the worker ties its life to it).
pub const ACCEL_LAUNCHER_PID: &str = "ACCEL_LAUNCHER_PID";
/// The store's URL (`tcp://h:p`, `file:///dir`).
pub const ACCEL_STORE_URL: &str = "ACCEL_STORE_URL";
/// The run's name.
pub const ACCEL_RUN_ID: &str = "ACCEL_RUN_ID";
/// The store's shared secret.
pub const ACCEL_RUN_TOKEN: &str = "ACCEL_RUN_TOKEN";
/// The bound of every blocking call.
pub const ACCEL_TIMEOUT: &str = "ACCEL_TIMEOUT";
/// Backends to choose from, in order.
pub const ACCEL_BACKEND: &str = "ACCEL_BACKEND";
/// Debug mode (0/1).
pub const ACCEL_DEBUG: &str = "ACCEL_DEBUG";
/// Mixed precision of the training loop (`no`, `bf16`, `fp16`).
pub const ACCEL_MIXED_PRECISION: &str = "ACCEL_MIXED_PRECISION";
/// ZeRO sharding stage of the training loop (`none`, `optimizer`,
/// `gradients`, `full`).
pub const ACCEL_SHARDING: &str = "ACCEL_SHARDING";
/// Gradient accumulation steps of the training loop, where the program
/// leaves them at 1 (`accel launch --gradient-accumulation-steps`).
pub const ACCEL_GRADIENT_ACCUMULATION_STEPS: &str = "ACCEL_GRADIENT_ACCUMULATION_STEPS";
/// Accelerate's mixed precision, which its `Accelerator()` reads where
/// the script passes none (written alongside ACCEL_MIXED_PRECISION).
pub const ACCELERATE_MIXED_PRECISION: &str = "ACCELERATE_MIXED_PRECISION";
/// Accelerate's gradient accumulation steps, read by its
/// `Accelerator()` where the script passes none (written alongside
/// ACCEL_GRADIENT_ACCUMULATION_STEPS).
pub const ACCELERATE_GRADIENT_ACCUMULATION_STEPS: &str = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS";
/// The attempt number, 0 first.
pub const ACCEL_RESTART_COUNT: &str = "ACCEL_RESTART_COUNT";
/// Where a crashing worker writes its root cause.
pub const ACCEL_ERROR_FILE: &str = "ACCEL_ERROR_FILE";
/// Where flight-recorder dumps go (`accel launch --dump-dir`; read by
/// `accel trace`).
pub const ACCEL_DUMP_DIR: &str = "ACCEL_DUMP_DIR";
/// Allow more local ranks than devices.
pub const ACCEL_SHARE_DEVICES: &str = "ACCEL_SHARE_DEVICES";
/// `processes` (one rank per process) or `threads` (this process hosts
/// LOCAL_WORLD_SIZE rank threads; docs/adr/0015-process-model.md).
pub const ACCEL_PROCESS_MODEL: &str = "ACCEL_PROCESS_MODEL";
/// torchrun's run id.
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// torchrun's restart count.
pub const TORCHELASTIC_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// torchrun's restart limit.
pub const TORCHELASTIC_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
/// torchrun's error file.
pub const TORCHELASTIC_ERROR_FILE: &str = "TORCHELASTIC_ERROR_FILE";
/// torchrun's `True` when its agent hosts the store at MASTER_ADDR:MASTER_PORT.
pub const TORCHELASTIC_USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// Variables an MPI launcher sets itself: a launcher that delegates to
/// mpirun removes these from mpirun's environment.
pub const NUMBERED_BY_LAUNCHER: [&str; 10] = [
    RANK,
    WORLD_SIZE,
    LOCAL_RANK,
    LOCAL_WORLD_SIZE,
    GROUP_RANK,
    GROUP_WORLD_SIZE,
    ROLE_RANK,
    ROLE_WORLD_SIZE,
    ACCEL_LAUNCHER,
    ACCEL_LAUNCHER_PID,
];
