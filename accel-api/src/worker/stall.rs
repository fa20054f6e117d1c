//! The stall inspector's records in the run's store: what every rank
//! writes (the collective it entered last), what the first rank that timed
//! out leaves (a [`StallVerdict`]), and where (`accel/<run id>/<restart>/
//! stall`). The inspector that writes them runs in the workers (the
//! facade's `accel::stall`); the launcher reads the verdict to blame the
//! rank that never arrived.

use crate::{Op, Store};

/// Key of rank `r`'s record under the inspector's store prefix.
pub fn rank_key(rank: usize) -> String {
    format!("rank/{rank}")
}

/// Key of the verdict under the inspector's store prefix.
pub const VERDICT_KEY: &str = "verdict";

/// Where a worker's accelerator puts the inspector's keys in the run's
/// store: `accel/<run id>/<restart>/stall`.
pub fn store_prefix(run_id: &str, restart: u32) -> String {
    format!("accel/{run_id}/{restart}/stall")
}

/// A rank's record: `<seq> <op>`, collective number `seq` entered last.
pub fn record(seq: u64, op: Op) -> String {
    format!("{seq} {}", op.name())
}

/// The sequence number and operation of a record ([`record`]); `None`
/// when it is not one.
pub fn parse_record(v: &[u8]) -> Option<(u64, String)> {
    let s = std::str::from_utf8(v).ok()?;
    let (seq, op) = s.split_once(' ')?;
    Some((seq.parse().ok()?, op.to_string()))
}

/// `all_reduce#41`: how a collective is named in a verdict.
pub fn label(seq: u64, op: &str) -> String {
    format!("{op}#{seq}")
}

/// The number of a collective's label (`all_reduce#41` → 41).
pub fn label_seq(label: &str) -> Option<u64> {
    label.rsplit_once('#').and_then(|(_, n)| n.parse().ok())
}

/// How far behind a missing rank is, as a sort key: a rank that entered no
/// collective first, then the lower its last collective's number the
/// further behind, then the lower rank.
pub fn behind_key(rank: usize, last: Option<&str>) -> (Option<u64>, usize) {
    (last.map(|l| label_seq(l).unwrap_or(u64::MAX)), rank)
}

/// One rank that did not arrive at a collective, and what it last entered.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MissingRank {
    /// Its rank.
    pub rank: usize,
    /// The last collective it entered (`all_reduce#41`), `None` when it
    /// never entered one.
    pub last: Option<String>,
}

/// What the first rank that timed out found: who it waited for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StallVerdict {
    /// The rank that timed out and wrote this.
    pub seen_by: usize,
    /// The collective it waited in (`all_reduce#42`).
    pub waiting_in: String,
    /// The ranks whose last collective is older than `waiting_in`.
    pub missing: Vec<MissingRank>,
}

impl StallVerdict {
    /// `1 (last: all_reduce#41), 3 (last: none)`.
    pub fn missing_text(&self) -> String {
        self.missing
            .iter()
            .map(|m| format!("{} (last: {})", m.rank, m.last.as_deref().unwrap_or("none")))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The missing rank furthest behind ([`behind_key`]): the others that
    /// are missing are often held up by it, inside a collective it never
    /// finished (a ring all-reduce another rank had already left).
    pub fn furthest_behind(&self) -> Option<&MissingRank> {
        self.missing
            .iter()
            .min_by_key(|m| behind_key(m.rank, m.last.as_deref()))
    }

    /// Leave this verdict in `store` (scoped to the inspector's prefix)
    /// unless a rank left one already: the first rank to time out is the
    /// one that speaks.
    pub fn write_first(&self, store: &dyn Store) {
        let text = serde_json::to_vec(self).unwrap_or_default();
        let _ = store.compare_set(VERDICT_KEY, None, &text);
    }

    /// The verdict in `store` (already scoped to the inspector's prefix),
    /// if a rank wrote one.
    pub fn read(store: &dyn Store) -> Option<StallVerdict> {
        let v = store.try_get(VERDICT_KEY).ok()??;
        serde_json::from_slice(&v).ok()
    }

    /// [`read`](Self::read), waiting up to `timeout` for a rank to write it.
    pub fn wait(store: &dyn Store, timeout: std::time::Duration) -> Option<StallVerdict> {
        let v = store.get(VERDICT_KEY, timeout).ok()?;
        serde_json::from_slice(&v).ok()
    }

    /// [`read`](Self::read), with each missing rank's record read again
    /// now: its last collective as of this moment (the verdict's is as of
    /// the timeout), and a rank that has since entered the collective the
    /// verdict waited in is no longer missing.
    pub fn read_fresh(store: &dyn Store) -> Option<StallVerdict> {
        let mut v = Self::read(store)?;
        let waited = label_seq(&v.waiting_in);
        v.missing.retain_mut(|m| {
            let now = store.try_get(&rank_key(m.rank)).ok().flatten();
            match now.as_deref().and_then(parse_record) {
                Some((seq, _)) if waited.is_some_and(|w| seq >= w) => false,
                Some((seq, op)) => {
                    m.last = Some(label(seq, &op));
                    true
                }
                None => true,
            }
        });
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_labels_read_back() {
        let r = record(41, Op::AllGather);
        assert_eq!(parse_record(r.as_bytes()), Some((41, "all_gather".into())));
        assert_eq!(parse_record(b"x all_gather"), None);
        assert_eq!(parse_record(b"41"), None);
        assert_eq!(label(41, "all_gather"), "all_gather#41");
        assert_eq!(store_prefix("r", 2), "accel/r/2/stall");
        let v = StallVerdict {
            seen_by: 0,
            waiting_in: "barrier#3".into(),
            missing: vec![
                MissingRank {
                    rank: 1,
                    last: Some("all_reduce#2".into()),
                },
                MissingRank {
                    rank: 3,
                    last: None,
                },
            ],
        };
        assert_eq!(v.missing_text(), "1 (last: all_reduce#2), 3 (last: none)");
        assert_eq!(v.furthest_behind().map(|m| m.rank), Some(3), "none entered");
        let v = StallVerdict {
            missing: vec![
                MissingRank {
                    rank: 1,
                    last: Some("all_reduce#383".into()),
                },
                MissingRank {
                    rank: 3,
                    last: Some("all_reduce#380".into()),
                },
                MissingRank {
                    rank: 4,
                    last: Some("all_reduce#380".into()),
                },
            ],
            ..v
        };
        assert_eq!(v.furthest_behind().map(|m| m.rank), Some(3));
        assert_eq!(label_seq("all_reduce#383"), Some(383));
        assert_eq!(label_seq("all_reduce"), None);
    }
}
