//! The backend registry: what is compiled in (via `inventory` and explicit
//! registration), what plugins added, and the probe that picks one.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::Arc;

use accel_api::kit::BackendRegistration;
use accel_api::{Availability, Backend, Error, ErrorKind, Probe, ProbeContext, Result};

/// Every backend accel knows by name, with the cargo feature that compiles
/// it in, in probe order. Used to report backends that are not compiled in.
pub const KNOWN_BACKENDS: &[(&str, &str)] = &[
    ("xla", "xla"),
    ("npu-hccl", "npu-hccl"),
    ("cuda-nccl", "cuda-nccl"),
    ("mpi", "mpi"),
    ("cpu-gloo", "cpu-gloo"),
    ("single", "(always)"),
];

/// The entries of a plugin path list, each relative one joined to `cwd`;
/// and the relative entries that could not be, with their error.
fn absolute_entries(
    list: &OsStr,
    cwd: std::io::Result<PathBuf>,
) -> (Vec<PathBuf>, Vec<(PathBuf, Error)>) {
    let mut entries = Vec::new();
    let mut unresolved = Vec::new();
    for entry in std::env::split_paths(list) {
        if entry.as_os_str().is_empty() || entry.is_absolute() {
            entries.push(entry);
            continue;
        }
        match &cwd {
            Ok(dir) => entries.push(dir.join(&entry)),
            Err(e) => {
                let err = Error::new(
                    ErrorKind::Plugin {
                        path: entry.clone(),
                        symbol: None,
                    },
                    format!(
                        "the ACCEL_PLUGIN_PATH entry `{}` is relative, and the current \
                         directory it is relative to cannot be read: {e}",
                        entry.display()
                    ),
                )
                .with_op("load plugin")
                .with_fix("give the plugin's absolute path in ACCEL_PLUGIN_PATH");
                unresolved.push((entry, err));
            }
        }
    }
    (entries, unresolved)
}

/// Where a registered backend came from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", content = "path", rename_all = "lowercase")]
pub enum Origin {
    /// Compiled into this binary.
    Builtin,
    /// Loaded from a plugin shared object.
    Plugin(PathBuf),
}

/// A plugin that could not be loaded: its path and why.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PluginFailure {
    /// The shared object (or ACCEL_PLUGIN_PATH entry).
    pub path: PathBuf,
    /// What went wrong and how to fix it.
    pub reason: String,
}

/// A registered backend.
#[derive(Clone)]
pub struct Entry {
    /// The backend.
    pub backend: Arc<dyn Backend>,
    /// Where it came from.
    pub origin: Origin,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.backend.name())
            .field("priority", &self.backend.priority())
            .field("origin", &self.origin)
            .finish()
    }
}

/// One row of the probe table that `accel env` prints.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProbeRow {
    /// Backend name.
    pub name: String,
    /// Probe order (higher first); `None` when not compiled in.
    pub priority: Option<i32>,
    /// `true` when the backend is in this binary or was loaded as a plugin.
    pub compiled_in: bool,
    /// Builtin or plugin path.
    pub origin: Option<Origin>,
    /// The probe's answer (`None` when not compiled in).
    pub probe: Option<Probe>,
    /// The cargo feature that compiles it in.
    pub feature: Option<String>,
}

impl ProbeRow {
    /// `true` when compiled in and available.
    pub fn is_available(&self) -> bool {
        self.probe.as_ref().is_some_and(Probe::is_available)
    }
}

/// The registry.
#[derive(Debug, Default, Clone)]
pub struct Registry {
    entries: Vec<Entry>,
    plugin_failures: Vec<PluginFailure>,
}

impl Registry {
    /// An empty registry.
    pub fn empty() -> Registry {
        Registry::default()
    }

