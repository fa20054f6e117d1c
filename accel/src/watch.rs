//! What a rank is doing now: its section (start-up, a training step, a
//! checkpoint), the step's phases (data, forward, backward, sync,
//! optimizer, checkpoint) and their times, the straggler score of its last
//! report; section timeouts enforced by a watchdog thread; and a small
//! status file per rank that `accel top` reads.
//!
//! One [`Watch`] per rank, made with its [`Accelerator`](crate::Accelerator).
//! The training loop moves it (`accumulate` starts a step, `save_state` is
//! a checkpoint, the user's `acc.phase(..)` marks data and forward); the
//! runtime only keeps the clock. Recording a phase takes a lock and adds to
//! a fixed array: no allocation per step.
//!
//! # Section timeouts
//! As NVIDIA's fault-tolerance launcher has them, three bounds, each off
//! unless set (parsed as `ACCEL_TIMEOUT` is: `30`, `90s`, `5m`):
//!
//! | variable | section | from .. to |
//! |---|---|---|
//! | `ACCEL_TIMEOUT_STARTUP` | `startup` | the accelerator's creation .. the first step |
//! | `ACCEL_TIMEOUT_STEP` | `step` | one `accumulate` .. the next (a step ends idle at the end of its loader's epoch and at `end_training`) |
//! | `ACCEL_TIMEOUT_CHECKPOINT` | `checkpoint` | one `save_state` |
//!
//! A section past its bound ends the process with an error naming the
//! section, the step and the rank (in the launcher's error file, so that
//! `accel launch`'s root cause names it), after a flight-recorder dump. A
//! rank waiting inside a collective is not the late one: it waits a grace
//! period more (the bound, between 5 s and 60 s), so that the rank stuck
//! in its own compute (the straggler) reports first.
//!
//! # Status files
//! Every [`STATUS_EVERY_ENV`] (default 2 s, `0`: off), under a launcher, a
//! background thread writes `<dump dir>/`[`STATUS_DIR`]`/rank<R>.json`
//! ([`RankStatus`]) where `accel top` reads them. Files rather than the
//! run's store: reaching the launcher's store from another process needs
//! the run's token, which only the workers hold; the dump folder is
//! already the run's own place on this machine (`accel trace` reads it).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use accel_api::flight::{flight_recorders, CallRecord, CallState};
use accel_api::worker::parse_duration;
use accel_api::Result;

/// The start-up bound (the accelerator's creation to the first step).
pub const TIMEOUT_STARTUP_ENV: &str = "ACCEL_TIMEOUT_STARTUP";
/// The bound of one training step.
pub const TIMEOUT_STEP_ENV: &str = "ACCEL_TIMEOUT_STEP";
/// The bound of one checkpoint (`save_state`).
pub const TIMEOUT_CHECKPOINT_ENV: &str = "ACCEL_TIMEOUT_CHECKPOINT";
/// How often each rank writes its status file (a duration; `0`: never).
pub const STATUS_EVERY_ENV: &str = "ACCEL_STATUS_EVERY";
/// The folder of the status files, under the run's dump folder.
pub const STATUS_DIR: &str = "status";
/// The status interval unless [`STATUS_EVERY_ENV`] says otherwise.
pub const DEFAULT_STATUS_EVERY: Duration = Duration::from_secs(2);

/// A phase of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Reading and preparing the batch (the user's: `acc.phase(Phase::Data, ..)`).
    Data,
    /// The forward pass (the user's).
    Forward,
    /// The backward pass (`backward`'s closure).
    Backward,
    /// The gradient synchronisation after the backward.
    Sync,
    /// The optimizer step (with the fp16 agreement).
    Optimizer,
    /// Saving a checkpoint.
    Checkpoint,
}

impl Phase {
    /// Every phase, in step order.
    pub const ALL: [Phase; 6] = [
        Phase::Data,
        Phase::Forward,
        Phase::Backward,
        Phase::Sync,
        Phase::Optimizer,
        Phase::Checkpoint,
    ];

    /// Its name in logs and tags (`data`, `forward`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Sync => "sync",
            Phase::Optimizer => "optimizer",
            Phase::Checkpoint => "checkpoint",
        }
    }

    /// The phase named `name` (as [`name`](Self::name) writes it).
    pub fn from_name(name: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == name)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Milliseconds per phase (one step's, or a mean per step).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PhaseTimes {
    /// Per phase, in [`Phase::ALL`]'s order.
    pub ms: [f64; 6],
}

