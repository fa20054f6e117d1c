//! The process-wide PJRT state: where the plugin is, the loaded plugin and
//! its client (one per plugin file per process, never unloaded), and the
//! cache of compiled programs.
//!
//! ## Where the plugin is looked for (first match wins)
//!
//! 1. `ACCEL_PJRT_PLUGIN`: the plugin file itself (when set, nothing else
//!    is tried: a wrong path is reported, not papered over);
//! 2. `$ACCEL_PJRT_CACHE/pjrt_c_api_cpu_plugin.so`;
//! 3. `.accel-cache/pjrt/pjrt_c_api_cpu_plugin.so` in the current directory
//!    or one of its ancestors (where `make pjrt-setup` puts it);
//! 4. the same below an ancestor of the running executable (a binary in
//!    `target/` finds the checkout's cache from any directory).
//!
//! The client is created with `cpu_device_count` from
//! `ACCEL_PJRT_CPU_DEVICES` (default [`DEFAULT_CPU_DEVICES`]): the most
//! ranks one process can run.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use accel_api::DType;

use crate::error::XlaError;
use crate::ffi::{Client, Executable, Plugin};
use crate::programs::{element, Program};
use accel_api::sync::lock;

/// The file name `scripts/fetch_pjrt_plugin.sh` installs.
pub const PLUGIN_FILE: &str = "pjrt_c_api_cpu_plugin.so";

/// CPU devices the client is created with unless `ACCEL_PJRT_CPU_DEVICES`
/// says otherwise.
pub const DEFAULT_CPU_DEVICES: usize = 8;

