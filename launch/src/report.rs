//! What the launcher tells the user: the root-cause block of a failure, the
//! per-attempt summary, and the `--json` summary.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::output::say_block;

/// How a worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Exit {
    /// It exited with this code.
    Code {
        /// The exit code.
        code: i32,
    },
    /// A signal killed it.
    Signal {
        /// The signal number.
        signal: i32,
    },
    /// It printed nothing for this long and was reported as hung.
    Hung {
        /// Seconds of silence.
        silent_s: u64,
    },
    /// It did not arrive at a collective that rank `seen_by` timed out
    /// waiting in (the stall inspector's verdict, `accel_api::worker::stall`); `code`
    /// is how `seen_by` exited. This rank was stopped by the launcher.
    Stalled {
        /// The rank that timed out waiting for it.
        seen_by: usize,
        /// That rank's exit code.
        code: i32,
    },
    /// It exited with code 0 while other ranks still ran, and rank
    /// `noticed_by` then failed: in a distributed job, a rank that ends
    /// before the others is a failure (its peers lose it mid-job).
    EarlyExit {
        /// The rank that failed after it.
        noticed_by: usize,
        /// That rank's exit code.
        code: i32,
    },
    /// Its machine was lost: that machine's launcher stopped answering
    /// (its link, its launcher or the machine itself stopped) for this many
    /// milliseconds. Every rank of that machine is lost with it.
    Lost {
        /// How long its launcher had been silent.
        silent_ms: u64,
    },
}

/// `SIGSEGV` for 11.
pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {sig}"))
}

impl Exit {
    /// From a waited process status.
    pub fn from_status(s: std::process::ExitStatus) -> Exit {
        use std::os::unix::process::ExitStatusExt;
        match (s.code(), s.signal()) {
            (Some(code), _) => Exit::Code { code },
            (None, Some(signal)) => Exit::Signal { signal },
            (None, None) => Exit::Code { code: 1 },
        }
    }

    /// `true` for exit code 0.
    pub fn is_success(self) -> bool {
        matches!(self, Exit::Code { code: 0 })
    }

    /// The launcher's exit code when this is the root cause: the code, 128 +
    /// the signal, 124 for a hang (as `timeout(1)`).
    pub fn launcher_code(self) -> u8 {
        match self {
            Exit::Code { code } => u8::try_from(code).ok().filter(|&c| c != 0).unwrap_or(1),
            Exit::Signal { signal } => u8::try_from(128 + signal).unwrap_or(255),
            Exit::Hung { .. } => 124,
            Exit::Lost { .. } => 1,
            Exit::Stalled { code, .. } | Exit::EarlyExit { code, .. } => {
                Exit::Code { code }.launcher_code()
            }
        }
    }

    /// `exited with code 3`, `was killed by SIGSEGV (signal 11)`.
    pub fn describe(self) -> String {
        self.wordings().0
    }

    /// The `exit:` row of the root-cause block: `exit code 3`, `signal
    /// SIGSEGV (11)`.
    fn block_row(self) -> String {
        self.wordings().1
    }

    /// How it ended: (in a sentence, in the root-cause block), one arm per
    /// kind of end, so that a new kind is worded for both at once.
    fn wordings(self) -> (String, String) {
        match self {
            Exit::Code { code } => (
                format!("exited with code {code}"),
                format!("exit code {code}"),
            ),
            Exit::Signal { signal } => {
                let name = signal_name(signal);
                (
                    format!("was killed by {name} (signal {signal})"),
                    format!("signal {name} ({signal})"),
                )
            }
            Exit::Hung { silent_s } => (
                format!("is hung: no output for {silent_s}s"),
                format!("hung: no output for {silent_s}s"),
            ),
            Exit::Stalled { seen_by, code } => (
                format!("did not arrive at a collective: rank {seen_by} timed out waiting for it (and exited with code {code})"),
                format!("did not arrive: rank {seen_by} timed out waiting for it (rank {seen_by} exited with code {code}; this rank was stopped)"),
            ),
            Exit::EarlyExit { noticed_by, code } => (
                format!("exited early (code 0 while the other ranks still ran; rank {noticed_by} failed after it with code {code})"),
                format!("exited early: code 0 while the other ranks still ran (exit code 0 mid-job is a failure of a distributed job); rank {noticed_by} failed after it with code {code}"),
            ),
            Exit::Lost { silent_ms } => {
                let s = silent_ms as f64 / 1e3;
                (
                    format!("was lost with its machine (its launcher silent for {s:.1}s)"),
                    format!("machine lost: its launcher did not answer for {s:.1}s"),
                )
            }
        }
    }
}

