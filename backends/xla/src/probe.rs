//! The probe: find the plugin, load and initialise it, create its client,
//! count devices (the first probe in a process does this once; later probes
//! reuse it). Any failure is an unavailable probe with the reason, never a
//! crash.

use accel_api::{Probe, ProbeContext};

use crate::runtime::Runtime;

/// What must be in the environment for ranks to be threads of one process
/// (set by the launcher for the threads process model, ADR 0012).
pub const PROCESS_MODEL_VAR: &str = accel_api::worker::keys::ACCEL_PROCESS_MODEL;

/// `true` when the run's ranks are threads of this process: the
/// environment says so (the launcher's threads process model), or the
/// probe context counts more than one rank in this process (what accel's
/// in-process entry, `accel::Threads`, passes).
fn ranks_are_threads(ctx: &ProbeContext, env: &dyn Fn(&str) -> Option<String>) -> bool {
    env(PROCESS_MODEL_VAR).is_some_and(|v| v.trim().eq_ignore_ascii_case("threads"))
        || ctx.ranks_in_process > 1
}

/// Available for a run whose ranks are all threads of this process (or a
/// one-rank run) and fit the client's devices.
pub(crate) fn probe(ctx: &ProbeContext) -> Probe {
    probe_with(ctx, &|k| std::env::var(k).ok())
}

pub(crate) fn probe_with(ctx: &ProbeContext, env: &dyn Fn(&str) -> Option<String>) -> Probe {
    // Decided before loading anything: multi-process runs of other
    // backends pay nothing for this probe.
    if ctx.world_size > 1 && !ranks_are_threads(ctx, env) {
        return Probe::unavailable(format!(
            "xla runs ranks as threads of one process ({PROCESS_MODEL_VAR}=threads), this run has {} processes: use `accel launch --backend xla`",
            ctx.world_size,
        ));
    }
    let rt = match Runtime::get() {
        Ok(rt) => rt,
        Err(e) => return Probe::unavailable(e.to_string()),
    };
    let devices = rt.device_count();
    if ctx.world_size > devices {
        return Probe::unavailable(format!(
            "{} ranks but the PJRT client has {devices} devices: set ACCEL_PJRT_CPU_DEVICES={} ({})",
            ctx.world_size,
            ctx.world_size,
            rt.describe()
        ));
    }
    Probe::available(devices, Some(rt.describe()))
}
