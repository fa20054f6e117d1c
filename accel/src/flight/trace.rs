//! `accel trace`'s analysis: the dumps of a run ([`Dump`]) merged per
//! group, the first collective where the ranks part ways, the ranks still
//! inside a collective, who waits for whom, and a Chrome / Perfetto
//! timeline.
//!
//! # What is compared
//! A group is its backend and its name (`world`, `world/split3:c1`); its
//! members are the group ranks of its rings. Collectives carry a sequence
//! number that is the same on every rank for the same call, so the
//! sequences are compared number by number, from the newest number every
//! ring still holds:
//! - two ranks issued different calls (operation, element type, count,
//!   root, reduction) under one number: a **mismatch**;
//! - some ranks issued it and others had not when they dumped: **missing**,
//!   but only where the absent ranks were not still inside an earlier call
//!   of the group, no rank had completed it (a completed collective had
//!   every rank), and the absent rank dumped after the others issued it (a
//!   dump taken earlier says nothing).
//!
//! Several dumps of one process (a timeout, then the panic that followed):
//! the newest is read. Several restarts in one folder: the newest restart
//! unless one is asked for. Times are the ranks' wall clocks: across
//! machines they are as close as the clocks are.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use accel_api::flight::{CallRecord, CallState};
use accel_api::{DType, Error, Op, ReduceOp, Result};

use super::{Dump, DUMP_FORMAT};

/// The most bytes of one dump file read (a dump holds at most
/// [`MAX_CALLS`](super::MAX_CALLS) calls).
pub const MAX_DUMP_BYTES: u64 = 64 << 20;

/// A dump file and what it says.
#[derive(Debug, Clone)]
pub struct DumpFile {
    /// Where it was read.
    pub path: PathBuf,
    /// Its contents.
    pub dump: Dump,
}

/// Read every `*.json` dump in `dir` (files of another format are
/// skipped, with their reason in the second list).
///
/// # Errors
/// [`accel_api::ErrorKind::Io`] when `dir` cannot be listed;
/// `InvalidArgument` when it holds no dump at all.
pub fn read_dir(dir: &Path) -> Result<(Vec<DumpFile>, Vec<String>)> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::io(format!("reading the dump folder {}", dir.display()), e))?;
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json") && p.is_file())
        .collect();
    paths.sort();
    let mut dumps = Vec::new();
    let mut skipped = Vec::new();
    for p in paths {
        match read_file(&p) {
            Ok(d) => dumps.push(DumpFile { path: p, dump: d }),
            Err(why) => skipped.push(format!("{}: {why}", p.display())),
        }
    }
    if dumps.is_empty() {
        return Err(Error::invalid_argument(
            "accel trace",
            format!(
                "{} holds no flight-recorder dump ({DUMP_FORMAT})",
                dir.display()
            ),
        ));
    }
    Ok((dumps, skipped))
}

fn read_file(p: &Path) -> std::result::Result<Dump, String> {
    let len = std::fs::metadata(p).map_err(|e| e.to_string())?.len();
    if len > MAX_DUMP_BYTES {
        return Err(format!("{len} bytes, more than a dump holds"));
    }
    let bytes = std::fs::read(p).map_err(|e| e.to_string())?;
    let d: Dump = serde_json::from_slice(&bytes).map_err(|e| format!("not a dump: {e}"))?;
    if d.format != DUMP_FORMAT {
        return Err(format!("format {:?}, not {DUMP_FORMAT}", d.format));
    }
    Ok(d)
}

/// One collective as the comparison sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct CallSig {
    /// The operation.
    pub op: Op,
    /// Element type.
    pub dtype: DType,
    /// Elements the rank contributed.
    pub count: u64,
    /// Root of a rooted call.
    pub root: Option<u32>,
    /// Reduction of a reducing call.
    pub reduce: Option<ReduceOp>,
}