/// The root cause of a failed attempt: which worker, where, how, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// Global rank.
    pub rank: usize,
    /// Rank on its machine.
    pub local_rank: usize,
    /// Its machine's rank.
    pub machine: usize,
    /// Its machine's host name.
    pub host: String,
    /// Its process id (`None` when mpirun did not say and no error file
    /// was written).
    pub pid: Option<u32>,
    /// How it ended.
    pub exit: Exit,
    /// Panic message from its error file.
    pub error: Option<String>,
    /// Panic location from its error file.
    pub location: Option<String>,
    /// The last lines of its stderr.
    pub stderr_tail: Vec<String>,
    /// Other ranks hung at the same time (for a hang).
    #[serde(default)]
    pub also_hung: Vec<usize>,
    /// `true` when no worker failed but a launcher was interrupted (Ctrl-C):
    /// the run stops everywhere and is not restarted.
    #[serde(default)]
    pub interrupted: bool,
}

impl Failure {
    /// One line: `rank 1 (host h, machine 0) exited with code 3`.
    pub fn headline(&self) -> String {
        let mut s = format!(
            "rank {} (local rank {} on machine {}, host {}, pid {}) {}",
            self.rank,
            self.local_rank,
            self.machine,
            self.host,
            self.pid_text(),
            self.exit.describe()
        );
        if !self.also_hung.is_empty() {
            let v: Vec<String> = self.also_hung.iter().map(|r| r.to_string()).collect();
            s.push_str(&format!("; also hung: rank(s) {}", v.join(", ")));
        }
        s
    }

    fn pid_text(&self) -> String {
        self.pid
            .map_or_else(|| "unknown".to_string(), |p| p.to_string())
    }

    /// Print the root-cause block to stderr.
    pub fn print(&self, attempt: u32) {
        say_block(&self.block(attempt));
    }

    /// The root-cause block's lines, its bars included.
    pub fn block(&self, attempt: u32) -> Vec<String> {
        let mut lines = vec![
            "==================== root cause ====================".to_string(),
            format!("attempt:   {attempt}"),
            format!("rank:      {} (local rank {})", self.rank, self.local_rank),
            format!("host:      {} (machine {})", self.host, self.machine),
            format!("pid:       {}", self.pid_text()),
        ];
        let exit = self.exit.block_row();
        lines.push(format!("exit:      {exit}"));
        if !self.also_hung.is_empty() {
            let v: Vec<String> = self.also_hung.iter().map(|r| r.to_string()).collect();
            lines.push(format!("also hung: rank(s) {}", v.join(", ")));
        }
        match (&self.error, &self.location) {
            (Some(m), loc) => {
                let mut first = true;
                for l in m.lines() {
                    let head = if first { "error:     " } else { "           " };
                    lines.push(format!("{head}{l}"));
                    first = false;
                }
                if let Some(loc) = loc {
                    lines.push(format!("at:        {loc}"));
                }
            }
            (None, _) => lines.push(
                "error:     <no error file: the worker did not panic through accel's hook>"
                    .to_string(),
            ),
        }
        let whose = match self.exit {
            Exit::Stalled { seen_by, .. } => format!(" of rank {seen_by}"),
            Exit::EarlyExit { noticed_by, .. } => format!(" of rank {noticed_by}"),
            _ => String::new(),
        };
        if self.stderr_tail.is_empty() {
            lines.push(format!("stderr{whose}: <empty>"));
        } else {
            lines.push(format!(
                "stderr{whose} (last {} line(s)):",
                self.stderr_tail.len()
            ));
            for l in &self.stderr_tail {
                lines.push(format!("  | {l}"));
            }
        }
        lines.push("====================================================".to_string());
        lines
    }
}

