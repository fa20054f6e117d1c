//! `accel env`: what this machine and this process look like to accel.

use std::process::ExitCode;

use accel::{ProbeRow, Registry};
use accel_api::Result;

/// Arguments of `accel env`.
#[derive(Debug, clap::Args)]
pub struct EnvArgs {
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,

    /// Also say which engine `accel launch -n 2 -- PROGRAM` would use when
    /// no backend is named, and why.
    #[arg(long, value_name = "PROGRAM")]
    program: Option<std::ffi::OsString>,
}

/// What `accel launch` runs programs over when no backend is named
/// (`crate::launch_cmd::default_backend`).
#[derive(Debug, serde::Serialize)]
struct LaunchDefault {
    /// The rule, in one sentence.
    rule: &'static str,
    /// The MPI launcher and its family, or why there is none.
    mpirun: std::result::Result<String, String>,
    /// The choice for `--program`, at 2 processes on this machine.
    program: Option<crate::launch_cmd::default_backend::Choice>,
}

const DEFAULT_RULE: &str =
    "on one machine with 2 or more processes, mpi (through mpirun) for an ELF \
     program that links libmpi.so, when an MPI launcher of the same family exists and no \
     accelerator backend is available; cpu-gloo (local workers) otherwise; --backend forces one";

fn launch_default(program: Option<&std::ffi::OsStr>) -> LaunchDefault {
    use crate::launch_cmd::default_backend;
    let mpirun = default_backend::find_mpirun()
        .map(|p| {
            let family = match accel_launch::mpirun::detect_flavor(&p) {
                accel_launch::mpirun::MpiFlavor::OpenMpi => "Open MPI",
                accel_launch::mpirun::MpiFlavor::Mpich => "MPICH",
            };
            format!("{} ({family})", p.display())
        })
        .map_err(|e| e.to_string());
    let program = program.map(|p| {
        match accel_launch::program::resolve(p, std::env::var_os("PATH").as_deref()) {
            Ok(path) => default_backend::choose(&path, 2, 1),
            Err(e) => default_backend::Choice {
                backend: "cpu-gloo",
                reason: e.to_string(),
                mpirun: None,
                flavor: None,
            },
        }
    });
    LaunchDefault {
        rule: DEFAULT_RULE,
        mpirun,
        program,
    }
}

#[derive(Debug, serde::Serialize)]
struct Report {
    accel_version: &'static str,
    plugin_abi: String,
    process: accel::ProcessState,
    store: Option<String>,
    backends: Vec<ProbeRow>,
    selected: std::result::Result<String, String>,
    /// What the program would say of this environment: `Ok` with what it
    /// resolves to, or the error `Accelerator::new` returns (the same
    /// check, `accel::env_check`).
    verdict: std::result::Result<String, String>,
    plugins: Vec<PluginRow>,
    visible_devices: Vec<(String, String)>,
    launch_default: LaunchDefault,
}

#[derive(Debug, serde::Serialize)]
struct PluginRow {
    path: String,
    loaded: bool,
    backend: Option<String>,
    reason: Option<String>,
}

const DEVICE_MASKS: &[&str] = &[
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
    "TPU_VISIBLE_CHIPS",
    "PJRT_DEVICE",
];

pub fn run(args: EnvArgs) -> Result<ExitCode> {
    // A malformed environment is an error here, naming the variable.
    let state = accel::state::process_state()?;
    let registry = Registry::from_env();
    let ctx = state.probe_context();
    let backends = registry.probe_all(&ctx);
    let selected = registry
        .select(&ctx, state.backend.as_deref())
        .map(|b| b.name().to_string())
        .map_err(|e| e.to_string());
    let checked =
        accel::env_check::check_environment(&state, &registry, &|k| std::env::var(k).ok());
    let code = match &checked {
        Ok(_) => 0,
        Err(e) if e.kind() == &accel_api::ErrorKind::InvalidConfig => 2,
        Err(_) => 1,
    };
    let verdict = checked
        .map(|c| {
            format!(
                "OK: a program would connect backend {} on {} (store: {:?})",
                c.backend.name(),
                c.device,
                c.store
            )
        })
        .map_err(|e| e.to_string());
    let mut plugins: Vec<PluginRow> = registry
        .entries()
        .iter()
        .filter_map(|e| match &e.origin {
            accel::Origin::Plugin(p) => Some(PluginRow {
                path: p.display().to_string(),
                loaded: true,
                backend: Some(e.backend.name().to_string()),
                reason: None,
            }),
            accel::Origin::Builtin => None,
        })
        .collect();
    plugins.extend(registry.plugin_failures().iter().map(|f| PluginRow {
        path: f.path.display().to_string(),
        loaded: false,
        backend: None,
        reason: Some(f.reason.clone()),
    }));
    let report = Report {
        accel_version: env!("CARGO_PKG_VERSION"),
        plugin_abi: format!(
            "{}.{}",
            accel_plugin::abi::ACCEL_PLUGIN_ABI_MAJOR,
            accel_plugin::abi::ACCEL_PLUGIN_ABI_MINOR
        ),
        store: state
            .store_location()
            .unwrap_or_else(|e| Some(format!("<error: {e}>"))),
        process: (*state).clone(),
        backends,
        selected,
        verdict,
        plugins,
        visible_devices: DEVICE_MASKS
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
            .collect(),
        launch_default: launch_default(args.program.as_deref()),
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).expect("report serialises")
        );
    } else {
        print_human(&report);
    }
    Ok(ExitCode::from(code))
}