impl PhaseTimes {
    /// The time of `phase`, in milliseconds.
    pub fn get(&self, phase: Phase) -> f64 {
        self.ms[phase.index()]
    }

    fn from_us(us: &[u64; 6], steps: u64) -> PhaseTimes {
        let n = steps.max(1) as f64;
        PhaseTimes {
            ms: us.map(|u| u as f64 / 1000.0 / n),
        }
    }
}

/// A section with a bound of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Section {
    /// From the accelerator's creation to the first step.
    Startup,
    /// One training step.
    Step,
    /// One checkpoint.
    Checkpoint,
    /// Between steps (after an epoch, evaluation, after `end_training`):
    /// no bound.
    Idle,
}

impl Section {
    /// Its name in errors (`startup`, `step`, `checkpoint`, `idle`).
    pub fn name(self) -> &'static str {
        match self {
            Section::Startup => "startup",
            Section::Step => "step",
            Section::Checkpoint => "checkpoint",
            Section::Idle => "idle",
        }
    }
}

/// The three section bounds; `None` is no bound.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SectionTimeouts {
    /// [`TIMEOUT_STARTUP_ENV`].
    pub startup: Option<Duration>,
    /// [`TIMEOUT_STEP_ENV`].
    pub step: Option<Duration>,
    /// [`TIMEOUT_CHECKPOINT_ENV`].
    pub checkpoint: Option<Duration>,
}

impl SectionTimeouts {
    /// The bounds the environment sets (unset or empty: none).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig)
    /// naming the variable: not a duration (the worker protocol's parser).
    pub fn from_env() -> Result<SectionTimeouts> {
        let read = |key: &str| -> Result<Option<Duration>> {
            match std::env::var(key) {
                Ok(v) if !v.trim().is_empty() => parse_duration(key, &v).map(Some),
                _ => Ok(None),
            }
        };
        Ok(SectionTimeouts {
            startup: read(TIMEOUT_STARTUP_ENV)?,
            step: read(TIMEOUT_STEP_ENV)?,
            checkpoint: read(TIMEOUT_CHECKPOINT_ENV)?,
        })
    }

    /// The bound of `section` and the variable that set it.
    pub fn bound(&self, section: Section) -> Option<(Duration, &'static str)> {
        match section {
            Section::Startup => self.startup.map(|d| (d, TIMEOUT_STARTUP_ENV)),
            Section::Step => self.step.map(|d| (d, TIMEOUT_STEP_ENV)),
            Section::Checkpoint => self.checkpoint.map(|d| (d, TIMEOUT_CHECKPOINT_ENV)),
            Section::Idle => None,
        }
    }

    fn any(&self) -> bool {
        self.startup.is_some() || self.step.is_some() || self.checkpoint.is_some()
    }
}

/// A rank's straggler score: its time against the group's median, in the
/// phase that costs it the most time over that median, at the last report.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StragglerMark {
    /// Time / group median (1.0: as the median).
    pub score: f64,
    /// The phase of that score.
    pub phase: Phase,
    /// The optimizer step of the report.
    pub at_step: u64,
}

/// One call of the flight recorder, as a status says it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OpStatus {
    /// The operation (`all_reduce`, ...).
    pub op: String,
    /// The collective's sequence number.
    pub seq: Option<u64>,
    /// The communicator (`world`, a sub-group's name).
    pub group: String,
    /// Issued (for a call in flight) or ended, in microseconds since the
    /// Unix epoch.
    pub time_us: u64,
}

/// How many phase spans a watch keeps for the trace's timeline (the last
/// 40-odd steps of six phases).
pub const PHASE_SPANS: usize = 256;

/// One phase of one step as it ran: what `accel trace --timeline` draws.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PhaseSpan {
    /// The step.
    pub step: u64,
    /// The phase.
    pub phase: Phase,
    /// When it began, in microseconds since the Unix epoch.
    pub start_us: u64,
    /// How long it ran, in microseconds.
    pub dur_us: u64,
}