    /// Every backend compiled into this binary (submitted with
    /// `accel_api::kit::submit_backend!`), without plugins.
    pub fn builtin() -> Registry {
        crate::link_backends();
        let mut r = Registry::empty();
        for reg in inventory::iter::<BackendRegistration> {
            let b: Arc<dyn Backend> = Arc::from((reg.make)());
            if let Err(e) = r.register(b, Origin::Builtin) {
                tracing::warn!(crate_name = reg.crate_name, "{e}");
            }
        }
        r
    }

    /// [`builtin`](Self::builtin) plus every plugin on `ACCEL_PLUGIN_PATH`.
    /// Broken plugins are recorded in [`plugin_failures`](Self::plugin_failures)
    /// and logged; they never stop the process.
    pub fn from_env() -> Registry {
        let mut r = Registry::builtin();
        if let Ok(path) = std::env::var("ACCEL_PLUGIN_PATH") {
            r.load_plugins(&path);
        }
        r
    }

    /// Load every plugin named by a `:`-separated list of files and
    /// directories (as `ACCEL_PLUGIN_PATH`).
    ///
    /// A relative entry is taken relative to the current directory
    /// (`libz.so` is `./libz.so`), never looked up on the library path the
    /// way the dynamic loader treats a bare file name. When the current
    /// directory cannot be read, relative entries are recorded as failures
    /// and skipped.
    pub fn load_plugins(&mut self, path_list: &str) {
        let (entries, unresolved) =
            absolute_entries(OsStr::new(path_list), std::env::current_dir());
        for (entry, e) in unresolved {
            self.fail_plugin(entry, e);
        }
        let list = match std::env::join_paths(&entries) {
            Ok(l) => l,
            // Cannot happen for entries split from one list; refuse them all.
            Err(e) => {
                for entry in entries {
                    let err = Error::invalid_config(
                        "ACCEL_PLUGIN_PATH",
                        path_list,
                        format!("cannot rebuild the list: {e}"),
                    );
                    self.fail_plugin(entry, err);
                }
                return;
            }
        };
        for report in accel_plugin::load_plugin_paths(list) {
            match report.outcome {
                accel_plugin::PluginOutcome::Loaded { name, backend, .. } => {
                    match self.register(backend, Origin::Plugin(report.path.clone())) {
                        Ok(()) => {
                            tracing::info!(plugin = %report.path.display(), backend = %name, "plugin loaded")
                        }
                        Err(e) => self.fail_plugin(report.path, e),
                    }
                }
                accel_plugin::PluginOutcome::Failed(e) => self.fail_plugin(report.path, e),
            }
        }
    }

    fn fail_plugin(&mut self, path: PathBuf, e: Error) {
        crate::notice::warn(None, &format!("plugin {} skipped: {e}", path.display()));
        self.plugin_failures.push(PluginFailure {
            path,
            reason: e.to_string(),
        });
    }

