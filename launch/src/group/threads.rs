//! [`ThreadsGroup`]: one process hosting every local rank as a thread (the
//! threads process model, docs/adr/0015-process-model.md), under the same
//! supervisor as process workers.
//!
//! The process gets the worker contract of its first rank (`RANK`,
//! `LOCAL_RANK` = the first rank thread's, `LOCAL_WORLD_SIZE` = the number
//! of rank threads) plus `ACCEL_PROCESS_MODEL=threads`; the program's
//! `accel::run` starts the rank threads. One error file per attempt: the
//! rank that failed first writes it, with its rank, and the root-cause
//! block names that rank.
//!
//! Output: lines a rank thread tags ([`accel_api::worker::tag_line`]) go to
//! that rank's sink (its `[rank N]` prefix, `--tee` file, rank filter,
//! stderr tail); untagged lines go to the first rank's sink (what the main
//! process prints). Every line counts as a sign of life for every rank of
//! the process (`--hang-timeout` watches the process).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use accel_api::worker::ProcessModel;
use accel_api::worker::WorkerEnv;
use accel_api::Result;

use super::{
    failure_at, record, shared_record, Attempt, Ended, Events, LocalGroup, ProcessGroup, Program,
    Sinks, Started,
};
use crate::output::{RankSink, Stream, TAIL_LINES};
use crate::report::{Exit, Failure};

/// Routes the lines of a threads process to its ranks' sinks.
#[derive(Debug)]
pub struct ThreadsOutput {
    sinks: Vec<Arc<RankSink>>,
    first: usize,
    /// The process's untagged stderr lines (a panic's message, logs).
    untagged: Mutex<VecDeque<String>>,
}

impl ThreadsOutput {
    /// Output of a process whose first rank is `first`, one sink per rank.
    pub fn new(sinks: Vec<Arc<RankSink>>, first: usize) -> Arc<ThreadsOutput> {
        Arc::new(ThreadsOutput {
            sinks,
            first,
            untagged: Mutex::new(VecDeque::with_capacity(TAIL_LINES)),
        })
    }

    /// One line of the process on `stream`.
    pub fn line(&self, stream: Stream, raw: &[u8]) {
        for s in &self.sinks {
            s.touch();
        }
        let routed = accel_api::worker::untag_line(raw).and_then(|(rank, text)| {
            let i = rank.checked_sub(self.first)?;
            self.sinks.get(i).map(|s| (s, text))
        });
        match routed {
            Some((sink, text)) => sink.line(stream, text),
            None => {
                let text = String::from_utf8_lossy(raw).into_owned();
                // Rust's and accel-signals' words about a rank thread
                // (`thread 'rank 2' aborted`) are that rank's output.
                let named = thread_named(std::slice::from_ref(&text))
                    .and_then(|r| r.checked_sub(self.first))
                    .and_then(|i| self.sinks.get(i));
                if stream == Stream::Stderr {
                    let mut t = self.untagged.lock().unwrap_or_else(|p| p.into_inner());
                    if t.len() == TAIL_LINES {
                        t.pop_front();
                    }
                    t.push_back(text);
                }
                if let Some(s) = named.or(self.sinks.first()) {
                    s.line(stream, raw);
                }
            }
        }
    }