/// What a rank is doing, as its status file and a flight dump hold it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RankStatus {
    /// The rank.
    pub rank: usize,
    /// Ranks in the run.
    pub world_size: usize,
    /// Its process.
    pub pid: u32,
    /// When this was written, in microseconds since the Unix epoch.
    pub time_us: u64,
    /// The section it is in.
    pub section: Section,
    /// For how long, in milliseconds.
    pub section_ms: f64,
    /// The step (`accumulate` calls so far; 0 before the first).
    pub step: u64,
    /// The phase it is in, if marked.
    pub phase: Option<Phase>,
    /// The last completed step's phase times.
    #[serde(default)]
    pub last_step: Option<PhaseTimes>,
    /// The collective it is in (the newest call not yet ended).
    #[serde(default)]
    pub in_op: Option<OpStatus>,
    /// The last call it completed.
    #[serde(default)]
    pub last_op: Option<OpStatus>,
    /// Its straggler score at the last report.
    #[serde(default)]
    pub straggler: Option<StragglerMark>,
    /// The values the main process last logged
    /// ([`Accelerator::log`](crate::Accelerator::log)), by name.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub metrics: std::collections::BTreeMap<String, f64>,
    /// The step those values were logged at.
    #[serde(default)]
    pub metrics_step: Option<u64>,
    /// The run's total steps, when the program said
    /// ([`Accelerator::set_total_steps`](crate::Accelerator::set_total_steps)).
    #[serde(default)]
    pub total_steps: Option<u64>,
    /// Its last [`PHASE_SPANS`] phase spans, oldest first: in flight dumps
    /// only (status files leave them out).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_phases: Vec<PhaseSpan>,
}

#[derive(Debug)]
struct State {
    section: Section,
    since: Instant,
    step: u64,
    phase: Option<Phase>,
    /// This step's phase times, in microseconds.
    current: [u64; 6],
    last: Option<[u64; 6]>,
    /// Completed steps since the last report, and their sums.
    window: [u64; 6],
    window_steps: u64,
    /// The loader's last batch began this step: idle after its optimizer step.
    closing: bool,
    straggler: Option<StragglerMark>,
    /// The last [`PHASE_SPANS`] spans (allocated once).
    spans: std::collections::VecDeque<PhaseSpan>,
    /// The last logged values and their step; the total steps.
    metrics: std::collections::BTreeMap<String, f64>,
    metrics_step: Option<u64>,
    total_steps: Option<u64>,
}

/// One rank's clock: section, step, phases (see the module docs).
#[derive(Debug)]
pub struct Watch {
    rank: usize,
    world_size: usize,
    bounds: SectionTimeouts,
    state: Mutex<State>,
    /// Where its status file goes (a last one when it drops).
    status_dir: Option<PathBuf>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(dir) = self.status_dir.take() {
            self.lock().section = Section::Idle;
            let _ = write_status(self, &dir);
        }
    }
}

/// Where a watch reports, besides its error: its status files' folder and
/// interval, and what dumps the flight recorder before a timeout ends the
/// process.
#[derive(Clone, Debug)]
pub struct Reporting {
    /// Status files every this long into `dir` (`None`: none).
    pub status: Option<(Duration, PathBuf)>,
    /// Called with the reason before a section timeout exits.
    pub dump: fn(&str),
}

impl Default for Reporting {
    fn default() -> Reporting {
        Reporting {
            status: None,
            dump: |_| {},
        }
    }
}

fn registry() -> &'static Mutex<Vec<Weak<Watch>>> {
    static R: OnceLock<Mutex<Vec<Weak<Watch>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Vec::new()))
}

