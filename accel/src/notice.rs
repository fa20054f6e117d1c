//! Notices: what accel must tell the person running the program even when
//! the program installed no `tracing` subscriber (every example, most
//! first programs). A setting that cannot apply, a fallback taken, a save
//! that a killed process left half done and that was completed: one line
//! `accel: warning: ...` on rank 0's stderr (the launcher's own prefix;
//! under `accel launch` it shows as rank 0's), at most once per process for
//! the same text, and a `tracing` warning on the rank that found it, for
//! programs that collect logs. `ACCEL_STRICT=1` turns the settings among
//! them into errors before they get here (`train::control`).

use std::collections::BTreeSet;
use std::sync::Mutex;

/// The lines already said on this process's console.
static SAID: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Tell the user `line`, found on `rank`: a `tracing` warning here, and on
/// the console when `rank` is 0, once per process. `None`: a process-wide
/// finding (the plugins), said on the console of the process that hosts
/// rank 0, or of a process without ranks.
pub(crate) fn warn(rank: Option<usize>, line: &str) {
    match rank {
        Some(r) => tracing::warn!(rank = r, "{line}"),
        None => tracing::warn!("{line}"),
    }
    let rank = rank.or_else(|| crate::state::process_state().ok().map(|s| s.rank));
    if rank.is_some_and(|r| r != 0) {
        return;
    }
    let first = SAID
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(line.to_string());
    if first {
        crate::rank_output::print_rank_line(true, format_args!("accel: warning: {line}"));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_line_is_remembered_once_and_other_ranks_say_nothing() {
        super::warn(Some(1), "notice test: rank 1");
        assert!(!super::SAID.lock().unwrap().contains("notice test: rank 1"));
        super::warn(Some(0), "notice test: rank 0");
        super::warn(Some(0), "notice test: rank 0");
        assert!(super::SAID.lock().unwrap().contains("notice test: rank 0"));
    }
}