impl CallSig {
    fn of(c: &CallRecord) -> CallSig {
        CallSig {
            op: c.op,
            dtype: c.dtype,
            count: c.count,
            root: c.root,
            reduce: c.reduce,
        }
    }
}

impl std::fmt::Display for CallSig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}({} x {}", self.op, lower(&self.dtype), self.count)?;
        if let Some(r) = self.reduce {
            write!(f, ", {}", lower(&r))?;
        }
        if let Some(r) = self.root {
            write!(f, ", root {r}")?;
        }
        f.write_str(")")
    }
}

/// The serde name of a unit variant (`f32`, `sum`).
fn lower(v: &impl std::fmt::Debug) -> String {
    format!("{v:?}").to_lowercase()
}

/// One rank's ring of one group, from its newest dump.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Member {
    /// Rank in the group.
    pub group_rank: usize,
    /// Rank in the run, where the dump says (`None`: a process of several
    /// rank threads, for a sub-group).
    pub rank: Option<usize>,
    /// The dump it came from.
    pub file: PathBuf,
    /// Why that dump was written.
    pub reason: String,
    /// When, in microseconds since the Unix epoch.
    pub dumped_us: u64,
    /// Its newest collective's sequence number.
    pub last_seq: Option<u64>,
    /// Its calls, oldest first.
    #[serde(skip)]
    pub calls: Vec<CallRecord>,
}

impl Member {
    fn at(&self, seq: u64) -> Option<&CallRecord> {
        self.calls.iter().rev().find(|c| c.seq == Some(seq))
    }

    fn first_seq(&self) -> Option<u64> {
        self.calls.iter().find_map(|c| c.seq)
    }

    /// The newest call still in progress (issued or started) at the dump.
    fn in_progress(&self) -> Option<&CallRecord> {
        self.calls
            .iter()
            .rev()
            .find(|c| matches!(c.state, CallState::Issued | CallState::Started))
    }

    /// Who this member is, for people: `rank 2` or `group rank 1`.
    pub fn who(&self) -> String {
        match self.rank {
            Some(r) => format!("rank {r}"),
            None => format!("group rank {}", self.group_rank),
        }
    }
}

/// What the ranks on one side of a divergence did at its sequence number.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Side {
    /// The call they issued; `None`: they had not issued it.
    pub call: Option<CallSig>,
    /// Their group ranks.
    pub group_ranks: Vec<usize>,
    /// Their ranks in the run, where known.
    pub ranks: Vec<usize>,
    /// What they did last in the group, when `call` is `None`: the
    /// sequence number and state of their newest collective.
    pub last: Option<(u64, CallState)>,
}

/// How the ranks part ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DivergenceKind {
    /// Different calls under one sequence number.
    Mismatch,
    /// Some ranks issued it, others had not (or left no dump).
    Missing,
}

/// The first sequence number of a group where the ranks disagree.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Divergence {
    /// The collective's sequence number in the group.
    pub seq: u64,
    /// Mismatch or missing.
    pub kind: DivergenceKind,
    /// One side per distinct call, then the ranks that had not issued it;
    /// the largest side first.
    pub sides: Vec<Side>,
    /// Group ranks that left no dump.
    pub no_dump: Vec<usize>,
}

/// One group across its ranks.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GroupTrace {
    /// `world`, or the path of splits that made it.
    pub name: String,
    /// The backend's name.
    pub backend: String,
    /// Ranks in the group.
    pub world_size: usize,
    /// The members that dumped, by group rank.
    pub members: Vec<Member>,
    /// Group ranks that left no dump.
    pub no_dump: Vec<usize>,
    /// Where the ranks first part ways, if they do.
    pub divergence: Option<Divergence>,
}