/// Every live watch of this process (its rank threads' too).
pub fn watches() -> Vec<Arc<Watch>> {
    let mut r = registry().lock().unwrap_or_else(|p| p.into_inner());
    r.retain(|w| w.strong_count() > 0);
    r.iter().filter_map(Weak::upgrade).collect()
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn op_status(group: &str, r: &CallRecord, time_us: u64) -> OpStatus {
    OpStatus {
        op: r.op.name().to_string(),
        seq: r.seq,
        group: group.to_string(),
        time_us,
    }
}

impl Watch {
    /// A watch for `rank` of `world_size`, in the start-up section, with
    /// `bounds`; registered for dumps. Starts the watchdog thread when a
    /// bound is set and, with `reporting.status`, the status-file thread.
    pub fn new(
        rank: usize,
        world_size: usize,
        bounds: SectionTimeouts,
        reporting: Reporting,
    ) -> Arc<Watch> {
        let w = Arc::new(Watch {
            rank,
            world_size,
            bounds,
            state: Mutex::new(State {
                section: Section::Startup,
                since: Instant::now(),
                step: 0,
                phase: None,
                current: [0; 6],
                last: None,
                window: [0; 6],
                window_steps: 0,
                closing: false,
                straggler: None,
                spans: std::collections::VecDeque::with_capacity(PHASE_SPANS),
                metrics: std::collections::BTreeMap::new(),
                metrics_step: None,
                total_steps: None,
            }),
            status_dir: reporting.status.as_ref().map(|(_, d)| d.clone()),
        });
        registry()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&w));
        if bounds.any() {
            spawn_watchdog(&w, reporting.dump);
        }
        if let Some((every, dir)) = reporting.status.filter(|(d, _)| !d.is_zero()) {
            spawn_status(&w, every, dir);
        }
        w
    }

    /// A watch from the environment: the section bounds, and status files
    /// under a launcher ([`STATUS_EVERY_ENV`]) in `dump_dir`/[`STATUS_DIR`];
    /// `dump` as in [`Reporting`].
    ///
    /// # Errors
    /// A malformed bound or interval, naming its variable.
    pub fn from_env(
        rank: usize,
        world_size: usize,
        dump_dir: &std::path::Path,
        dump: fn(&str),
    ) -> Result<Arc<Watch>> {
        let bounds = SectionTimeouts::from_env()?;
        let status = match std::env::var(STATUS_EVERY_ENV) {
            Ok(v) if v.trim() == "0" => None,
            Ok(v) if !v.trim().is_empty() => Some(parse_duration(STATUS_EVERY_ENV, &v)?),
            _ => {
                let launched = std::env::var_os(accel_api::worker::keys::ACCEL_LAUNCHER).is_some()
                    || std::env::var_os(accel_api::worker::keys::TORCHELASTIC_RUN_ID).is_some();
                launched.then_some(DEFAULT_STATUS_EVERY)
            }
        };
        let status = status.map(|d| (d, dump_dir.join(STATUS_DIR)));
        Ok(Watch::new(
            rank,
            world_size,
            bounds,
            Reporting { status, dump },
        ))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Its rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Its bounds.
    pub fn bounds(&self) -> SectionTimeouts {
        self.bounds
    }

    /// A new step begins (the training loop's `accumulate`): the one
    /// before is complete (its times kept as the last step's and added to
    /// the report window); `last_of_loader` ends the step section after
    /// this step's optimizer step. Returns the new step's number.
    pub fn begin_step(&self, last_of_loader: bool) -> u64 {
        let mut s = self.lock();
        if s.step > 0 {
            let cur = s.current;
            s.last = Some(cur);
            for (w, c) in s.window.iter_mut().zip(cur) {
                *w += c;
            }
            s.window_steps += 1;
        }
        s.current = [0; 6];
        s.step += 1;
        s.section = Section::Step;
        s.since = Instant::now();
        s.closing = last_of_loader;
        s.step
    }

    /// The optimizer stepped: idle when the loader's last batch began
    /// this step (so evaluation between epochs is not timed as a step).
    pub fn optimizer_stepped(&self) {
        let mut s = self.lock();
        if s.closing && s.section == Section::Step {
            s.section = Section::Idle;
            s.since = Instant::now();
            s.closing = false;
        }
    }

    /// No section until the next step (`end_training`).
    pub fn idle(&self) {
        let mut s = self.lock();
        s.section = Section::Idle;
        s.since = Instant::now();
    }

    /// Enter `section` until the guard drops; then back to the section
    /// before, its clock restarted.
    pub fn section(&self, section: Section) -> SectionGuard<'_> {
        let mut s = self.lock();
        let before = s.section;
        s.section = section;
        s.since = Instant::now();
        SectionGuard {
            watch: self,
            before,
        }
    }

    /// Mark `phase` as the one running (for the status and timeout
    /// messages); returns the one it replaces.
    pub fn enter_phase(&self, phase: Phase) -> Option<Phase> {
        let mut s = self.lock();
        if s.section == Section::Startup {
            // A marked phase is training: start-up is over.
            s.section = Section::Step;
            s.since = Instant::now();
        }
        s.phase.replace(phase)
    }

    /// `phase` ran for `took`: added to this step's time; `previous` (from
    /// [`enter_phase`](Self::enter_phase)) becomes the running phase again.
    pub fn leave_phase(&self, phase: Phase, took: Duration, previous: Option<Phase>) {
        let dur_us = took.as_micros() as u64;
        let start_us = now_us().saturating_sub(dur_us);
        let mut s = self.lock();
        s.current[phase.index()] += dur_us;
        s.phase = previous;
        if s.spans.len() == PHASE_SPANS {
            s.spans.pop_front();
        }
        let step = s.step;
        s.spans.push_back(PhaseSpan {
            step,
            phase,
            start_us,
            dur_us,
        });
    }

    /// The last completed step's phase times and its number.
    pub fn last_step(&self) -> Option<(u64, PhaseTimes)> {
        let s = self.lock();
        s.last
            .map(|l| (s.step.saturating_sub(1), PhaseTimes::from_us(&l, 1)))
    }

    /// The report window's mean per-step phase times and its step count,
    /// and start a new window.
    pub fn take_window(&self) -> (PhaseTimes, u64) {
        let mut s = self.lock();
        let out = (
            PhaseTimes::from_us(&s.window, s.window_steps),
            s.window_steps,
        );
        s.window = [0; 6];
        s.window_steps = 0;
        out
    }

    /// Keep this rank's straggler score from the last report.
    pub fn set_straggler(&self, mark: StragglerMark) {
        self.lock().straggler = Some(mark);
    }

    /// The rings of this rank: all of the process's, unless it hosts
    /// several ranks (threads), then those that name this rank in a group
    /// of the world's size.
    fn rings(&self) -> Vec<Arc<accel_api::flight::FlightRecorder>> {
        let all = flight_recorders();
        if watches().len() <= 1 {
            return all;
        }
        all.into_iter()
            .filter(|r| {
                r.identity().rank == self.rank && r.identity().world_size == self.world_size
            })
            .collect()
    }

    /// The call it is in (the oldest not yet ended, across its rings) and
    /// the last it completed.
    fn ops(&self) -> (Option<OpStatus>, Option<OpStatus>) {
        let (mut inside, mut done): (Option<OpStatus>, Option<OpStatus>) = (None, None);
        for ring in self.rings() {
            let group = ring.identity().name.clone();
            let calls = ring.snapshot();
            if let Some(r) = calls
                .iter()
                .find(|r| matches!(r.state, CallState::Issued | CallState::Started))
            {
                if inside.as_ref().is_none_or(|i| r.issued_us < i.time_us) {
                    inside = Some(op_status(&group, r, r.issued_us));
                }
            }
            if let Some(r) = calls.iter().rev().find(|r| r.state == CallState::Completed) {
                if done.as_ref().is_none_or(|d| r.ended_us > d.time_us) {
                    done = Some(op_status(&group, r, r.ended_us));
                }
            }
        }
        (inside, done)
    }

    /// What it is doing now.
    pub fn status(&self) -> RankStatus {
        let (in_op, last_op) = self.ops();
        let s = self.lock();
        RankStatus {
            rank: self.rank,
            world_size: self.world_size,
            pid: std::process::id(),
            time_us: now_us(),
            section: s.section,
            section_ms: s.since.elapsed().as_secs_f64() * 1000.0,
            step: s.step,
            phase: s.phase,
            last_step: s.last.map(|l| PhaseTimes::from_us(&l, 1)),
            in_op,
            last_op,
            straggler: s.straggler,
            metrics: s.metrics.clone(),
            metrics_step: s.metrics_step,
            total_steps: s.total_steps,
            recent_phases: Vec::new(),
        }
    }

    /// Keep `values` logged at `step` for the status file (progress
    /// reporters read them there).
    pub(crate) fn set_metrics(&self, values: &[(&str, f64)], step: u64) {
        let mut s = self.lock();
        for (k, v) in values {
            s.metrics.insert((*k).to_string(), *v);
        }
        s.metrics_step = Some(step);
    }

    /// Keep the run's total steps for the status file.
    pub(crate) fn set_total_steps(&self, steps: u64) {
        self.lock().total_steps = Some(steps);
    }

    /// [`status`](Self::status) with its recent phase spans, for a flight
    /// dump.
    pub fn status_with_phases(&self) -> RankStatus {
        let mut st = self.status();
        st.recent_phases = self.lock().spans.iter().copied().collect();
        st
    }

    /// The section past its bound now, if any: (section, step, phase,
    /// elapsed, bound, variable).
    fn overdue(&self) -> Option<Overdue> {
        let s = self.lock();
        let (bound, var) = self.bounds.bound(s.section)?;
        let elapsed = s.since.elapsed();
        (elapsed > bound).then_some(Overdue {
            section: s.section,
            step: s.step,
            phase: s.phase,
            elapsed,
            bound,
            var,
        })
    }
}