    /// Add a backend.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] when a backend of the same name is
    /// already registered (the first one stays).
    pub fn register(&mut self, backend: Arc<dyn Backend>, origin: Origin) -> Result<()> {
        let name = backend.name().to_string();
        if let Some(prev) = self.get(&name) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "a backend named `{name}` is already registered ({:?})",
                    prev.origin
                ),
            )
            .with_fix("give the plugin's backend a distinct name"));
        }
        self.entries.push(Entry { backend, origin });
        self.entries.sort_by(|a, b| {
            b.backend
                .priority()
                .cmp(&a.backend.priority())
                .then_with(|| a.backend.name().cmp(b.backend.name()))
        });
        Ok(())
    }

    /// Registered backends, highest priority first.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Names of registered backends, highest priority first.
    pub fn names(&self) -> Vec<String> {
        self.entries
            .iter()
            .map(|e| e.backend.name().to_string())
            .collect()
    }

    /// The backend called `name`.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.backend.name() == name)
    }

    /// Plugins that failed to load.
    pub fn plugin_failures(&self) -> &[PluginFailure] {
        &self.plugin_failures
    }

    /// Probe every registered backend (highest priority first) and list the
    /// known backends that are not compiled in. Every outcome is logged.
    pub fn probe_all(&self, ctx: &ProbeContext) -> Vec<ProbeRow> {
        let mut rows: Vec<ProbeRow> = self
            .entries
            .iter()
            .map(|e| {
                let probe = guarded_probe(e.backend.as_ref(), ctx);
                log_probe(e.backend.name(), &probe);
                ProbeRow {
                    name: e.backend.name().to_string(),
                    priority: Some(e.backend.priority()),
                    compiled_in: true,
                    origin: Some(e.origin.clone()),
                    probe: Some(probe),
                    feature: KNOWN_BACKENDS
                        .iter()
                        .find(|k| k.0 == e.backend.name())
                        .map(|k| k.1.to_string()),
                }
            })
            .collect();
        for (name, feature) in KNOWN_BACKENDS {
            if self.get(name).is_none() {
                rows.push(ProbeRow {
                    name: name.to_string(),
                    priority: None,
                    compiled_in: false,
                    origin: None,
                    probe: None,
                    feature: Some(feature.to_string()),
                });
            }
        }
        rows
    }

    /// Choose the backend for a run shaped like `ctx`: the first available of
    /// `preferred` (ACCEL_BACKEND) in the order given, or else the available
    /// backend of highest priority.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] when `preferred` names a backend that is
    /// not registered (listing those that are); [`ErrorKind::Unavailable`]
    /// when none of the candidates is available, with every reason.
    pub fn select(
        &self,
        ctx: &ProbeContext,
        preferred: Option<&[String]>,
    ) -> Result<Arc<dyn Backend>> {
        self.select_probed(ctx, preferred).map(|(b, _)| b)
    }

    /// [`select`](Self::select), also returning the chosen backend's probe.
    fn select_probed(
        &self,
        ctx: &ProbeContext,
        preferred: Option<&[String]>,
    ) -> Result<(Arc<dyn Backend>, Probe)> {
        let candidates: Vec<&Entry> = match preferred {
            Some(names) => {
                let mut v = Vec::new();
                for n in names {
                    match self.get(n) {
                        Some(e) => v.push(e),
                        None => {
                            let compiled_out = KNOWN_BACKENDS.iter().find(|k| k.0 == n);
                            let fix = match compiled_out {
                                Some((_, feature)) => format!(
                                    "rebuild with `--features {feature}`, or choose one of: {}",
                                    self.names().join(", ")
                                ),
                                None => format!("choose one of: {}", self.names().join(", ")),
                            };
                            return Err(Error::invalid_config(
                                "ACCEL_BACKEND",
                                &names.join(","),
                                format!("backend `{n}` is not compiled in or loaded"),
                            )
                            .with_fix(fix));
                        }
                    }
                }
                v
            }
            // One process on the CPU: a CPU engine adds nothing over the
            // exact built-in `single` backend, so prefer it (ADR 0003).
            // Accelerator backends still win: they own the device.
            None if ctx.world_size == 1 && self.get(accel_backend_single::NAME).is_some() => self
                .entries
                .iter()
                .filter(|e| {
                    e.backend.device_kind() != accel_api::DeviceKind::Cpu
                        || e.backend.name() == accel_backend_single::NAME
                })
                .collect(),
            None => self.entries.iter().collect(),
        };
        let mut reasons = Vec::new();
        for e in candidates {
            let probe = guarded_probe(e.backend.as_ref(), ctx);
            log_probe(e.backend.name(), &probe);
            match &probe.availability {
                Availability::Available => {
                    tracing::info!(backend = e.backend.name(), "backend selected");
                    return Ok((e.backend.clone(), probe));
                }
                Availability::Unavailable { reason } => {
                    reasons.push(format!("{}: {reason}", e.backend.name()));
                }
            }
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "no backend is available for a run of {} process(es): {}",
                ctx.world_size,
                if reasons.is_empty() {
                    "none registered".to_string()
                } else {
                    reasons.join("; ")
                }
            ),
        )
        .with_fix("run `accel env` to see the probe table"))
    }
}