/// A rank inside a collective when it dumped, or stopped in one by an
/// error.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Stuck {
    /// Its rank in the run, where known.
    pub rank: Option<usize>,
    /// Its rank in the group.
    pub group_rank: usize,
    /// The group.
    pub group: String,
    /// The call's sequence number (`None`: point to point).
    pub seq: Option<u64>,
    /// The call.
    pub call: CallSig,
    /// Issued, started (still inside at the dump) or failed.
    pub state: CallState,
    /// Since when, in microseconds since the Unix epoch (its issue).
    pub since_us: u64,
    /// How long it was inside: until the dump, or until it failed.
    pub for_us: u64,
    /// The group ranks that had not issued it, where the group's
    /// divergence says so.
    pub waiting_for: Vec<usize>,
    /// The same in the run's ranks, where known.
    pub waiting_for_ranks: Vec<usize>,
}

/// A dump that was read.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DumpInfo {
    /// Its file.
    pub file: PathBuf,
    /// The process's rank.
    pub rank: Option<usize>,
    /// The process.
    pub pid: u32,
    /// Its machine.
    pub host: String,
    /// Why it was written.
    pub reason: String,
    /// When, in microseconds since the Unix epoch.
    pub time_us: u64,
    /// Whether the analysis read it (the newest of its process).
    pub used: bool,
}

/// The merged dumps of a run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Trace {
    /// The run.
    pub run_id: String,
    /// The restart read (`ACCEL_RESTART_COUNT`), where the dumps say.
    pub restart: Option<u32>,
    /// Ranks in the run, where the dumps say.
    pub world_size: Option<usize>,
    /// Every dump of that run and restart.
    pub dumps: Vec<DumpInfo>,
    /// Ranks of the run that left no dump (where the world size is known).
    pub ranks_without_dump: Vec<usize>,
    /// One entry per group, `world` first.
    pub groups: Vec<GroupTrace>,
    /// Ranks inside (or failed in) a collective, longest first.
    pub stuck: Vec<Stuck>,
    /// Ranks that wait for each other in a circle (sub-groups called in
    /// different orders), each circle once, smallest rank first.
    pub cycles: Vec<Vec<usize>>,
    /// Each rank's recent step phases, where its dump holds them (the
    /// training loop's; by rank).
    pub phases: Vec<RankPhases>,
}

/// One rank's recent step phases, from its newest dump.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RankPhases {
    /// The rank.
    pub rank: usize,
    /// Its spans, oldest first.
    pub spans: Vec<crate::watch::PhaseSpan>,
}

/// Which dumps to read when a folder holds several runs or restarts.
#[derive(Debug, Clone, Default)]
pub struct Select {
    /// This run (default: the run of the newest dump).
    pub run_id: Option<String>,
    /// This restart (default: the newest of the run).
    pub restart: Option<u32>,
}