/// Returns the watch to the section before (see [`Watch::section`]).
#[derive(Debug)]
pub struct SectionGuard<'a> {
    watch: &'a Watch,
    before: Section,
}

impl Drop for SectionGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.watch.lock();
        s.section = self.before;
        s.since = Instant::now();
    }
}

struct Overdue {
    section: Section,
    step: u64,
    phase: Option<Phase>,
    elapsed: Duration,
    bound: Duration,
    var: &'static str,
}

/// How much longer a rank waiting inside a collective gives the others.
fn grace(bound: Duration) -> Duration {
    bound.clamp(Duration::from_secs(5), Duration::from_secs(60))
}

/// The error of a section past its bound: names the section, the step and
/// the rank, and whether this rank is the straggler.
fn overdue_message(rank: usize, o: &Overdue, in_op: Option<&OpStatus>) -> String {
    let fmt = accel_api::worker::format_duration;
    let what = match o.section {
        Section::Startup => "start-up (no training step began)".to_string(),
        Section::Step => format!("step {}", o.step),
        Section::Checkpoint => format!("the checkpoint after step {}", o.step),
        Section::Idle => "idle".to_string(),
    };
    let phase = o
        .phase
        .map_or(String::new(), |p| format!(" in phase {}", p.name()));
    let whose = match in_op {
        None => {
            format!("rank {rank} is the straggler: it is in no collective (its own compute{phase})")
        }
        Some(op) => format!(
            "rank {rank} waits in {}{} on group {}: another rank is late",
            op.op,
            op.seq.map_or(String::new(), |s| format!(" #{s}")),
            op.group
        ),
    };
    format!(
        "rank {rank}: section {} timed out: {what} ran for {:.1}s, past its bound ({}={}); {whose}",
        o.section.name(),
        o.elapsed.as_secs_f64(),
        o.var,
        fmt(o.bound),
    )
}