/// What the stall inspector found (`accel_api::worker::stall::StallVerdict`, read from
/// the store): rank `seen_by` timed out in `waiting_in` while `missing`
/// (rank, last collective entered) had not entered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    /// The rank that timed out and wrote the verdict.
    pub seen_by: usize,
    /// The collective it waited in (`all_reduce#42`).
    pub waiting_in: String,
    /// The ranks that did not arrive and the last collective each entered.
    pub missing: Vec<(usize, Option<String>)>,
}

impl Stall {
    /// The missing rank furthest behind, which the others wait on
    /// (`accel_api::worker::stall::behind_key`): a rank one collective
    /// behind is often only stuck in a collective the furthest one froze
    /// after the witness had left it.
    pub fn furthest_behind(&self) -> Option<&(usize, Option<String>)> {
        self.missing
            .iter()
            .min_by_key(|(r, last)| accel_api::worker::stall::behind_key(*r, last.as_deref()))
    }
}

impl Failure {
    /// The root cause a stall verdict points to: `victim` (a rank that
    /// timed out waiting) becomes the witness, and the missing rank
    /// furthest behind ([`Stall::furthest_behind`]) is blamed, at `place`
    /// (its rank, local rank, machine and host when this launcher knows
    /// them). Returns `victim` unchanged when the
    /// verdict names no missing rank or names the victim itself.
    pub fn blame_stall(
        victim: Failure,
        stall: &Stall,
        place: Option<(usize, usize, String)>,
    ) -> Failure {
        let Some((rank, last)) = stall.furthest_behind().cloned() else {
            return victim;
        };
        if stall.missing.iter().any(|(r, _)| *r == victim.rank) {
            return victim;
        }
        let (code, said) = victim.what_it_said();
        let (local_rank, machine, host) =
            place.unwrap_or((victim.local_rank, victim.machine, victim.host.clone()));
        Failure {
            rank,
            local_rank,
            machine,
            host,
            pid: None,
            exit: Exit::Stalled {
                seen_by: stall.seen_by,
                code,
            },
            error: Some(format!(
                "rank {rank} did not arrive at {} (last entered: {}); rank {} timed out waiting for it:\n{said}",
                stall.waiting_in,
                last.as_deref().unwrap_or("no collective"),
                stall.seen_by
            )),
            location: None,
            stderr_tail: victim.stderr_tail,
            also_hung: stall
                .missing
                .iter()
                .map(|(r, _)| *r)
                .filter(|&r| r != rank)
                .collect(),
            interrupted: false,
        }
    }
}

impl Failure {
    /// This failure's exit code, and what it said: its panic message, else
    /// its last stderr line that reports an error, else its last line.
    fn what_it_said(&self) -> (i32, String) {
        let code = match self.exit {
            Exit::Code { code } => code,
            other => i32::from(other.launcher_code()),
        };
        let tail = &self.stderr_tail;
        let said = self
            .error
            .clone()
            .or_else(|| tail.iter().rev().find(|l| l.contains("error")).cloned())
            .or_else(|| tail.last().cloned())
            .unwrap_or_else(|| self.exit.describe());
        (code, said)
    }

    /// `true` when this failure speaks of a peer it lost or waited for in
    /// vain (a lost peer, a timeout, missing ranks, a reset connection).
    pub fn speaks_of_a_peer(&self) -> bool {
        let says = |t: &str| {
            [
                "lost peer",
                "lost a peer",
                "timed out",
                "missing ranks",
                "Connection reset",
            ]
            .iter()
            .any(|w| t.contains(w))
        };
        self.error.as_deref().is_some_and(says) || self.stderr_tail.iter().any(|l| says(l))
    }

    /// `true` when this failure says it lost `rank` as a peer (accel's
    /// `PeerLost` error naming it, or naming no peer).
    pub fn lost_peer(&self, rank: usize) -> bool {
        let named = format!("lost peer rank {rank}:");
        let says = |t: &str| t.contains(&named) || t.contains("lost a peer:");
        self.error.as_deref().is_some_and(says) || self.stderr_tail.iter().any(|l| says(l))
    }

