//! Starting workers: the environment contract, one process group each,
//! piped output.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::options::format_dur;

/// What every worker of one attempt on this machine shares.
#[derive(Debug, Clone)]
pub struct RunEnv {
    /// Processes in the run.
    pub world_size: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Global rank of this machine's local rank 0.
    pub rank_offset: usize,
    /// This machine's rank (GROUP_RANK).
    pub machine_rank: usize,
    /// Machines in the run (GROUP_WORLD_SIZE).
    pub num_machines: usize,
    /// Where the store listens, as workers should dial it.
    pub master_addr: String,
    /// The store's port.
    pub master_port: u16,
    /// The store's token.
    pub token: Option<String>,
    /// ACCEL_RUN_ID.
    pub run_id: String,
    /// ACCEL_TIMEOUT.
    pub timeout: Duration,
    /// ACCEL_BACKEND, when chosen.
    pub backend: Option<Vec<String>>,
    /// ACCEL_DEBUG.
    pub debug: bool,
    /// ACCEL_RESTART_COUNT: the attempt number, 0 first.
    pub restart_count: u32,
    /// TORCHELASTIC_MAX_RESTARTS.
    pub max_restarts: u32,
    /// Directory of this attempt's error files.
    pub error_dir: PathBuf,
}

impl RunEnv {
    /// `tcp://addr:port`, with brackets around an IPv6 address.
    pub fn store_url(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("tcp://[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("tcp://{}:{}", self.master_addr, self.master_port)
        }
    }

    /// The error file of local rank `local_rank`.
    pub fn error_file(&self, local_rank: usize) -> PathBuf {
        self.error_dir
            .join(format!("rank-{}.json", self.rank_offset + local_rank))
    }

    /// The variables worker `local_rank` gets (DESIGN.md §5), on top of the
    /// launcher's own environment.
    pub fn vars(&self, local_rank: usize) -> Vec<(&'static str, String)> {
        let rank = self.rank_offset + local_rank;
        let error_file = self.error_file(local_rank).to_string_lossy().into_owned();
        let mut v = vec![
            ("RANK", rank.to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
            ("GROUP_RANK", self.machine_rank.to_string()),
            ("GROUP_WORLD_SIZE", self.num_machines.to_string()),
            ("ROLE_RANK", rank.to_string()),
            ("ROLE_WORLD_SIZE", self.world_size.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("ACCEL_LAUNCHER", "accel".into()),
            // Lets the runtime tie the worker's life to this process.
            ("ACCEL_LAUNCHER_PID", std::process::id().to_string()),
            ("ACCEL_STORE_URL", self.store_url()),
            ("ACCEL_RUN_ID", self.run_id.clone()),
            ("ACCEL_RUN_TOKEN", self.token.clone().unwrap_or_default()),
            ("ACCEL_TIMEOUT", format_dur(self.timeout)),
            ("ACCEL_DEBUG", if self.debug { "1" } else { "0" }.into()),
            ("ACCEL_RESTART_COUNT", self.restart_count.to_string()),
            ("ACCEL_ERROR_FILE", error_file.clone()),
            // torchrun's names, for programs written for it.
            ("TORCHELASTIC_RUN_ID", self.run_id.clone()),
            ("TORCHELASTIC_RESTART_COUNT", self.restart_count.to_string()),
            ("TORCHELASTIC_MAX_RESTARTS", self.max_restarts.to_string()),
            ("TORCHELASTIC_ERROR_FILE", error_file),
        ];
        if let Some(b) = &self.backend {
            v.push(("ACCEL_BACKEND", b.join(",")));
        }
        v
    }
}

/// Start worker `local_rank` in its own process group (so that stopping it
/// also stops whatever it started, and the terminal's Ctrl-C reaches the
/// launcher only, which forwards it).
///
/// # Errors
/// The spawn error.
pub fn spawn(
    program: &Path,
    argv0: &OsString,
    args: &[OsString],
    env: &RunEnv,
    local_rank: usize,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(program);
    cmd.arg0(argv0)
        .args(args)
        .envs(env.vars(local_rank))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Several workers reading one terminal is chaos; a single worker may
        // read it (a debugger, a prompt).
        .stdin(if env.world_size == 1 {
            Stdio::inherit()
        } else {
            Stdio::null()
        })
        .process_group(0);
    cmd.spawn()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env() -> RunEnv {
        RunEnv {
            world_size: 8,
            local_world_size: 4,
            rank_offset: 4,
            machine_rank: 1,
            num_machines: 2,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
            token: Some("tok".into()),
            run_id: "r1".into(),
            timeout: Duration::from_secs(90),
            backend: Some(vec!["cpu-gloo".into()]),
            debug: true,
            restart_count: 2,
            max_restarts: 3,
            error_dir: PathBuf::from("/tmp/e"),
        }
    }

    #[test]
    fn the_runtime_reads_what_the_launcher_writes() {
        let e = env();
        let vars: std::collections::HashMap<String, String> = e
            .vars(3)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let s = accel::ProcessState::from_vars(vars).unwrap();
        assert_eq!(
            (
                s.rank,
                s.world_size,
                s.local_rank,
                s.local_world_size,
                s.node_rank
            ),
            (7, 8, 3, 4, 1)
        );
        assert_eq!(s.source, accel::LaunchSource::Accel);
        assert_eq!(s.store_location().unwrap().unwrap(), "tcp://10.0.0.1:29500");
        assert_eq!(s.run_id, "r1");
        assert_eq!(s.token.as_deref(), Some("tok"));
        assert_eq!(s.timeout, Duration::from_secs(90));
        assert_eq!(s.backend, Some(vec!["cpu-gloo".to_string()]));
        assert!(s.debug);
        assert_eq!(s.restart_count, 2);
        assert_eq!(s.error_file, Some(PathBuf::from("/tmp/e/rank-7.json")));
    }

    #[test]
    fn ipv6_store_urls_are_bracketed() {
        let mut e = env();
        e.master_addr = "fd00::1".into();
        assert_eq!(e.store_url(), "tcp://[fd00::1]:29500");
    }
}