fn fire(rank: usize, message: &str, section: Section, dump: fn(&str)) -> ! {
    eprintln!("accel: error: {message}");
    tracing::error!("{message}");
    if let Some(path) = accel_api::worker::error_file_from_env() {
        let record = accel_api::worker::ErrorRecord::now(
            Some(rank),
            message.to_string(),
            Some(format!("section {}", section.name())),
        );
        let _ = accel_api::worker::write_first_error(&path, &record);
    }
    dump(&format!("timeout: {message}"));
    std::process::exit(1)
}

fn spawn_watchdog(w: &Arc<Watch>, dump: fn(&str)) {
    let weak = Arc::downgrade(w);
    let rank = w.rank;
    let tick = [w.bounds.startup, w.bounds.step, w.bounds.checkpoint]
        .into_iter()
        .flatten()
        .min()
        .map_or(Duration::from_millis(200), |b| {
            (b / 10).clamp(Duration::from_millis(10), Duration::from_millis(500))
        });
    let spawned = std::thread::Builder::new()
        .name(format!("accel-watchdog-{rank}"))
        .spawn(move || loop {
            std::thread::sleep(tick);
            let Some(w) = weak.upgrade() else { return };
            let Some(o) = w.overdue() else { continue };
            let (in_op, _) = w.ops();
            if in_op.is_some() && o.elapsed < o.bound + grace(o.bound) {
                continue;
            }
            fire(
                rank,
                &overdue_message(rank, &o, in_op.as_ref()),
                o.section,
                dump,
            );
        });
    if let Err(e) = spawned {
        tracing::warn!("section timeouts are off on rank {rank}: {e}");
    }
}