/// Merge `files`: the run and restart `select` names (else the newest), the
/// newest dump of each process, then every group compared.
///
/// # Errors
/// `InvalidArgument` when no dump matches `select`.
pub fn analyze(files: &[DumpFile], select: &Select) -> Result<Trace> {
    let newest = files
        .iter()
        .max_by_key(|f| f.dump.time_us)
        .ok_or_else(|| Error::invalid_argument("accel trace", "no dump to read"))?;
    let run_id = select
        .run_id
        .clone()
        .unwrap_or_else(|| newest.dump.run_id.clone());
    let of_run: Vec<&DumpFile> = files.iter().filter(|f| f.dump.run_id == run_id).collect();
    let restart = match select.restart {
        Some(r) => Some(r),
        None => of_run.iter().filter_map(|f| f.dump.restart).max(),
    };
    let chosen: Vec<&DumpFile> = of_run
        .into_iter()
        .filter(|f| select.restart.is_none() || f.dump.restart == restart)
        .filter(|f| restart.is_none() || f.dump.restart.is_none() || f.dump.restart == restart)
        .collect();
    if chosen.is_empty() {
        return Err(Error::invalid_argument(
            "accel trace",
            format!(
                "no dump of run {run_id}{}",
                restart.map(|r| format!(" restart {r}")).unwrap_or_default()
            ),
        ));
    }
    // The newest dump of each process.
    let mut newest_of: BTreeMap<(String, u32), &DumpFile> = BTreeMap::new();
    for f in &chosen {
        let k = (f.dump.host.clone(), f.dump.pid);
        let keep = newest_of
            .get(&k)
            .is_none_or(|g| f.dump.time_us > g.dump.time_us);
        if keep {
            newest_of.insert(k, f);
        }
    }
    let used: BTreeSet<&Path> = newest_of.values().map(|f| f.path.as_path()).collect();
    let mut dumps: Vec<DumpInfo> = chosen
        .iter()
        .map(|f| DumpInfo {
            file: f.path.clone(),
            rank: f.dump.rank,
            pid: f.dump.pid,
            host: f.dump.host.clone(),
            reason: f.dump.reason.clone(),
            time_us: f.dump.time_us,
            used: used.contains(f.path.as_path()),
        })
        .collect();
    dumps.sort_by_key(|d| (d.rank, d.time_us));
    let world_size = chosen
        .iter()
        .flat_map(|f| {
            let worlds = f.dump.groups.iter().map(|g| &g.identity);
            let worlds = worlds.filter(|i| i.name == "world").map(|i| i.world_size);
            f.dump.world_size.into_iter().chain(worlds)
        })
        .max();
    let groups = merge_groups(newest_of.values().copied());
    let dumped: BTreeSet<usize> = newest_of
        .values()
        .flat_map(|f| {
            // Every rank of the process: its world rings' ranks, else its own.
            let world: Vec<usize> = f
                .dump
                .groups
                .iter()
                .filter(|g| g.identity.name == "world")
                .map(|g| g.identity.rank)
                .collect();
            if world.is_empty() {
                f.dump.rank.into_iter().collect()
            } else {
                world
            }
        })
        .collect();
    let ranks_without_dump = world_size
        .map(|n| (0..n).filter(|r| !dumped.contains(r)).collect())
        .unwrap_or_default();
    let stuck = stuck_ranks(&groups);
    let cycles = cycles(&stuck);
    let mut phases: BTreeMap<usize, RankPhases> = BTreeMap::new();
    for f in newest_of.values() {
        for st in f
            .dump
            .ranks
            .iter()
            .filter(|st| !st.recent_phases.is_empty())
        {
            phases.insert(
                st.rank,
                RankPhases {
                    rank: st.rank,
                    spans: st.recent_phases.clone(),
                },
            );
        }
    }
    let phases = phases.into_values().collect();
    Ok(Trace {
        run_id,
        restart,
        world_size,
        dumps,
        ranks_without_dump,
        groups,
        stuck,
        cycles,
        phases,
    })
}

/// The rings of `dumps`, one [`GroupTrace`] per (backend, name), compared.
fn merge_groups<'a>(dumps: impl Iterator<Item = &'a DumpFile>) -> Vec<GroupTrace> {
    let mut by_group: BTreeMap<(String, String), (usize, BTreeMap<usize, Member>)> =
        BTreeMap::new();
    for f in dumps {
        let d = &f.dump;
        let worlds: Vec<usize> = d
            .groups
            .iter()
            .filter(|g| g.identity.name == "world")
            .map(|g| g.identity.rank)
            .collect();
        // The process's rank: its dump's, else its one world ring's.
        let own = d.rank.or_else(|| match worlds[..] {
            [r] => Some(r),
            _ => None,
        });
        for g in &d.groups {
            let id = &g.identity;
            let rank = if id.name == "world" {
                Some(id.rank)
            } else if worlds.len() <= 1 {
                own
            } else {
                None
            };
            let m = Member {
                group_rank: id.rank,
                rank,
                file: f.path.clone(),
                reason: d.reason.clone(),
                dumped_us: d.time_us,
                last_seq: g.calls.iter().rev().find_map(|c| c.seq),
                calls: g.calls.clone(),
            };
            let entry = by_group
                .entry((id.name.clone(), id.backend.clone()))
                .or_insert((id.world_size, BTreeMap::new()));
            entry.0 = entry.0.max(id.world_size);
            // Two rings of one name in one rank (a second communicator):
            // the one with the newest call.
            let newer = |m: &Member| m.calls.last().map_or(0, |c| c.issued_us);
            let keep = entry.1.get(&id.rank).is_none_or(|o| newer(&m) >= newer(o));
            if keep {
                entry.1.insert(id.rank, m);
            }
        }
    }
    let mut groups: Vec<GroupTrace> = by_group
        .into_iter()
        .map(|((name, backend), (world_size, members))| {
            let members: Vec<Member> = members.into_values().collect();
            let no_dump: Vec<usize> = (0..world_size)
                .filter(|r| !members.iter().any(|m| m.group_rank == *r))
                .collect();
            let divergence = diverge(&members, &no_dump);
            GroupTrace {
                name,
                backend,
                world_size,
                members,
                no_dump,
                divergence,
            }
        })
        .collect();
    // `world` first, then the sub-groups by name.
    groups.sort_by_key(|g| (g.name != "world", g.name.clone()));
    groups
}