    /// Point the root cause at `early`, a rank that exited 0 while the
    /// others still ran, instead of `noticer`, the rank that failed after
    /// it (typically losing it as a peer): what `noticer` said becomes the
    /// evidence.
    pub fn blame_early_exit(early: Failure, noticer: Failure) -> Failure {
        let (code, said) = noticer.what_it_said();
        Failure {
            exit: Exit::EarlyExit {
                noticed_by: noticer.rank,
                code,
            },
            error: Some(format!(
                "rank {} exited with code 0 while the other ranks still ran, and rank {} failed \
                 after it; a rank of a distributed job that ends before the others is a failure. \
                 Rank {} said:\n{said}",
                early.rank, noticer.rank, noticer.rank
            )),
            location: None,
            stderr_tail: noticer.stderr_tail,
            ..early
        }
    }
}

/// How one worker of an attempt ended, for the summary.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerEnd {
    /// Global rank.
    pub rank: usize,
    /// Process id.
    pub pid: u32,
    /// How it ended.
    pub exit: Exit,
    /// `true` when the launcher stopped it (SIGTERM / SIGKILL / forwarded
    /// signal) rather than it ending by itself.
    pub stopped: bool,
    /// What the process was: `workers` (one rank) or `mpirun` (every rank;
    /// `rank` is then the first).
    pub process: String,
}

/// The result of one attempt.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every worker everywhere exited 0.
    Succeeded,
    /// A worker failed (the root cause is set).
    Failed,
    /// The launcher was asked to stop (Ctrl-C, SIGTERM).
    Interrupted,
}

/// One attempt in the summary.
#[derive(Debug, Clone, Serialize)]
pub struct AttemptReport {
    /// 0 for the first, then ACCEL_RESTART_COUNT.
    pub attempt: u32,
    /// Outcome.
    pub status: Status,
    /// Wall time of the attempt.
    pub duration_s: f64,
    /// What failed first, anywhere in the run.
    pub root_cause: Option<Failure>,
    /// This machine's workers.
    pub workers: Vec<WorkerEnd>,
    /// Ranks that ignored SIGTERM for the grace period and were killed.
    pub killed: Vec<usize>,
    /// The signal that interrupted the launcher.
    pub interrupted_by: Option<String>,
}

impl AttemptReport {
    /// `succeeded after 0.31s` / `failed after 1.2s: rank 1 ... exited with code 3`.
    pub fn line(&self) -> String {
        let d = fmt_secs(Duration::from_secs_f64(self.duration_s));
        match self.status {
            Status::Succeeded => format!("attempt {}: succeeded after {d}", self.attempt),
            Status::Failed => format!(
                "attempt {}: failed after {d}: {}",
                self.attempt,
                self.root_cause
                    .as_ref()
                    .map(Failure::headline)
                    .unwrap_or_else(|| "unknown cause".into())
            ),
            Status::Interrupted => format!(
                "attempt {}: interrupted after {d} by {}",
                self.attempt,
                self.interrupted_by.as_deref().unwrap_or("a signal")
            ),
        }
    }
}

/// The whole launch, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// ACCEL_RUN_ID.
    pub run_id: String,
    /// This machine.
    pub machine_rank: usize,
    /// Machines in the run.
    pub num_machines: usize,
    /// Processes in the run.
    pub world_size: usize,
    /// Where the store listened.
    pub store: String,
    /// The launcher's exit code.
    pub exit_code: u8,
    /// Each attempt, in order.
    pub attempts: Vec<AttemptReport>,
    /// Seconds from the launcher's start to its end.
    pub wall_s: f64,
}