/// Write `w`'s status to `<dir>/rank<R>.json` (a temporary file renamed).
///
/// # Errors
/// [`ErrorKind::Io`](accel_api::ErrorKind::Io) naming the path.
pub fn write_status(w: &Watch, dir: &std::path::Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| {
        accel_api::Error::io(format!("creating the status folder {}", dir.display()), e)
    })?;
    let path = dir.join(format!("rank{}.json", w.rank));
    let tmp = dir.join(format!(".rank{}.json.tmp", w.rank));
    let body = serde_json::to_vec(&w.status()).map_err(std::io::Error::other);
    body.and_then(|b| std::fs::write(&tmp, b))
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| accel_api::Error::io(format!("writing {}", path.display()), e))?;
    Ok(path)
}

fn spawn_status(w: &Arc<Watch>, every: Duration, dir: PathBuf) {
    let weak = Arc::downgrade(w);
    let rank = w.rank;
    let spawned = std::thread::Builder::new()
        .name(format!("accel-status-{rank}"))
        .spawn(move || {
            let mut warned = false;
            loop {
                {
                    let Some(w) = weak.upgrade() else { return };
                    if let Err(e) = write_status(&w, &dir) {
                        if !warned {
                            tracing::warn!("rank {rank}: no status file for accel top: {e}");
                            warned = true;
                        }
                    }
                }
                std::thread::sleep(every);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("rank {rank}: no status file for accel top: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_keep_their_phase_times_and_the_window_means_them() {
        let w = Watch::new(0, 1, SectionTimeouts::default(), Reporting::default());
        assert_eq!(w.status().section, Section::Startup);
        for step in 1..=3u64 {
            assert_eq!(w.begin_step(false), step);
            let before = w.enter_phase(Phase::Forward);
            w.leave_phase(Phase::Forward, Duration::from_millis(step * 10), before);
        }
        // Steps 1 and 2 are complete; 3 is running.
        let (times, steps) = w.take_window();
        assert_eq!(steps, 2);
        assert_eq!(times.get(Phase::Forward), 15.0);
        assert_eq!(w.last_step().unwrap().1.get(Phase::Forward), 20.0);
        assert_eq!(w.take_window().1, 0);
        let s = w.status();
        assert_eq!((s.section, s.step, s.phase), (Section::Step, 3, None));
    }

    #[test]
    fn the_last_batch_of_a_loader_ends_the_step_section_after_the_optimizer() {
        let w = Watch::new(0, 1, SectionTimeouts::default(), Reporting::default());
        w.begin_step(true);
        {
            let _c = w.section(Section::Checkpoint);
            assert_eq!(w.status().section, Section::Checkpoint);
        }
        assert_eq!(w.status().section, Section::Step);
        w.optimizer_stepped();
        assert_eq!(w.status().section, Section::Idle);
    }

    #[test]
    fn bounds_parse_with_the_worker_protocols_parser_and_messages_name_the_section() {
        let b = SectionTimeouts {
            step: Some(Duration::from_secs(2)),
            ..SectionTimeouts::default()
        };
        assert_eq!(
            b.bound(Section::Step),
            Some((Duration::from_secs(2), TIMEOUT_STEP_ENV))
        );
        assert_eq!(b.bound(Section::Idle), None);
        let e = parse_duration(TIMEOUT_STEP_ENV, "soon").unwrap_err();
        assert!(e.to_string().contains(TIMEOUT_STEP_ENV), "{e}");
        let o = Overdue {
            section: Section::Step,
            step: 7,
            phase: Some(Phase::Forward),
            elapsed: Duration::from_millis(2500),
            bound: Duration::from_secs(2),
            var: TIMEOUT_STEP_ENV,
        };
        let m = overdue_message(3, &o, None);
        for says in [
            "rank 3",
            "section step",
            "step 7",
            "straggler",
            "forward",
            "ACCEL_TIMEOUT_STEP=2s",
        ] {
            assert!(m.contains(says), "{says}: {m}");
        }
        let op = OpStatus {
            op: "all_reduce".into(),
            seq: Some(4),
            group: "world".into(),
            time_us: 0,
        };
        let m = overdue_message(0, &o, Some(&op));
        assert!(
            m.contains("waits in all_reduce #4") && m.contains("another rank"),
            "{m}"
        );
    }
}
