//! Helpers of the launcher's integration tests: run the built `accel`
//! binary under a hard deadline (killed on expiry, so a hung launcher fails
//! the test instead of hanging the suite).
#![allow(dead_code)]

pub mod netns;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The binary under test.
pub const ACCEL: &str = env!("CARGO_BIN_EXE_accel");

/// Default hard limit of one launcher run in these tests.
pub const LIMIT: Duration = Duration::from_secs(30);

/// What a finished run left.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Run {
    /// Assert that stderr contains `text` (showing the whole run if not).
    #[track_caller]
    pub fn has_stderr(&self, text: &str) {
        self.has("stderr", &self.stderr, text);
    }

    /// Assert that stderr does not contain `text` (showing the whole run if
    /// it does).
    #[track_caller]
    pub fn lacks_stderr(&self, text: &str) {
        assert!(
            !self.stderr.contains(text),
            "{text:?} in stderr\n{}",
            self.all()
        );
    }

    #[track_caller]
    fn has(&self, name: &str, stream: &str, text: &str) {
        assert!(
            stream.contains(text),
            "no {text:?} in {name}\n{}",
            self.all()
        );
    }

    /// Assert the exit code (showing the whole run if it differs).
    #[track_caller]
    pub fn code_is(&self, code: i32) {
        assert_eq!(self.code, Some(code), "{}", self.all());
    }

    /// The one JSON line rank `rank` printed.
    #[track_caller]
    pub fn rank_json(&self, rank: usize) -> serde_json::Value {
        let lines = rank_lines(&self.stdout, rank);
        assert_eq!(lines.len(), 1, "{}", self.all());
        serde_json::from_str(&lines[0]).unwrap()
    }

    /// Assert that stdout contains `text` (showing the whole run if not).
    #[track_caller]
    pub fn has_stdout(&self, text: &str) {
        self.has("stdout", &self.stdout, text);
    }

    /// stdout + stderr, for assertion messages.
    pub fn all(&self) -> String {
        format!(
            "exit {:?} after {:?}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.elapsed, self.stdout, self.stderr
        )
    }
}

/// A started launcher whose output is being collected.
pub struct Running {
    pub child: Child,
    start: Instant,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
}

fn collect(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        String::from_utf8_lossy(&v).into_owned()
    })
}

/// `accel ARGS...` with a clean launcher environment.
pub fn command(args: &[&str]) -> Command {
    let mut c = Command::new(ACCEL);
    clean(c.args(args));
    c
}

/// `cmd` (a launcher, or what execs one) with a clean launcher environment
/// (no `ACCEL_*` setting of the caller's), no stdin, and its output piped.
pub fn clean(cmd: &mut Command) -> &mut Command {
    for k in [
        "PET_NNODES",
        "PET_NPROC_PER_NODE",
        "PET_NODE_RANK",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
        "PET_MAX_RESTARTS",
        "SKYPILOT_NODE_RANK",
        "SKYPILOT_NODE_IPS",
        "SKYPILOT_NUM_GPUS_PER_NODE",
        "KUBEFLOW_TRAINER_STATUS_URL",
    ] {
        // A scheduler's description of the machines is the test's to give.
        cmd.env_remove(k);
    }
    cmd.env_remove("ACCEL_RUN_TOKEN")
        .env_remove("ACCEL_TIMEOUT")
        .env_remove("ACCEL_BACKEND")
        .env_remove("ACCEL_DEBUG")
        .env_remove("ACCEL_CHECK_CALLS")
        .env_remove("ACCEL_CONFIG_FILE")
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
}

/// `launch` as machine `rank` of `machines`, with the store at
/// `ip:port`: how every multi-machine launcher of these tests begins.
pub fn machine_args<'a>(
    machines: &'a str,
    rank: &'a str,
    ip: &'a str,
    port: &'a str,
) -> Vec<&'a str> {
    vec![
        "launch",
        "--num-machines",
        machines,
        "--machine-rank",
        rank,
        "--main-process-ip",
        ip,
        "--main-process-port",
        port,
    ]
}

/// Start `cmd`.
pub fn start(mut cmd: Command) -> Running {
    let mut child = cmd.spawn().expect("start accel");
    let out = child.stdout.take().map(collect);
    let err = child.stderr.take().map(collect);
    Running {
        child,
        start: Instant::now(),
        out,
        err,
    }
}

