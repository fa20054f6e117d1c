//! [`WorkerEnv`]: the variables one worker gets, written with
//! [`WorkerEnv::to_vars`] and read back with [`WorkerEnv::from_vars`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use super::keys;
use super::parse::{
    format_duration, parse_accumulation_steps, parse_duration, parse_flag, parse_number,
};
use super::settings::{MixedPrecision, ProcessModel, Stage};
use crate::{Error, Result};

/// The variables one worker gets. `None` fields are not written (and read
/// back as `None` when absent).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerEnv {
    /// RANK (also ROLE_RANK).
    pub rank: Option<usize>,
    /// WORLD_SIZE (also ROLE_WORLD_SIZE).
    pub world_size: Option<usize>,
    /// LOCAL_RANK.
    pub local_rank: Option<usize>,
    /// LOCAL_WORLD_SIZE.
    pub local_world_size: Option<usize>,
    /// GROUP_RANK.
    pub group_rank: Option<usize>,
    /// GROUP_WORLD_SIZE.
    pub group_world_size: Option<usize>,
    /// MASTER_ADDR.
    pub master_addr: Option<String>,
    /// MASTER_PORT.
    pub master_port: Option<u16>,
    /// ACCEL_STORE_URL.
    pub store_url: Option<String>,
    /// ACCEL_RUN_ID (also TORCHELASTIC_RUN_ID).
    pub run_id: Option<String>,
    /// ACCEL_RUN_TOKEN.
    pub token: Option<String>,
    /// ACCEL_TIMEOUT.
    pub timeout: Option<Duration>,
    /// ACCEL_BACKEND.
    pub backend: Option<Vec<String>>,
    /// ACCEL_DEBUG.
    pub debug: Option<bool>,
    /// ACCEL_MIXED_PRECISION (`accel launch --mixed-precision`).
    pub mixed_precision: Option<MixedPrecision>,
    /// ACCEL_SHARDING (`accel launch --sharding`).
    pub sharding: Option<Stage>,
    /// ACCEL_GRADIENT_ACCUMULATION_STEPS (`accel launch
    /// --gradient-accumulation-steps`), at least 1.
    pub gradient_accumulation_steps: Option<usize>,
    /// ACCEL_RESTART_COUNT (also TORCHELASTIC_RESTART_COUNT).
    pub restart_count: Option<u32>,
    /// TORCHELASTIC_MAX_RESTARTS.
    pub max_restarts: Option<u32>,
    /// ACCEL_ERROR_FILE (also TORCHELASTIC_ERROR_FILE).
    pub error_file: Option<PathBuf>,
    /// ACCEL_DUMP_DIR: where flight-recorder dumps go.
    pub dump_dir: Option<PathBuf>,
    /// ACCEL_LAUNCHER (`accel` for `accel launch`).
    pub launcher: Option<String>,
    /// ACCEL_LAUNCHER_PID.
    pub launcher_pid: Option<u32>,
    /// ACCEL_SHARE_DEVICES.
    pub share_devices: Option<bool>,
    /// ACCEL_PROCESS_MODEL.
    pub process_model: Option<ProcessModel>,
    /// TORCHELASTIC_USE_AGENT_STORE: the launcher hosts a torch TCPStore at
    /// MASTER_ADDR:MASTER_PORT for torch workers (as torchrun's agent does),
    /// so that their rank 0 does not try to host one there.
    pub agent_store: Option<bool>,
}

/// Where the flight-recorder dumps of run `run_id` go when
/// `ACCEL_DUMP_DIR` is not set: `<temp>/accel-dumps/<run id>` (the worker
/// and the launcher agree on it).
pub fn default_dump_dir(run_id: &str) -> PathBuf {
    std::env::temp_dir().join("accel-dumps").join(run_id)
}

fn bool_str(b: bool) -> String {
    if b { "1" } else { "0" }.to_string()
}