/// The first sequence number where `members` disagree (see the module's
/// rules); `no_dump`: the group ranks without a ring.
fn diverge(members: &[Member], no_dump: &[usize]) -> Option<Divergence> {
    let lo = members
        .iter()
        .filter_map(Member::first_seq)
        .max()
        .unwrap_or(0);
    let hi = members.iter().filter_map(|m| m.last_seq).max()?;
    for seq in lo..=hi {
        let present: Vec<(&Member, &CallRecord)> = members
            .iter()
            .filter_map(|m| m.at(seq).map(|c| (m, c)))
            .collect();
        let first_issue = present.iter().map(|(_, c)| c.issued_us).min().unwrap_or(0);
        let completed = present.iter().any(|(_, c)| c.state == CallState::Completed);
        let absent: Vec<&Member> = members
            .iter()
            .filter(|m| m.last_seq.is_none_or(|l| l < seq))
            .filter(|m| m.in_progress().is_none() && m.dumped_us >= first_issue)
            .collect();
        let mut sigs: Vec<(CallSig, Vec<&Member>)> = Vec::new();
        for (m, c) in &present {
            let s = CallSig::of(c);
            match sigs.iter_mut().find(|(t, _)| *t == s) {
                Some((_, v)) => v.push(m),
                None => sigs.push((s, vec![m])),
            }
        }
        let kind = if sigs.len() > 1 {
            DivergenceKind::Mismatch
        } else if !completed && !absent.is_empty() {
            DivergenceKind::Missing
        } else if !completed && seq == hi && !no_dump.is_empty() {
            // Every dumped rank waits in the newest call: the ranks without
            // a dump are the only ones that can hold it up.
            DivergenceKind::Missing
        } else {
            continue;
        };
        sigs.sort_by_key(|s| std::cmp::Reverse(s.1.len()));
        let mut sides: Vec<Side> = sigs
            .into_iter()
            .map(|(s, ms)| Side {
                call: Some(s),
                group_ranks: ms.iter().map(|m| m.group_rank).collect(),
                ranks: ms.iter().filter_map(|m| m.rank).collect(),
                last: None,
            })
            .collect();
        for m in absent {
            let last = m
                .calls
                .iter()
                .rev()
                .find(|c| c.seq.is_some())
                .map(|c| (c.seq.unwrap_or(0), c.state));
            sides.push(Side {
                call: None,
                group_ranks: vec![m.group_rank],
                ranks: m.rank.into_iter().collect(),
                last,
            });
        }
        return Some(Divergence {
            seq,
            kind,
            sides,
            no_dump: no_dump.to_vec(),
        });
    }
    None
}