impl Registry {
    /// [`select`](Self::select) for the run described by `state` (its
    /// `ACCEL_BACKEND` preference), then bind this rank's device for the
    /// chosen backend ([`ProcessState::bind_device`](crate::ProcessState::bind_device)).
    ///
    /// # Errors
    /// As [`select`](Self::select) and [`ProcessState::bind_device`](crate::ProcessState::bind_device).
    pub fn select_for(
        &self,
        state: &crate::ProcessState,
    ) -> Result<(Arc<dyn Backend>, accel_api::Device)> {
        let ctx = state.probe_context();
        let (backend, probe) = self.select_probed(&ctx, state.backend.as_deref())?;
        let device = state.bind_device(backend.device_kind(), probe.device_count)?;
        Ok((backend, device))
    }
}

/// Probes must not panic; if one does anyway, report it as unavailable.
fn guarded_probe(b: &dyn Backend, ctx: &ProbeContext) -> Probe {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.probe(ctx))) {
        Ok(p) => p,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Probe::unavailable(format!("probe panicked: {msg}"))
        }
    }
}

fn log_probe(name: &str, p: &Probe) {
    match &p.availability {
        Availability::Available => tracing::debug!(
            backend = name,
            devices = p.device_count,
            version = p.engine_version.as_deref().unwrap_or("?"),
            "probe: available"
        ),
        Availability::Unavailable { reason } => {
            tracing::debug!(backend = name, "probe: unavailable ({reason})")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_api::{Communicator, ConnectContext, DeviceKind};

    struct Fake(&'static str, i32, bool);
    impl Backend for Fake {
        fn name(&self) -> &str {
            self.0
        }
        fn priority(&self) -> i32 {
            self.1
        }
        fn device_kind(&self) -> DeviceKind {
            DeviceKind::Cpu
        }
        fn probe(&self, _: &ProbeContext) -> Probe {
            if self.2 {
                Probe::available(1, None)
            } else {
                Probe::unavailable(format!("{} is switched off", self.0))
            }
        }
        fn connect(&self, _: ConnectContext) -> Result<Box<dyn Communicator>> {
            Err(Error::new(ErrorKind::Unavailable, "fake"))
        }
    }

    struct Panicky;
    impl Backend for Panicky {
        fn name(&self) -> &str {
            "panicky"
        }
        fn priority(&self) -> i32 {
            1000
        }
        fn device_kind(&self) -> DeviceKind {
            DeviceKind::Cpu
        }
        fn probe(&self, _: &ProbeContext) -> Probe {
            panic!("boom in probe")
        }
        fn connect(&self, _: ConnectContext) -> Result<Box<dyn Communicator>> {
            unreachable!()
        }
    }

    fn reg() -> Registry {
        let mut r = Registry::empty();
        r.register(Arc::new(Fake("low", 1, true)), Origin::Builtin)
            .unwrap();
        r.register(Arc::new(Fake("high", 9, false)), Origin::Builtin)
            .unwrap();
        r.register(Arc::new(Fake("mid", 5, true)), Origin::Builtin)
            .unwrap();
        r
    }

    #[test]
    fn selects_highest_available_priority() {
        let r = reg();
        assert_eq!(r.names(), vec!["high", "mid", "low"]);
        let ctx = ProbeContext::single_process();
        assert_eq!(r.select(&ctx, None).unwrap().name(), "mid");
    }

    #[test]
    fn override_order_is_respected_and_errors_are_clear() {
        let r = reg();
        let ctx = ProbeContext::single_process();
        let pick = |v: &[&str]| {
            r.select(
                &ctx,
                Some(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>()),
            )
        };
        assert_eq!(pick(&["low", "mid"]).unwrap().name(), "low");
        assert_eq!(pick(&["high", "mid"]).unwrap().name(), "mid");
        let e = pick(&["high"]).unwrap_err();
        assert!(e.to_string().contains("high is switched off"), "{e}");
        let e = pick(&["nope"]).unwrap_err();
        assert!(
            e.to_string().contains("ACCEL_BACKEND") && e.to_string().contains("nope"),
            "{e}"
        );
        let e = pick(&["mpi"]).unwrap_err();
        assert!(e.to_string().contains("--features mpi"), "{e}");
    }

    #[test]
    fn one_cpu_process_prefers_single() {
        let mut r = reg();
        r.register(Arc::new(Fake("single", 0, true)), Origin::Builtin)
            .unwrap();
        let one = ProbeContext::single_process();
        assert_eq!(r.select(&one, None).unwrap().name(), "single");
        let two = ProbeContext {
            world_size: 2,
            local_world_size: 2,
            mpi_launched: false,
            ranks_in_process: 1,
        };
        assert_eq!(r.select(&two, None).unwrap().name(), "mid");
        let forced = ["low".to_string()];
        assert_eq!(r.select(&one, Some(&forced)).unwrap().name(), "low");
    }

    #[test]
    fn duplicate_names_are_refused() {
        let mut r = reg();
        let e = r
            .register(
                Arc::new(Fake("mid", 3, true)),
                Origin::Plugin("/x.so".into()),
            )
            .unwrap_err();
        assert!(e.to_string().contains("`mid`"), "{e}");
    }

    #[test]
    fn panicking_probe_is_unavailable_not_fatal() {
        let mut r = reg();
        r.register(Arc::new(Panicky), Origin::Builtin).unwrap();
        let rows = r.probe_all(&ProbeContext::single_process());
        let row = rows.iter().find(|r| r.name == "panicky").unwrap();
        assert!(row
            .probe
            .as_ref()
            .unwrap()
            .reason()
            .unwrap()
            .contains("boom in probe"));
        assert_eq!(
            r.select(&ProbeContext::single_process(), None)
                .unwrap()
                .name(),
            "mid"
        );
    }

    #[test]
    fn builtin_registry_holds_exactly_the_enabled_features() {
        let mut expected = vec!["single".to_string()];
        if cfg!(feature = "cpu-gloo") {
            expected.push("cpu-gloo".to_string());
        }
        if cfg!(feature = "mpi") {
            expected.push("mpi".to_string());
        }
        if cfg!(feature = "npu-hccl") {
            expected.push("npu-hccl".to_string());
        }
        if cfg!(feature = "xla") {
            expected.push("xla".to_string());
        }
        if cfg!(feature = "cuda-nccl") {
            expected.push("cuda-nccl".to_string());
        }
        expected.sort();
        let mut got = Registry::builtin().names();
        got.sort();
        assert_eq!(got, expected);
    }

    #[test]
    fn relative_plugin_entries_are_joined_to_the_current_directory() {
        let cwd = PathBuf::from("/work/here");
        let (entries, unresolved) = absolute_entries(
            OsStr::new("libz.so:/opt/p.so:sub/dir::./x.so"),
            Ok(cwd.clone()),
        );
        assert!(unresolved.is_empty());
        assert_eq!(
            entries,
            vec![
                cwd.join("libz.so"),
                PathBuf::from("/opt/p.so"),
                cwd.join("sub/dir"),
                PathBuf::new(),
                cwd.join("./x.so"),
            ]
        );
    }

    #[test]
    fn relative_plugin_entries_without_a_current_directory_are_refused_by_name() {
        let gone = std::io::Error::new(std::io::ErrorKind::NotFound, "deleted");
        let (entries, unresolved) = absolute_entries(OsStr::new("libz.so:/opt/p.so"), Err(gone));
        assert_eq!(entries, vec![PathBuf::from("/opt/p.so")]);
        assert_eq!(unresolved.len(), 1);
        let (entry, e) = &unresolved[0];
        assert_eq!(entry, &PathBuf::from("libz.so"));
        let m = e.to_string();
        assert!(m.contains("libz.so") && m.contains("relative"), "{m}");
        assert!(m.contains("absolute path"), "{m}");
    }
}