impl Running {
    /// Wait for the end, at most `limit` from the start; on expiry kill it
    /// and panic with what it printed.
    pub fn finish(mut self, limit: Duration) -> Run {
        let code = loop {
            match self.child.try_wait().expect("wait") {
                Some(s) => break s.code(),
                None if self.start.elapsed() > limit => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    let run = self.collect_output(None);
                    panic!("accel did not finish within {limit:?}:\n{}", run.all());
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        self.collect_output(code)
    }

    fn collect_output(&mut self, code: Option<i32>) -> Run {
        let elapsed = self.start.elapsed();
        // Output threads end when every writer (including stray grandchildren)
        // closed the pipe; do not wait on them forever.
        let join = |h: Option<JoinHandle<String>>| {
            let h = h?;
            let t = Instant::now();
            while !h.is_finished() && t.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(5));
            }
            h.is_finished().then(|| h.join().unwrap_or_default())
        };
        Run {
            code,
            stdout: join(self.out.take()).unwrap_or_else(|| "<stdout still open>".into()),
            stderr: join(self.err.take()).unwrap_or_else(|| "<stderr still open>".into()),
            elapsed,
        }
    }

    /// The launcher's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Run `accel ARGS...` to its end (hard limit [`LIMIT`]).
pub fn accel(args: &[&str]) -> Run {
    start(command(args)).finish(LIMIT)
}

/// `accel ARGS...`, which must refuse with exit code 2 saying `says`.
#[track_caller]
pub fn refused(args: &[&str], says: &str) -> Run {
    let r = accel(args);
    r.code_is(2);
    r.has_stderr(says);
    r
}

/// [`refused`] with the arguments as one string of words.
#[track_caller]
pub fn refused_words(words: &str, says: &str) -> Run {
    refused(&argv(words, &[]), says)
}

/// `true` while a process with this pid exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // state is the field after the `(comm)`.
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .unwrap_or("?");
            state != "Z" && state != "X"
        }
        Err(_) => false,
    }
}

/// Read every `*.pid` file of `dir`.
pub fn pids_in(dir: &Path) -> Vec<u32> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p: PathBuf = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "pid") {
            if let Ok(n) = std::fs::read_to_string(&p).unwrap().trim().parse() {
                v.push(n);
            }
        }
    }
    v
}

/// A file `name` holding `contents` in a fresh temporary directory (removed
/// when the returned guard drops).
pub fn temp_file(name: &str, contents: impl AsRef<[u8]>) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, contents).unwrap();
    (dir, path)
}

/// Wait up to `limit` for `cond`.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// Lines of stdout that belong to `rank`, prefix removed.
pub fn rank_lines(stdout: &str, rank: usize) -> Vec<String> {
    let p = format!("[rank {rank}] ");
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix(&p).map(str::to_string))
        .collect()
}

/// Processes whose command line contains `marker` (read from /proc).
pub fn processes_with(marker: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| String::from_utf8_lossy(c).contains(marker))
        .count()
}

/// Poll `cond` every 50 ms for up to `secs` seconds.
pub fn wait_for(mut cond: impl FnMut() -> bool, secs: u64) -> bool {
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    cond()
}