impl WorkerEnv {
    /// The variables to set, torchrun's aliases included (ROLE_RANK,
    /// ROLE_WORLD_SIZE, TORCHELASTIC_*), in a stable order.
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        use keys::*;
        let mut v: Vec<(&'static str, String)> = Vec::with_capacity(24);
        let mut put = |k: &'static str, val: Option<String>| {
            if let Some(val) = val {
                v.push((k, val));
            }
        };
        let s = |x: Option<usize>| x.map(|n| n.to_string());
        put(RANK, s(self.rank));
        put(LOCAL_RANK, s(self.local_rank));
        put(WORLD_SIZE, s(self.world_size));
        put(LOCAL_WORLD_SIZE, s(self.local_world_size));
        put(GROUP_RANK, s(self.group_rank));
        put(GROUP_WORLD_SIZE, s(self.group_world_size));
        put(ROLE_RANK, s(self.rank));
        put(ROLE_WORLD_SIZE, s(self.world_size));
        put(MASTER_ADDR, self.master_addr.clone());
        put(MASTER_PORT, self.master_port.map(|p| p.to_string()));
        put(ACCEL_LAUNCHER, self.launcher.clone());
        put(ACCEL_LAUNCHER_PID, self.launcher_pid.map(|p| p.to_string()));
        put(ACCEL_STORE_URL, self.store_url.clone());
        put(ACCEL_RUN_ID, self.run_id.clone());
        put(ACCEL_RUN_TOKEN, self.token.clone());
        put(ACCEL_TIMEOUT, self.timeout.map(format_duration));
        put(ACCEL_BACKEND, self.backend.as_ref().map(|b| b.join(",")));
        put(ACCEL_DEBUG, self.debug.map(bool_str));
        put(
            ACCEL_MIXED_PRECISION,
            self.mixed_precision.map(|m| m.name().to_string()),
        );
        put(
            ACCEL_SHARDING,
            self.sharding.map(|s| s.as_str().to_string()),
        );
        let steps = self.gradient_accumulation_steps.map(|n| n.to_string());
        put(ACCEL_GRADIENT_ACCUMULATION_STEPS, steps.clone());
        // The same settings under Accelerate's names, for Accelerate
        // scripts under `accel launch` (as `accelerate launch` sets them).
        put(
            ACCELERATE_MIXED_PRECISION,
            self.mixed_precision.map(|m| m.name().to_string()),
        );
        put(ACCELERATE_GRADIENT_ACCUMULATION_STEPS, steps);
        put(
            ACCEL_RESTART_COUNT,
            self.restart_count.map(|n| n.to_string()),
        );
        let err = self
            .error_file
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned());
        put(ACCEL_ERROR_FILE, err.clone());
        put(
            ACCEL_DUMP_DIR,
            self.dump_dir
                .as_ref()
                .map(|p| p.to_string_lossy().into_owned()),
        );
        put(ACCEL_SHARE_DEVICES, self.share_devices.map(bool_str));
        put(
            ACCEL_PROCESS_MODEL,
            self.process_model.map(|m| m.as_str().to_string()),
        );
        put(TORCHELASTIC_RUN_ID, self.run_id.clone());
        put(
            TORCHELASTIC_RESTART_COUNT,
            self.restart_count.map(|n| n.to_string()),
        );
        put(
            TORCHELASTIC_MAX_RESTARTS,
            self.max_restarts.map(|n| n.to_string()),
        );
        put(TORCHELASTIC_ERROR_FILE, err);
        put(
            TORCHELASTIC_USE_AGENT_STORE,
            self.agent_store
                .map(|b| if b { "True" } else { "False" }.to_string()),
        );
        v
    }

    /// Read the contract back from `vars`: each value checked, torchrun's
    /// names used where accel's are absent. Launcher families other than
    /// accel/torchrun (MPI, Slurm) are read by the runtime
    /// (`accel::ProcessState::from_vars`).
    ///
    /// # Errors
    /// [`crate::ErrorKind::InvalidConfig`] naming the variable and its
    /// value: a number with a sign or non-digits, a port outside 1-65535
    /// (0 is read, and refused later for a multi-process run), a malformed
    /// boolean or duration, a duration above [`MAX_TIMEOUT`](super::MAX_TIMEOUT).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<WorkerEnv> {
        use keys::*;
        let get = |k: &str| vars.get(k).map(String::as_str);
        let n = |k: &str| get(k).map(|v| parse_number::<usize>(k, v)).transpose();
        let u32_of = |k: &str| get(k).map(|v| parse_number::<u32>(k, v)).transpose();
        let either = |a: &'static str, b: &'static str| {
            get(a).map(|v| (a, v)).or_else(|| get(b).map(|v| (b, v)))
        };
        let master_port = match get(MASTER_PORT) {
            None => None,
            Some(v) => Some(parse_number::<u16>(MASTER_PORT, v).map_err(|_| {
                Error::invalid_config(MASTER_PORT, v, "not a TCP port (1-65535)")
                    .with_fix("set MASTER_PORT to a free port, or let `accel launch` choose one")
            })?),
        };
        let restart_count = match either(ACCEL_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT) {
            None => None,
            Some((k, v)) => Some(parse_number::<u32>(k, v)?),
        };
        Ok(WorkerEnv {
            rank: n(RANK)?,
            world_size: n(WORLD_SIZE)?,
            local_rank: n(LOCAL_RANK)?,
            local_world_size: n(LOCAL_WORLD_SIZE)?,
            group_rank: n(GROUP_RANK)?,
            group_world_size: n(GROUP_WORLD_SIZE)?,
            master_addr: get(MASTER_ADDR).map(str::to_string),
            master_port,
            store_url: get(ACCEL_STORE_URL).map(str::to_string),
            run_id: either(ACCEL_RUN_ID, TORCHELASTIC_RUN_ID).map(|(_, v)| v.to_string()),
            token: get(ACCEL_RUN_TOKEN).map(str::to_string),
            timeout: get(ACCEL_TIMEOUT)
                .map(|v| parse_duration(ACCEL_TIMEOUT, v))
                .transpose()?,
            backend: get(ACCEL_BACKEND).map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_ascii_lowercase())
                    .filter(|s| !s.is_empty())
                    .collect()
            }),
            debug: get(ACCEL_DEBUG)
                .map(|v| parse_flag(ACCEL_DEBUG, v))
                .transpose()?,
            mixed_precision: get(ACCEL_MIXED_PRECISION)
                .filter(|v| !v.trim().is_empty())
                .map(|v| {
                    v.parse().map_err(|e: Error| {
                        Error::invalid_config(ACCEL_MIXED_PRECISION, v, e.to_string())
                            .with_fix("set it to no, bf16 or fp16")
                    })
                })
                .transpose()?,
            sharding: Stage::from_env_value(get(ACCEL_SHARDING))?,
            gradient_accumulation_steps: get(ACCEL_GRADIENT_ACCUMULATION_STEPS)
                .map(|v| parse_accumulation_steps(ACCEL_GRADIENT_ACCUMULATION_STEPS, v))
                .transpose()?,
            restart_count,
            max_restarts: u32_of(TORCHELASTIC_MAX_RESTARTS)?,
            error_file: either(ACCEL_ERROR_FILE, TORCHELASTIC_ERROR_FILE)
                .map(|(_, v)| PathBuf::from(v)),
            dump_dir: get(ACCEL_DUMP_DIR)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            launcher: get(ACCEL_LAUNCHER).map(str::to_string),
            launcher_pid: get(ACCEL_LAUNCHER_PID)
                .map(|v| parse_number::<u32>(ACCEL_LAUNCHER_PID, v))
                .transpose()?,
            share_devices: get(ACCEL_SHARE_DEVICES)
                .map(|v| parse_flag(ACCEL_SHARE_DEVICES, v))
                .transpose()?,
            process_model: get(ACCEL_PROCESS_MODEL)
                .map(ProcessModel::parse)
                .transpose()?,
            agent_store: get(TORCHELASTIC_USE_AGENT_STORE)
                .map(|v| match v.trim().to_ascii_lowercase().as_str() {
                    "true" | "1" => Ok(true),
                    "false" | "0" | "" => Ok(false),
                    _ => Err(Error::invalid_config(
                        TORCHELASTIC_USE_AGENT_STORE,
                        v,
                        "expected True or False (torchrun's spelling)",
                    )),
                })
                .transpose()?,
        })
    }

    /// `true` when `accel launch` wrote this environment.
    pub fn from_accel_launch(&self) -> bool {
        self.launcher.as_deref() == Some("accel")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::parse::MAX_TIMEOUT;
    use proptest::prelude::*;

    fn opt<T: std::fmt::Debug + Clone>(
        s: impl Strategy<Value = T>,
    ) -> impl Strategy<Value = Option<T>> {
        prop::option::of(s)
    }

    fn word() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9._:/-]{1,12}"
    }

    prop_compose! {
        fn worker_env()(
            ranks in (opt(0usize..1 << 20), opt(1usize..1 << 20), opt(0usize..64), opt(1usize..64), opt(0usize..64), opt(1usize..64)),
            master_addr in opt(word()), master_port in opt(any::<u16>()),
            store_url in opt(word()), run_id in opt(word()), token in opt("[0-9a-f]{0,32}"),
            timeout in opt((0u64..MAX_TIMEOUT.as_secs(), 0u32..1_000_000_000)),
            backend in opt(prop::collection::vec("[a-z][a-z0-9-]{0,8}", 1..3)),
            flags in (opt(any::<bool>()), opt(any::<bool>())),
            counts in (opt(any::<u32>()), opt(any::<u32>()), opt(any::<u32>())),
            files in (opt("/[a-z0-9/._-]{1,20}"), opt("/[a-z0-9/._-]{1,20}")),
            launcher in opt("[a-z]{1,6}"),
            threads in opt(any::<bool>()),
            agent_store in opt(any::<bool>()),
            mixed_precision in opt(prop::sample::select(vec![
                MixedPrecision::No,
                MixedPrecision::Bf16,
                MixedPrecision::Fp16,
            ])),
            steps in opt(1usize..1 << 20),
            sharding in opt(prop::sample::select(vec![
                Stage::None,
                Stage::Optimizer,
                Stage::Gradients,
                Stage::Full,
            ])),
        ) -> WorkerEnv {
            WorkerEnv {
                rank: ranks.0, world_size: ranks.1, local_rank: ranks.2,
                local_world_size: ranks.3, group_rank: ranks.4, group_world_size: ranks.5,
                master_addr, master_port, store_url, run_id, token,
                timeout: timeout.map(|(s, n)| Duration::new(s, n)).filter(|d| !d.is_zero()),
                backend, debug: flags.0, share_devices: flags.1,
                restart_count: counts.0, max_restarts: counts.1, launcher_pid: counts.2,
                error_file: files.0.map(PathBuf::from), dump_dir: files.1.map(PathBuf::from),
                launcher, mixed_precision, sharding,
                gradient_accumulation_steps: steps,
                process_model: threads
                    .map(|t| if t { ProcessModel::Threads } else { ProcessModel::Processes }),
                agent_store,
            }
        }
    }

    proptest! {
        #[test]
        fn to_vars_then_from_vars_is_the_identity(env in worker_env()) {
            let vars: HashMap<String, String> =
                env.to_vars().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            prop_assert_eq!(WorkerEnv::from_vars(&vars).unwrap(), env);
        }
    }

    #[test]
    fn process_models_parse_and_bad_ones_name_the_variable() {
        assert_eq!(
            ProcessModel::parse(" Threads ").unwrap(),
            ProcessModel::Threads
        );
        assert_eq!(
            ProcessModel::parse("processes").unwrap(),
            ProcessModel::Processes
        );
        let e = ProcessModel::parse("fibers").unwrap_err();
        assert!(e.to_string().contains("ACCEL_PROCESS_MODEL"), "{e}");
        let vars = HashMap::from([("ACCEL_PROCESS_MODEL".to_string(), "x".to_string())]);
        assert!(WorkerEnv::from_vars(&vars).is_err());
    }
}