/// Every member's call in progress at its dump, or its newest failed call
/// (a timeout ends a call that never completed), longest first.
fn stuck_ranks(groups: &[GroupTrace]) -> Vec<Stuck> {
    let mut out = Vec::new();
    for g in groups {
        for m in &g.members {
            let last = m.calls.last();
            let c = match (m.in_progress(), last) {
                (Some(c), _) => c,
                (None, Some(c)) if c.state == CallState::Failed => c,
                _ => continue,
            };
            let end = if c.state == CallState::Failed {
                c.ended_us
            } else {
                m.dumped_us
            };
            let (waiting_for, waiting_for_ranks) = match &g.divergence {
                Some(d) if Some(d.seq) == c.seq => {
                    let mine = d
                        .sides
                        .iter()
                        .find(|s| s.group_ranks.contains(&m.group_rank))
                        .and_then(|s| s.call);
                    // The ranks not on my side: a different call, none, or
                    // no dump.
                    let mut gr: Vec<usize> = d
                        .sides
                        .iter()
                        .filter(|s| s.call.is_none() || s.call != mine)
                        .flat_map(|s| s.group_ranks.iter().copied())
                        .chain(d.no_dump.iter().copied())
                        .collect();
                    gr.sort_unstable();
                    let ranks = gr
                        .iter()
                        .filter_map(|r| {
                            g.members
                                .iter()
                                .find(|o| o.group_rank == *r)
                                .and_then(|o| o.rank)
                                .or_else(|| (g.name == "world").then_some(*r))
                        })
                        .collect();
                    (gr, ranks)
                }
                _ => (Vec::new(), Vec::new()),
            };
            out.push(Stuck {
                rank: m.rank,
                group_rank: m.group_rank,
                group: g.name.clone(),
                seq: c.seq,
                call: CallSig::of(c),
                state: c.state,
                since_us: c.issued_us,
                for_us: end.saturating_sub(c.issued_us),
                waiting_for,
                waiting_for_ranks,
            });
        }
    }
    out.sort_by(|a, b| b.for_us.cmp(&a.for_us).then(a.rank.cmp(&b.rank)));
    out
}

/// Circles in "rank A waits for rank B" (run ranks), each once.
fn cycles(stuck: &[Stuck]) -> Vec<Vec<usize>> {
    let mut edges: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for s in stuck {
        if let Some(r) = s.rank {
            edges
                .entry(r)
                .or_default()
                .extend(s.waiting_for_ranks.iter().copied());
        }
    }
    let mut found: BTreeSet<Vec<usize>> = BTreeSet::new();
    for &start in edges.keys() {
        // Depth-first from `start`, paths through larger ranks only, so that
        // each circle is found once, from its smallest rank.
        let mut stack: Vec<(usize, Vec<usize>)> = vec![(start, vec![start])];
        while let Some((at, path)) = stack.pop() {
            for &next in edges.get(&at).into_iter().flatten() {
                if next == start && path.len() > 1 {
                    found.insert(path.clone());
                } else if next > start && !path.contains(&next) {
                    let mut p = path.clone();
                    p.push(next);
                    stack.push((next, p));
                }
            }
        }
    }
    found.into_iter().collect()
}

/// The thread of a rank's step phases on the timeline (below its groups').
const PHASES_TID: usize = 10_000;

