//! Step phases and stragglers: the user marks data and forward
//! ([`Accelerator::phase`], [`Accelerator::phase_guard`]); `backward`,
//! its gradient sync, the optimizer step and `save_state` time themselves.
//! Every `K` optimizer steps ([`TrainConfig::straggler_every`]) the ranks
//! all-gather their mean per-phase times and score each rank against the
//! group's median, per phase (`stragglers.rs`); the main process logs them
//! to its trackers.
//!
//! [`TrainConfig::straggler_every`]: super::TrainConfig::straggler_every

use std::time::Instant;

use accel_api::{Communicator, CommunicatorExt, ErrorKind, Result};

use super::shared::TrainShared;
use super::stragglers::StragglerReport;
use crate::watch::{Phase, PhaseTimes, Watch};
use crate::Accelerator;

/// Times a phase until dropped ([`Accelerator::phase_guard`]).
#[derive(Debug)]
pub struct PhaseGuard<'a> {
    watch: &'a Watch,
    phase: Phase,
    start: Instant,
    previous: Option<Phase>,
}

impl<'a> PhaseGuard<'a> {
    pub(crate) fn new(watch: &'a Watch, phase: Phase) -> PhaseGuard<'a> {
        let previous = watch.enter_phase(phase);
        PhaseGuard {
            watch,
            phase,
            start: Instant::now(),
            previous,
        }
    }
}

impl Drop for PhaseGuard<'_> {
    fn drop(&mut self) {
        self.watch
            .leave_phase(self.phase, self.start.elapsed(), self.previous);
    }
}

/// After optimizer step `step` (counted by the first prepared optimizer,
/// so on every rank alike): every `K`-th, all-gather the phase times,
/// keep the report and log it. Collective on those steps.
pub(crate) fn report_phases(
    shared: &TrainShared,
    comm: &dyn Communicator,
    watch: &Watch,
    step: u64,
) -> Result<()> {
    let every = shared.lock().straggler_every as u64;
    if every == 0 || !step.is_multiple_of(every) {
        return Ok(());
    }
    let (mine, _) = watch.take_window();
    let times = if comm.world_size() > 1 {
        // f32: the type every backend gathers.
        let send: Vec<f32> = mine.ms.iter().map(|&x| x as f32).collect();
        let all = match comm.all_gather_vec(&send) {
            Ok(all) => all,
            Err(e) if matches!(e.kind(), ErrorKind::Unsupported) => {
                tracing::warn!("no straggler scores: {e}");
                shared.lock().straggler_every = 0;
                return Ok(());
            }
            Err(e) => return Err(e.with_op("straggler report")),
        };
        all.chunks(mine.ms.len())
            .map(|c| PhaseTimes {
                ms: std::array::from_fn(|i| f64::from(c[i])),
            })
            .collect()
    } else {
        vec![mine]
    };
    let report = StragglerReport { step, times };
    if let Some(mark) = report.mark(comm.rank()) {
        watch.set_straggler(mark);
    }
    let scalars = report.scalars();
    let values: Vec<(&str, f64)> = scalars.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    for t in shared.trackers().iter_mut() {
        if let Err(e) = t.log(&values, step) {
            tracing::warn!("straggler scores not logged to {}: {e}", t.name());
        }
    }
    shared.lock().straggler_report = Some(report);
    Ok(())
}

impl Accelerator {
    /// Run `f` as `phase` of the current step (the user's phases: data,
    /// forward): its time is added to the step's and reported with the
    /// straggler scores. Returns `f`'s result.
    ///
    /// `backward` (backward and sync), the optimizer step and `save_state`
    /// time themselves; a phase marked inside `backward`'s closure counts
    /// there too.
    pub fn phase<R>(&self, phase: Phase, f: impl FnOnce() -> R) -> R {
        let _g = self.phase_guard(phase);
        f()
    }

    /// [`phase`](Self::phase) as a guard: `phase` runs until it drops.
    pub fn phase_guard(&self, phase: Phase) -> PhaseGuard<'_> {
        PhaseGuard::new(self.watch(), phase)
    }

    /// The last completed step's number and phase times on this rank.
    pub fn last_step_phases(&self) -> Option<(u64, PhaseTimes)> {
        self.watch().last_step()
    }

    /// The last straggler report (every rank's per-phase times and the
    /// scores), on every rank; `None` before the first.
    pub fn straggler_report(&self) -> Option<StragglerReport> {
        super::shared(self).lock().straggler_report.clone()
    }
}