/// `words` split at whitespace, then `rest` as they are (scripts, paths):
/// the arguments of one command line.
pub fn argv<'a>(words: &'a str, rest: &[&'a str]) -> Vec<&'a str> {
    words
        .split_whitespace()
        .chain(rest.iter().copied())
        .collect()
}

/// `accel` with the arguments of one whitespace-separated string.
pub fn accel_words(words: &str) -> Run {
    accel(&argv(words, &[]))
}

/// Assert that `pid` ends within 2 s.
#[track_caller]
pub fn assert_gone(pid: u32, context: &str) {
    assert!(
        eventually(Duration::from_secs(2), || !alive(pid)),
        "pid {pid} still running: {context}"
    );
}

/// The `--json` summary on the last line of `stdout`.
#[track_caller]
pub fn json_summary(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

/// The statuses of the attempts in the `--json` summary on the last line
/// of `stdout`.
pub fn attempt_statuses(stdout: &str) -> Vec<String> {
    json_summary(stdout)["attempts"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| x["status"].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The row of `backend` in `accel env`'s table.
#[track_caller]
pub fn env_row<'a>(table: &'a str, backend: &str) -> &'a str {
    let prefix = format!("{backend} ");
    table
        .lines()
        .find(|l| l.trim_start().starts_with(&prefix))
        .unwrap_or_else(|| panic!("no {backend} row:\n{table}"))
}

/// The entry of `backend` in `accel env --json`'s `backends`.
#[track_caller]
pub fn env_json_backend(stdout: &[u8], backend: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(stdout).expect("accel env --json");
    v["backends"]
        .as_array()
        .expect("a backends array")
        .iter()
        .find(|b| b["name"] == backend)
        .unwrap_or_else(|| panic!("no {backend} in --json"))
        .clone()
}

/// The mismatches `accel probe-worker --mismatch` makes on two ranks, and
/// what the call check's error says about each.
pub const MISMATCHES: [(&str, &str); 4] = [
    ("length", "length (10 on rank 0; 11 on rank 1)"),
    ("reduction", "reduction (sum on rank 0; max on rank 1)"),
    ("dtype", "element type (f32 on rank 0; i32 on rank 1)"),
    (
        "kind",
        "operation (broadcast on rank 0; all_reduce on rank 1)",
    ),
];

/// A run whose ranks made a mismatched call (`says`: what differs) ended
/// with the call check's error, and without a crash: no signal, no wrong
/// answer printed as success.
pub fn ended_with_mismatch(r: &Run, backend: &str, says: &str) {
    let code = r.code.unwrap_or(-1);
    assert!(
        (1..128).contains(&code),
        "expected an error exit (no signal), got {:?}:\n{}",
        r.code,
        r.all()
    );
    r.has_stderr(says);
    r.has_stderr(&format!("[{backend} rank "));
    r.has_stderr("ranks disagree on collective #");
    for bad in [
        "SIGABRT",
        "SIGSEGV",
        "EnforceNotMet",
        "signal 6",
        "signal 11",
    ] {
        assert!(!r.all().contains(bad), "`{bad}` in:\n{}", r.all());
    }
}

/// A 2-rank run whose rank 1 slept past the timeout: rank 0's error names
/// rank 1 as missing, and so does the launcher's root-cause block.
pub fn ended_naming_the_stalled_rank(r: &Run, backend: &str) {
    assert!(r.code.is_some_and(|c| c != 0), "{}", r.all());
    r.has_stderr(&format!("[{backend} rank 0] all_reduce: timed out"));
    r.has_stderr("missing ranks: 1 (last: all_reduce#");
    r.has_stderr("rank:      1 (local rank 1)");
    r.has_stderr("rank 1 did not arrive at all_reduce#");
    r.has_stderr("exit:      did not arrive: rank 0 timed out waiting for it");
}

/// The workspace's root, and the target directory of this test build
/// (where the tests build what they need).
pub fn workspace_and_target() -> (&'static Path, &'static Path) {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent();
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent();
    (
        workspace.expect("workspace root"),
        target.expect("target dir"),
    )
}

/// `target/<profile>/train` (examples/train) beside the `accel` under test,
/// (re)built with cargo first, once per test process (a `cargo test -p
/// accel-launcher` alone does not build it, and a stale one would test old
/// code), with the mpi engine when the launcher has it.
pub fn train_bin() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let profile = Path::new(ACCEL).parent().expect("target/<profile>");
            let (workspace, _) = workspace_and_target();
            let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
            cmd.arg("build")
                .arg("--manifest-path")
                .arg(workspace.join("Cargo.toml"))
                .arg("--target-dir")
                .arg(profile.parent().expect("target"))
                .args(["-p", "accel-example-train"]);
            // The features make test builds it with (its mpi engine when this
            // launcher has one): a rebuild here replaces the binary other
            // tests of the same run use (examples/train/tests/phases.rs).
            if cfg!(feature = "mpi") {
                cmd.args(["--features", "mpi"]);
            }
            if profile.file_name().is_some_and(|f| f == "release") {
                cmd.arg("--release");
            }
            cmd.stdin(Stdio::null());
            start(cmd).finish(Duration::from_secs(900)).code_is(0);
            profile.join("train")
        })
        .clone()
}