/// Where the plugin is, by the search order of the module docs.
///
/// # Errors
/// [`XlaError::NotFound`] naming what was tried.
pub(crate) fn find_plugin(env: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf, XlaError> {
    if let Some(p) = env("ACCEL_PJRT_PLUGIN").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(&p);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(XlaError::NotFound(format!(
                "ACCEL_PJRT_PLUGIN={p}: no such file"
            )))
        };
    }
    let mut tried = Vec::new();
    if let Some(c) = env("ACCEL_PJRT_CACHE").filter(|c| !c.is_empty()) {
        let path = Path::new(&c).join(PLUGIN_FILE);
        if path.is_file() {
            return Ok(path);
        }
        tried.push(path);
    }
    let roots = [
        std::env::current_dir().ok(),
        std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf)),
    ];
    for root in roots.into_iter().flatten() {
        for dir in root.ancestors() {
            let path = dir.join(".accel-cache/pjrt").join(PLUGIN_FILE);
            if path.is_file() {
                return Ok(path);
            }
        }
        tried.push(
            root.join("(and ancestors)/.accel-cache/pjrt")
                .join(PLUGIN_FILE),
        );
    }
    Err(XlaError::NotFound(format!(
        "no PJRT plugin: ACCEL_PJRT_PLUGIN is not set and {PLUGIN_FILE} is not in {}",
        tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// The plugin logs through absl to stderr on every load (absl's "All log
/// messages before absl::InitializeLog() ..." warning and INFO lines such
/// as "cpu_device_count set via create_options"). Unless the user set
/// `TF_CPP_MIN_LOG_LEVEL` or accel's own logs are at info or finer
/// (`accel --log info`, a `RUST_LOG` subscriber), keep its INFO lines out:
/// warnings and errors still show. Before the plugin is loaded (it reads
/// the variable at its first log).
fn quiet_plugin_logs() {
    const VAR: &str = "TF_CPP_MIN_LOG_LEVEL";
    if std::env::var_os(VAR).is_none() && !tracing::enabled!(tracing::Level::INFO) {
        std::env::set_var(VAR, "1");
    }
}

/// The CPU device count to create clients with.
fn cpu_devices(env: &dyn Fn(&str) -> Option<String>) -> usize {
    env("ACCEL_PJRT_CPU_DEVICES")
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| (1..128).contains(&n))
        .unwrap_or(DEFAULT_CPU_DEVICES)
}

/// One plugin's loaded state.
pub(crate) struct Runtime {
    pub(crate) path: PathBuf,
    plugin: Plugin,
    client: Client,
    pub(crate) platform: String,
    pub(crate) platform_version: String,
    /// `xla_version` and `stablehlo_current_version` when the plugin says.
    pub(crate) attributes: Vec<(String, Vec<i64>)>,
    programs: Mutex<HashMap<(String, usize), Arc<Executable>>>,
    /// One execution at a time in this process: executions of different
    /// groups share the same devices, and each runs over all its replicas
    /// at once anyway.
    executing: Mutex<()>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("path", &self.path)
            .field("plugin", &self.plugin)
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

type Loaded = HashMap<PathBuf, Result<Arc<Runtime>, XlaError>>;

fn loaded() -> &'static Mutex<Loaded> {
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    LOADED.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Runtime {
    /// The runtime of the plugin the environment points at, loading it
    /// (once per process and file; a failure is remembered too).
    ///
    /// # Errors
    /// Why the plugin cannot be found, loaded, initialised or give a
    /// client.
    pub(crate) fn get() -> Result<Arc<Runtime>, XlaError> {
        let env = |k: &str| std::env::var(k).ok();
        let path = find_plugin(&env)?;
        let mut map = lock(loaded());
        map.entry(path.clone())
            .or_insert_with(|| Runtime::load(path, cpu_devices(&env)).map(Arc::new))
            .clone()
    }

    fn load(path: PathBuf, devices: usize) -> Result<Runtime, XlaError> {
        quiet_plugin_logs();
        let plugin = Plugin::load(&path)?;
        let client = Client::create(plugin, i64::try_from(devices).unwrap_or(8))?;
        tracing::debug!(path = %path.display(), devices = client.device_count(), "PJRT client created");
        Ok(Runtime {
            platform: client.platform_name(),
            platform_version: client.platform_version(),
            attributes: plugin
                .int_attributes()
                .into_iter()
                .filter(|(k, _)| k == "xla_version" || k == "stablehlo_current_version")
                .collect(),
            path,
            plugin,
            client,
            programs: Mutex::new(HashMap::new()),
            executing: Mutex::new(()),
        })
    }

    /// The plugin's PJRT API version.
    pub(crate) fn api_version(&self) -> (i32, i32) {
        self.plugin.version()
    }

    /// Devices the client addresses (the most ranks of one group).
    pub(crate) fn device_count(&self) -> usize {
        self.client.device_count()
    }

    /// One line for `accel env`: plugin, API, platform and devices.
    pub(crate) fn describe(&self) -> String {
        let (major, minor) = self.api_version();
        let mut s = format!("PJRT API {major}.{minor}, platform {}", self.platform);
        if !self.platform_version.is_empty() && self.platform_version != self.platform {
            s.push_str(&format!(" {}", self.platform_version));
        }
        for (k, v) in &self.attributes {
            let v: Vec<String> = v.iter().map(i64::to_string).collect();
            s.push_str(&format!(", {k} {}", v.join(".")));
        }
        s.push_str(&format!(
            ", {} devices, plugin {}",
            self.device_count(),
            self.path.display()
        ));
        s
    }

    /// Number of programs compiled so far (for tests of the cache).
    pub(crate) fn programs_compiled(&self) -> usize {
        lock(&self.programs).len()
    }

    /// Run `program` over `bufs` (one input per rank of a group of
    /// `bufs.len()`), compiling it on first use; each rank's output
    /// replaces its input in `bufs`.
    ///
    /// # Errors
    /// Compilation or execution failures from the plugin.
    pub(crate) fn run(
        &self,
        program: Program,
        dtype: DType,
        len: usize,
        bufs: &mut [Vec<u8>],
    ) -> Result<(), XlaError> {
        let n = bufs.len();
        let module = program.module(dtype, n, len)?;
        let (_, kind) = element(dtype)?;
        let exe = {
            let mut cache = lock(&self.programs);
            let key = (module.text.clone(), n);
            match cache.get(&key) {
                Some(e) => e.clone(),
                None => {
                    tracing::debug!(?program, %dtype, n, len, "compiling");
                    let e = Arc::new(self.client.compile(&module.text, n)?);
                    cache.insert(key, e.clone());
                    e
                }
            }
        };
        let _one = lock(&self.executing);
        exe.run(
            &self.client,
            bufs,
            kind,
            dtype.size(),
            module.in_len,
            module.out_len,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_order_starts_with_the_variable() {
        let env = |k: &str| (k == "ACCEL_PJRT_PLUGIN").then(|| "/no/such/plugin.so".to_string());
        let e = find_plugin(&env).unwrap_err();
        assert!(
            e.to_string()
                .contains("ACCEL_PJRT_PLUGIN=/no/such/plugin.so"),
            "{e}"
        );
        let dir = std::env::temp_dir().join(format!("accel-xla-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(PLUGIN_FILE), b"x").unwrap();
        let d = dir.display().to_string();
        let env = |k: &str| (k == "ACCEL_PJRT_CACHE").then(|| d.clone());
        assert_eq!(find_plugin(&env).unwrap(), dir.join(PLUGIN_FILE));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn device_count_parses_or_defaults() {
        let env =
            |v: &'static str| move |k: &str| (k == "ACCEL_PJRT_CPU_DEVICES").then(|| v.to_string());
        assert_eq!(cpu_devices(&env("4")), 4);
        assert_eq!(cpu_devices(&env("zero")), DEFAULT_CPU_DEVICES);
        assert_eq!(cpu_devices(&env("0")), DEFAULT_CPU_DEVICES);
    }
}