fn print_human(r: &Report) {
    let p = &r.process;
    outln!("accel {} (plugin ABI {})", r.accel_version, r.plugin_abi);
    outln!();
    outln!("Process");
    outln!(
        "  rank {} of {} (local {} of {}, machine {}), launcher: {:?}",
        p.rank,
        p.world_size,
        p.local_rank,
        p.local_world_size,
        p.node_rank,
        p.source
    );
    outln!(
        "  run id {}, restart {}, timeout {:?}, debug {}",
        p.run_id,
        p.restart_count,
        p.timeout,
        p.debug
    );
    outln!(
        "  store: {}",
        r.store.as_deref().unwrap_or("in-memory (one-process run)")
    );
    if let Some(b) = &p.backend {
        outln!("  ACCEL_BACKEND: {}", b.join(","));
    }
    outln!();
    outln!("Backends (probe order)");
    let vw = r
        .backends
        .iter()
        .filter_map(|row| row.probe.as_ref()?.engine_version.as_ref().map(String::len))
        .max()
        .unwrap_or(0)
        .max("version".len());
    outln!(
        "  {:<14} {:>8}  {:<9} {:<9} {:>7}  {:<vw$}  reason / origin",
        "name",
        "priority",
        "compiled",
        "available",
        "devices",
        "version"
    );
    for row in &r.backends {
        let (avail, devices, version, reason) = match &row.probe {
            Some(pr) => (
                if pr.is_available() { "yes" } else { "no" },
                pr.device_count.to_string(),
                pr.engine_version.clone().unwrap_or_else(|| "-".into()),
                pr.reason()
                    .map(str::to_string)
                    .unwrap_or_else(|| match &row.origin {
                        Some(accel::Origin::Plugin(path)) => format!("plugin {}", path.display()),
                        _ => String::new(),
                    }),
            ),
            None => (
                "-",
                "-".into(),
                "-".into(),
                format!(
                    "not compiled in (cargo feature `{}`)",
                    row.feature.as_deref().unwrap_or("?")
                ),
            ),
        };
        outln!(
            "  {:<14} {:>8}  {:<9} {:<9} {:>7}  {:<vw$}  {}",
            row.name,
            row.priority
                .map(|p| p.to_string())
                .unwrap_or_else(|| "-".into()),
            if row.compiled_in { "yes" } else { "no" },
            avail,
            devices,
            version,
            reason
        );
    }
    outln!();
    match &r.selected {
        Ok(name) => outln!("Selected backend: {name}"),
        Err(e) => outln!("Selected backend: none ({e})"),
    }
    match &r.verdict {
        Ok(v) => outln!("Verdict: {v}"),
        Err(e) => outln!("Verdict: REFUSED: a program would fail with: {e}"),
    }
    outln!();
    outln!("Plugins (ACCEL_PLUGIN_PATH)");
    if r.plugins.is_empty() {
        outln!("  none");
    }
    for pl in &r.plugins {
        if pl.loaded {
            outln!(
                "  loaded  {}  (backend {})",
                pl.path,
                pl.backend.as_deref().unwrap_or("?")
            );
        } else {
            outln!(
                "  FAILED  {}  {}",
                pl.path,
                pl.reason.as_deref().unwrap_or("")
            );
        }
    }
    outln!();
    outln!("Default engine of `accel launch` (no --backend)");
    outln!("  rule: {}", r.launch_default.rule);
    match &r.launch_default.mpirun {
        Ok(m) => outln!("  MPI launcher: {m}"),
        Err(e) => outln!("  MPI launcher: none ({e})"),
    }
    if let Some(c) = &r.launch_default.program {
        outln!("  this program: {} ({})", c.backend, c.reason);
    }
    outln!();
    outln!("Visible devices");
    if r.visible_devices.is_empty() {
        outln!("  cpu (no device masks set)");
    }
    for (k, v) in &r.visible_devices {
        outln!("  {k}={v}");
    }
}