/// The Chrome / Perfetto trace of `trace` (ui.perfetto.dev,
/// chrome://tracing): one process per rank, one thread per group, one
/// complete event per call (issue to end, or to the dump when it had not
/// ended), an instant event at each dump, and a thread `steps` with one
/// complete event per step phase where the dumps hold them. Times in
/// microseconds from the first call or phase.
pub fn timeline(trace: &Trace) -> serde_json::Value {
    use serde_json::json;
    let calls = trace
        .groups
        .iter()
        .flat_map(|g| g.members.iter().flat_map(|m| m.calls.iter()))
        .map(|c| c.issued_us);
    let spans = trace
        .phases
        .iter()
        .flat_map(|p| p.spans.iter().map(|s| s.start_us));
    let t0 = calls.chain(spans).min().unwrap_or(0);
    let rel = |t: u64| t.saturating_sub(t0);
    let mut events = Vec::new();
    let mut named_pids = BTreeSet::new();
    let mut dumps_seen = BTreeSet::new();
    for (gi, g) in trace.groups.iter().enumerate() {
        for m in &g.members {
            // A rank without a known run rank gets a pid past the run's.
            let pid = m.rank.unwrap_or(100_000 + m.group_rank);
            let tid = gi;
            if named_pids.insert(pid) {
                let name = match m.rank {
                    Some(r) => format!("rank {r}"),
                    None => format!("{} group rank {}", g.name, m.group_rank),
                };
                events.push(
                    json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "ts": 0, "args": {"name": name}}),
                );
                events.push(json!({"ph": "M", "name": "process_sort_index", "pid": pid,
                    "tid": 0, "ts": 0, "args": {"sort_index": pid}}));
            }
            events.push(
                json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                "ts": 0, "args": {"name": format!("{} ({})", g.name, g.backend)}}),
            );
            for c in &m.calls {
                let end = if c.ended_us > 0 {
                    c.ended_us
                } else {
                    m.dumped_us.max(c.issued_us)
                };
                let name = match c.seq {
                    Some(s) => format!("{} #{s}", c.op),
                    None => c.op.to_string(),
                };
                events.push(json!({
                    "ph": "X", "name": name, "cat": g.name, "pid": pid, "tid": tid,
                    "ts": rel(c.issued_us), "dur": end.saturating_sub(c.issued_us),
                    "args": {
                        "seq": c.seq, "call": CallSig::of(c).to_string(),
                        "state": c.state, "async": c.started_async,
                        "started_at_us": (c.started_us > 0).then(|| rel(c.started_us)),
                        "peer": c.peer,
                    },
                }));
            }
            if dumps_seen.insert((pid, tid, m.dumped_us)) {
                events.push(
                    json!({"ph": "i", "s": "t", "name": format!("dump: {}", m.reason),
                    "pid": pid, "tid": tid, "ts": rel(m.dumped_us)}),
                );
            }
        }
    }
    for p in &trace.phases {
        let pid = p.rank;
        if named_pids.insert(pid) {
            events.push(
                json!({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                "ts": 0, "args": {"name": format!("rank {pid}")}}),
            );
        }
        events.push(
            json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": PHASES_TID,
            "ts": 0, "args": {"name": "steps (phases)"}}),
        );
        for s in &p.spans {
            events.push(json!({
                "ph": "X", "name": s.phase.name(), "cat": "phase", "pid": pid,
                "tid": PHASES_TID, "ts": rel(s.start_us), "dur": s.dur_us,
                "args": {"step": s.step},
            }));
        }
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run_id": trace.run_id, "restart": trace.restart, "t0_unix_us": t0},
    })
}

/// Microseconds for people (`850 µs`, `2.95 s`).
pub fn human_us(us: u64) -> String {
    match us {
        0..=999 => format!("{us} µs"),
        1_000..=999_999 => format!("{:.1} ms", us as f64 / 1e3),
        _ => format!("{:.2} s", us as f64 / 1e6),
    }
}

/// The start of a long reason (an error message with its fix), on one
/// line.
fn short(reason: &str) -> String {
    let first = reason.lines().next().unwrap_or("");
    match first.char_indices().nth(100) {
        Some((i, _)) => format!("{}...", &first[..i]),
        None => first.to_string(),
    }
}