    /// The last untagged stderr lines of the process.
    pub fn untagged_tail(&self) -> Vec<String> {
        self.untagged
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

/// One process whose `local_world_size` rank threads are this machine's
/// ranks.
#[derive(Debug)]
pub struct ThreadsGroup {
    /// The process's program, ranks and environment, started with the
    /// same command set-up as a local worker's (`local_world_size`: the
    /// rank threads on this machine; the program enters through
    /// `accel::run`).
    pub workers: LocalGroup,
    out: Option<Arc<ThreadsOutput>>,
}

impl ThreadsGroup {
    /// A process of `local_world_size` rank threads running `program`.
    pub fn new(program: Program, local_world_size: usize) -> ThreadsGroup {
        ThreadsGroup {
            workers: LocalGroup::new(program, local_world_size),
            out: None,
        }
    }

    /// The process's environment in `attempt`: its first rank's contract,
    /// the threads process model, one error file per attempt.
    pub fn process_env(&self, attempt: &Attempt) -> WorkerEnv {
        let mut env = self.workers.worker_env(attempt, 0);
        env.error_file = Some(attempt.error_dir.join("error.json"));
        env.process_model = Some(ProcessModel::Threads);
        env
    }
}

impl ProcessGroup for ThreadsGroup {
    fn kind(&self) -> &'static str {
        "rank threads"
    }

    fn ranks(&self, attempt: &Attempt) -> Range<usize> {
        self.workers.local_ranks(attempt)
    }

    fn start(&mut self, attempt: &Attempt, sinks: &Sinks, tx: &Events) -> Result<Vec<Started>> {
        let out = ThreadsOutput::new(sinks.to_vec(), attempt.rank_offset);
        self.out = Some(out.clone());
        let s = self.workers.spawn(
            &self.process_env(attempt),
            "the rank threads' process",
            (attempt.number, 0),
            tx,
            move |stream, l| out.line(stream, l),
        )?;
        for sink in sinks {
            sink.touch();
        }
        Ok(vec![s])
    }

    fn failure(&self, attempt: &Attempt, ended: Ended, sinks: &Sinks) -> Option<Failure> {
        let Ended { pid, exit, .. } = ended;
        // The error file names the rank thread that failed first; without
        // one, the rank thread the process's last words name (Rust names
        // the thread in a panic or an abort: `thread 'rank 1' has
        // overflowed its stack`; accel names rank threads `rank N`);
        // without either (a bare abort(), a kill) the process's first
        // rank stands for it, and the block says so.
        let rec = record(&attempt.error_dir.join("error.json"));
        let untagged = self
            .out
            .as_ref()
            .map(|o| o.untagged_tail())
            .unwrap_or_default();
        let named = rec
            .as_ref()
            .and_then(|r| r.rank)
            .or_else(|| thread_named(&untagged));
        let index = named
            .and_then(|r| r.checked_sub(attempt.rank_offset))
            .filter(|&i| i < self.workers.local_world_size);
        let mut f = self.rank_failure(attempt, index.unwrap_or(0), exit, sinks);
        f.pid = Some(pid);
        if index.is_none() && f.error.is_none() {
            let last = attempt.rank_offset + self.workers.local_world_size - 1;
            f.error = Some(format!(
                "the process hosting ranks {}-{last} as threads {}, and no rank thread said \
                 which it was: rank {} stands for the process",
                attempt.rank_offset,
                exit.describe(),
                attempt.rank_offset
            ));
        }
        Some(f)
    }

    fn rank_failure(&self, attempt: &Attempt, index: usize, exit: Exit, sinks: &Sinks) -> Failure {
        let rank = attempt.rank_offset + index;
        let rec = shared_record(attempt, rank);
        let mut f = failure_at(
            (rank, index, attempt.machine()),
            &attempt.host,
            rec,
            exit,
            sinks.get(index),
        );
        if f.stderr_tail.is_empty() {
            // A panic's message is the process's, untagged.
            f.stderr_tail = self
                .out
                .as_ref()
                .map(|o| o.untagged_tail())
                .unwrap_or_default();
        }
        f
    }

    fn forwarding(&self, signal: &str) -> String {
        format!("received {signal}, forwarding it to the rank threads' process")
    }
}

/// The rank of the last rank thread a line names as Rust names threads in
/// its panic and abort messages (`thread 'rank 3' panicked at`, `thread
/// 'rank 3' has overflowed its stack`), and as accel-signals names a rank
/// thread that calls abort() (`thread 'rank 3' aborted (SIGABRT)`).
fn thread_named(lines: &[String]) -> Option<usize> {
    lines.iter().rev().find_map(|l| {
        let rest = l.split("thread 'rank ").nth(1)?;
        rest.split('\'').next()?.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::program;
    use super::*;
    use std::path::PathBuf;
    use std::time::Instant;

    fn attempt() -> Attempt {
        Attempt {
            number: 0,
            env: WorkerEnv {
                world_size: Some(6),
                group_rank: Some(1),
                store_url: Some("tcp://127.0.0.1:1".into()),
                launcher: Some("accel".into()),
                ..WorkerEnv::default()
            },
            rank_offset: 3,
            error_dir: PathBuf::from("/tmp/e"),
            host: "h".into(),
        }
    }

    #[test]
    fn the_runtime_reads_one_state_per_rank_thread() {
        let g = ThreadsGroup::new(program(), 3);
        let vars = g
            .process_env(&attempt())
            .to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let s = accel::ProcessState::from_vars(vars).unwrap();
        assert_eq!(s.process_model, ProcessModel::Threads);
        assert_eq!(s.ranks_in_process(), 3);
        let ranks: Vec<(usize, usize)> = (0..3)
            .map(|i| s.rank_thread(i).map(|t| (t.rank, t.local_rank)).unwrap())
            .collect();
        assert_eq!(ranks, vec![(3, 0), (4, 1), (5, 2)]);
        assert!(s.rank_thread(3).is_err());
        assert_eq!(s.error_file, Some(PathBuf::from("/tmp/e/error.json")));
    }

    /// The sinks and output of a process whose ranks are 3, 4 and 5.
    fn three_ranks_from_3() -> (Vec<Arc<RankSink>>, Arc<ThreadsOutput>) {
        let start = Instant::now();
        let sinks: Vec<_> = (3..6)
            .map(|r| RankSink::new(r, false, None, start))
            .collect();
        let out = ThreadsOutput::new(sinks.clone(), 3);
        (sinks, out)
    }

    /// An abort in a rank thread is blamed on the rank thread its message
    /// names, not on the process's first rank (issue 32 item 8).
    #[test]
    fn an_abort_is_blamed_on_the_rank_thread_that_says_it() {
        let (sinks, out) = three_ranks_from_3();
        let mut g = ThreadsGroup::new(program(), 3);
        g.out = Some(out.clone());
        let aborted = Exit::Signal { signal: 6 };
        let ended = Ended {
            index: 0,
            pid: 42,
            exit: aborted,
        };
        let f = g.failure(&attempt(), ended, &sinks).unwrap();
        assert_eq!(f.rank, 3);
        assert!(f.error.unwrap().contains("no rank thread said which"));
        out.line(Stream::Stderr, b"thread 'rank 4' has overflowed its stack");
        out.line(Stream::Stderr, b"fatal runtime error: stack overflow");
        let f = g.failure(&attempt(), ended, &sinks).unwrap();
        assert_eq!((f.rank, f.local_rank, f.pid), (4, 1, Some(42)));
        assert_eq!(
            thread_named(&["thread 'rank 12' panicked at x".into()]),
            Some(12)
        );
        assert_eq!(thread_named(&["thread 'main' panicked".into()]), None);
    }

    #[test]
    fn tagged_lines_reach_their_rank_and_the_rest_the_first() {
        let (sinks, out) = three_ranks_from_3();
        out.line(
            Stream::Stderr,
            accel_api::worker::tag_line(5, "five").as_bytes(),
        );
        out.line(Stream::Stderr, b"plain");
        // A rank outside the process is not trusted: the line stays whole.
        let foreign = accel_api::worker::tag_line(9, "nine");
        out.line(Stream::Stderr, foreign.as_bytes());
        assert_eq!(sinks[2].tail(), vec!["five".to_string()]);
        assert_eq!(sinks[0].tail(), vec!["plain".to_string(), foreign.clone()]);
        assert!(sinks[1].tail().is_empty());
        assert_eq!(out.untagged_tail(), vec!["plain".to_string(), foreign]);
    }
}
