//! Straggler reports: every rank's mean per-phase times over a window of
//! steps, the group's median per phase, each rank's score against it, and
//! the trackers' scalars. Plain data, no communication (`phases.rs`
//! gathers them).

use accel_api::Result;

use crate::watch::{Phase, PhaseTimes, StragglerMark};

/// `ACCEL_STRAGGLER_EVERY`: optimizer steps between straggler reports
/// (`0`: none), when [`TrainConfig::straggler_every`](super::TrainConfig::straggler_every)
/// is not set.
pub const STRAGGLER_EVERY_ENV: &str = "ACCEL_STRAGGLER_EVERY";

/// Straggler reports every this many optimizer steps by default.
pub const DEFAULT_STRAGGLER_EVERY: usize = 50;

/// The report interval the environment sets, else the default.
pub(crate) fn straggler_every_from_env() -> Result<usize> {
    match std::env::var(STRAGGLER_EVERY_ENV) {
        Ok(v) if !v.trim().is_empty() => accel_api::worker::parse_number(STRAGGLER_EVERY_ENV, &v),
        _ => Ok(DEFAULT_STRAGGLER_EVERY),
    }
}

/// Every rank's mean per-phase times over the steps of one report window,
/// and what follows: medians, scores, the straggler.
#[derive(Clone, Debug, PartialEq)]
pub struct StragglerReport {
    /// The optimizer step of the report.
    pub step: u64,
    /// Per rank, its mean time per step of each phase.
    pub times: Vec<PhaseTimes>,
}

impl StragglerReport {
    /// The group's median time of `phase`, in milliseconds (the lower
    /// middle for an even number of ranks, the mean of the two middles).
    pub fn median(&self, phase: Phase) -> f64 {
        let mut v: Vec<f64> = self.times.iter().map(|t| t.get(phase)).collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => 0.0,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    /// Each rank's time of `phase` against the group's median; against
    /// the mean when most ranks spend no time in it (a median under a
    /// microsecond); 1.0 for a phase no rank uses.
    pub fn scores(&self, phase: Phase) -> Vec<f64> {
        let n = self.times.len().max(1) as f64;
        let mean = self.times.iter().map(|t| t.get(phase)).sum::<f64>() / n;
        let m = self.median(phase);
        let d = if m >= 1e-3 { m } else { mean };
        self.times
            .iter()
            .map(|t| if d < 1e-3 { 1.0 } else { t.get(phase) / d })
            .collect()
    }

    /// The slowest rank in `phase` and its score.
    pub fn straggler(&self, phase: Phase) -> Option<(usize, f64)> {
        self.scores(phase)
            .into_iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// `rank`'s mark: the phase that costs it the most time over the
    /// group's median (milliseconds, not the ratio: a phase of a few
    /// microseconds that jitters to three times its median must not hide a
    /// forward 40 ms slower), with its score there.
    pub fn mark(&self, rank: usize) -> Option<StragglerMark> {
        let times = self.times.get(rank)?;
        Phase::ALL
            .into_iter()
            .filter_map(|p| {
                let score = *self.scores(p).get(rank)?;
                Some((p, score, times.get(p) - self.median(p)))
            })
            .max_by(|a, b| a.2.total_cmp(&b.2).then(a.1.total_cmp(&b.1)))
            .map(|(phase, score, _)| StragglerMark {
                score,
                phase,
                at_step: self.step,
            })
    }

    /// The trackers' scalars: `phase/<name>_ms` (the median),
    /// `straggler/<name>` (the highest score) and `straggler/<name>_rank`
    /// (whose), for every phase some rank spent time in.
    pub fn scalars(&self) -> Vec<(String, f64)> {
        let mut out = Vec::new();
        for p in Phase::ALL {
            if self.times.iter().all(|t| t.get(p) <= 0.0) {
                continue;
            }
            out.push((format!("phase/{}_ms", p.name()), self.median(p)));
            if let Some((rank, score)) = self.straggler(p) {
                out.push((format!("straggler/{}", p.name()), score));
                out.push((format!("straggler/{}_rank", p.name()), rank as f64));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(step: u64, rows: &[[f64; 6]]) -> StragglerReport {
        StragglerReport {
            step,
            times: rows.iter().map(|&ms| PhaseTimes { ms }).collect(),
        }
    }

    #[test]
    fn scores_are_time_over_the_median_and_name_the_slowest_rank() {
        let r = report(
            50,
            &[
                [1.0, 10.0, 0.0, 0.0, 0.0, 0.0],
                [1.0, 40.0, 0.0, 0.0, 0.0, 0.0],
                [2.0, 10.0, 0.0, 0.0, 0.0, 0.0],
            ],
        );
        assert_eq!(r.median(Phase::Forward), 10.0);
        assert_eq!(r.scores(Phase::Forward), vec![1.0, 4.0, 1.0]);
        assert_eq!(r.straggler(Phase::Forward), Some((1, 4.0)));
        assert_eq!(r.scores(Phase::Backward), vec![1.0; 3], "an unused phase");
        let m = r.mark(1).unwrap();
        assert_eq!((m.phase, m.score, m.at_step), (Phase::Forward, 4.0, 50));
        let s: std::collections::BTreeMap<String, f64> = r.scalars().into_iter().collect();
        assert_eq!(s["phase/forward_ms"], 10.0);
        assert_eq!(s["straggler/forward"], 4.0);
        assert_eq!(s["straggler/forward_rank"], 1.0);
        assert_eq!(s["straggler/data"], 2.0);
        assert!(!s.contains_key("phase/backward_ms"));
        // One rank alone in a phase: scored against the mean.
        let r = report(2, &[[0.0; 6], [0.0, 30.0, 0.0, 0.0, 0.0, 0.0], [0.0; 6]]);
        assert_eq!(r.straggler(Phase::Forward), Some((1, 3.0)));
        // A rank 40 ms slow in forward, where the others take no time (a
        // score of 3 against the mean), and jittery in a phase of a few
        // microseconds (a score of 4 there): its mark is the forward, where
        // it loses the time.
        let r = report(
            10,
            &[
                [0.0, 0.0, 0.0, 0.0, 0.05, 0.0],
                [0.0, 40.0, 0.0, 0.0, 0.2, 0.0],
                [0.0, 0.0, 0.0, 0.0, 0.05, 0.0],
            ],
        );
        let m = r.mark(1).unwrap();
        assert_eq!((m.phase, m.score), (Phase::Forward, 3.0), "{m:?}");
        assert!(
            r.scores(Phase::Optimizer)[1] > m.score,
            "the tiny phase scores higher"
        );
        assert!(r.mark(3).is_none(), "no such rank");
    }
}
