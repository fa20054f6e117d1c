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
}

#[derive(Debug, serde::Serialize)]
struct Report {
    accel_version: &'static str,
    plugin_abi: String,
    process: accel::ProcessState,
    store: Option<String>,
    backends: Vec<ProbeRow>,
    selected: std::result::Result<String, String>,
    plugins: Vec<PluginRow>,
    visible_devices: Vec<(String, String)>,
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
        plugins,
        visible_devices: DEVICE_MASKS
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
            .collect(),
    };
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).expect("report serialises")
        );
    } else {
        print_human(&report);
    }
    Ok(ExitCode::SUCCESS)
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
    outln!("Visible devices");
    if r.visible_devices.is_empty() {
        outln!("  cpu (no device masks set)");
    }
    for (k, v) in &r.visible_devices {
        outln!("  {k}={v}");
    }
}