fn ranks_list(v: &[usize]) -> String {
    v.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Trace {
    /// The report for people, one line per finding.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut line = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        let used = self.dumps.iter().filter(|d| d.used).count();
        line(format!(
            "run {}{}: {} dump(s) read ({} process(es)){}",
            self.run_id,
            self.restart
                .map(|r| format!(" restart {r}"))
                .unwrap_or_default(),
            self.dumps.len(),
            used,
            match self.world_size {
                Some(n) => format!(", {n} rank(s)"),
                None => String::new(),
            }
        ));
        for d in self.dumps.iter().filter(|d| d.used) {
            line(format!(
                "  {}: {} ({})",
                d.rank
                    .map_or_else(|| format!("pid {}", d.pid), |r| format!("rank {r}")),
                short(&d.reason),
                d.file.display()
            ));
        }
        if !self.ranks_without_dump.is_empty() {
            line(format!(
                "  no dump from rank(s) {}",
                ranks_list(&self.ranks_without_dump)
            ));
        }
        for g in &self.groups {
            line(String::new());
            let last = g.members.iter().filter_map(|m| m.last_seq).max();
            line(format!(
                "group {} ({}, {} rank(s)){}",
                g.name,
                g.backend,
                g.world_size,
                last.map(|l| format!(": newest collective #{l}"))
                    .unwrap_or_else(|| ": no collective".into())
            ));
            let Some(d) = &g.divergence else {
                line("  the ranks agree on every collective they hold".into());
                continue;
            };
            let what = match d.kind {
                DivergenceKind::Mismatch => "the ranks issued different calls",
                DivergenceKind::Missing => "not every rank issued it",
            };
            line(format!("  first divergence at #{}: {what}", d.seq));
            for s in &d.sides {
                let who = side_who(g, s);
                match (&s.call, s.last) {
                    (Some(c), _) => line(format!("    {who}: {c}")),
                    (None, Some((seq, st))) => line(format!(
                        "    {who}: never issued #{} (newest: #{seq}, {})",
                        d.seq,
                        lower(&st)
                    )),
                    (None, None) => line(format!(
                        "    {who}: never issued #{} (no collective in this group)",
                        d.seq
                    )),
                }
            }
            if !d.no_dump.is_empty() {
                let who = if g.name == "world" {
                    "rank(s)"
                } else {
                    "group rank(s)"
                };
                line(format!("    {who} {}: no dump", ranks_list(&d.no_dump)));
            }
        }
        if !self.stuck.is_empty() {
            line(String::new());
            line("inside a collective (or failed in one):".into());
            for s in &self.stuck {
                let who = s.rank.map_or_else(
                    || format!("group rank {}", s.group_rank),
                    |r| format!("rank {r}"),
                );
                let seq = s.seq.map(|q| format!(" #{q}")).unwrap_or_default();
                let state = match s.state {
                    CallState::Failed => "failed after",
                    CallState::Issued => "queued for",
                    _ => "inside for",
                };
                let wait = if s.waiting_for_ranks.is_empty() && s.waiting_for.is_empty() {
                    String::new()
                } else if s.waiting_for_ranks.len() == s.waiting_for.len() {
                    format!(", waiting for rank(s) {}", ranks_list(&s.waiting_for_ranks))
                } else {
                    format!(", waiting for group rank(s) {}", ranks_list(&s.waiting_for))
                };
                line(format!(
                    "  {who}: {} {}{seq}, {state} {}{wait}",
                    s.group,
                    s.call,
                    human_us(s.for_us)
                ));
            }
        }
        for c in &self.cycles {
            let mut path: Vec<String> = c.iter().map(|r| format!("rank {r}")).collect();
            path.push(format!("rank {}", c[0]));
            line(format!(
                "crossed: {} (each waits in a collective the next has not issued)",
                path.join(" -> ")
            ));
        }
        out
    }
}

/// `rank(s) 1, 2` in the world, `rank(s) 1, 2 (group rank(s) 0, 1)` in a
/// sub-group whose run ranks are known.
fn side_who(g: &GroupTrace, s: &Side) -> String {
    if g.name == "world" {
        format!("rank(s) {}", ranks_list(&s.group_ranks))
    } else if s.ranks.len() != s.group_ranks.len() {
        format!("group rank(s) {}", ranks_list(&s.group_ranks))
    } else {
        format!(
            "rank(s) {} (group rank(s) {})",
            ranks_list(&s.ranks),
            ranks_list(&s.group_ranks)
        )
    }
}

#[cfg(test)]
mod tests;