/// `0.31s`, `2m05s`.
pub fn fmt_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 60.0 {
        format!("{s:.2}s")
    } else {
        format!("{}m{:02}s", d.as_secs() / 60, d.as_secs() % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_shell() {
        assert_eq!(Exit::Code { code: 3 }.launcher_code(), 3);
        assert_eq!(Exit::Signal { signal: 9 }.launcher_code(), 137);
        assert_eq!(Exit::Hung { silent_s: 5 }.launcher_code(), 124);
        assert_eq!(Exit::Code { code: 300 }.launcher_code(), 1);
        let lost = Exit::Lost { silent_ms: 5100 };
        assert_eq!(lost.launcher_code(), 1);
        assert_eq!(
            lost.describe(),
            "was lost with its machine (its launcher silent for 5.1s)"
        );
        let back: Exit = serde_json::from_str(&serde_json::to_string(&lost).unwrap()).unwrap();
        assert_eq!(back, lost);
        assert_eq!(
            Exit::Signal { signal: 11 }.describe(),
            "was killed by SIGSEGV (signal 11)"
        );
    }

    #[test]
    fn failures_travel_as_json() {
        let f = Failure {
            rank: 3,
            local_rank: 1,
            machine: 1,
            host: "h".into(),
            pid: Some(7),
            exit: Exit::Signal { signal: 6 },
            error: Some("boom".into()),
            location: Some("src/main.rs:1:1".into()),
            stderr_tail: vec!["x".into()],
            also_hung: vec![],
            interrupted: false,
        };
        let back: Failure = serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(back, f);
        assert!(f.headline().contains("rank 3") && f.headline().contains("SIGABRT"));
    }

    fn victim() -> Failure {
        Failure {
            rank: 0,
            local_rank: 0,
            machine: 0,
            host: "h".into(),
            pid: Some(7),
            exit: Exit::Code { code: 1 },
            error: None,
            location: None,
            stderr_tail: vec![
                "accel: error: [cpu-gloo rank 0] all_reduce: timed out".into(),
                "[mpi] exiting without MPI_Finalize".into(),
            ],
            also_hung: vec![],
            interrupted: false,
        }
    }

    #[test]
    fn a_stall_blames_the_missing_rank_not_the_victim() {
        let stall = Stall {
            seen_by: 0,
            waiting_in: "all_reduce#42".into(),
            missing: vec![
                (1, Some("all_reduce#41".into())),
                (3, Some("all_reduce#41".into())),
            ],
        };
        let f = Failure::blame_stall(victim(), &stall, Some((1, 0, "h".into())));
        assert_eq!(f.rank, 1);
        assert_eq!(f.also_hung, vec![3]);
        assert_eq!(
            f.exit,
            Exit::Stalled {
                seen_by: 0,
                code: 1
            }
        );
        assert_eq!(
            f.exit.launcher_code(),
            1,
            "the run's code stays the victim's"
        );
        let e = f.error.as_deref().unwrap();
        assert!(
            e.starts_with("rank 1 did not arrive at all_reduce#42 (last entered: all_reduce#41); rank 0 timed out"),
            "{e}"
        );
        assert!(e.contains("all_reduce: timed out"), "{e}");
        assert!(f.headline().starts_with("rank 1 "), "{}", f.headline());
        let back: Failure = serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
        assert_eq!(back, f);
    }

    #[test]
    fn a_stall_blames_the_rank_furthest_behind() {
        // Rank 3 was stopped after all_reduce#380; rank 0 left #383, whose
        // ring rank 3 froze for ranks 1, 2 and 4 (seen in CI on 2026-12-06).
        let last = |n: u32| Some(format!("all_reduce#{n}"));
        let stall = Stall {
            seen_by: 0,
            waiting_in: "all_reduce#384".into(),
            missing: vec![
                (1, last(383)),
                (2, last(383)),
                (3, last(380)),
                (4, last(383)),
            ],
        };
        let f = Failure::blame_stall(victim(), &stall, Some((3, 1, "m1".into())));
        assert_eq!((f.rank, f.also_hung.clone()), (3, vec![1, 2, 4]));
        let e = f.error.unwrap();
        assert!(
            e.starts_with("rank 3 did not arrive at all_reduce#384 (last entered: all_reduce#380)"),
            "{e}"
        );
        // A rank that entered no collective is further behind than any.
        let never = Stall {
            missing: vec![(1, last(383)), (2, None), (3, last(380))],
            ..stall
        };
        assert_eq!(never.furthest_behind().map(|m| m.0), Some(2));
    }

    #[test]
    fn a_stall_naming_the_victim_or_nobody_changes_nothing() {
        let own = Stall {
            seen_by: 2,
            waiting_in: "barrier#3".into(),
            missing: vec![(0, None)],
        };
        assert_eq!(Failure::blame_stall(victim(), &own, None), victim());
        let none = Stall {
            missing: vec![],
            ..own
        };
        assert_eq!(Failure::blame_stall(victim(), &none, None), victim());
    }
}
