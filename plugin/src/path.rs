//! `ACCEL_PLUGIN_PATH`: finding plugin files and loading each of them, with a
//! report per file. No `unsafe` here.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use accel_api::{Backend, Error, ErrorKind};

use crate::load::PluginBackend;

/// The environment variable listing plugins: files or directories,
/// separated like `PATH` (`:` on Unix, `;` on Windows).
pub const PLUGIN_PATH_ENV: &str = "ACCEL_PLUGIN_PATH";

/// What happened to one plugin file.
#[derive(Debug)]
pub struct PluginReport {
    /// The file (or, when a directory could not be listed, the directory).
    pub path: PathBuf,
    /// Loaded, or why not.
    pub outcome: PluginOutcome,
}

/// The outcome of loading one plugin file.
pub enum PluginOutcome {
    /// The plugin loaded; its backend is ready to register.
    Loaded {
        /// The backend's registered name.
        name: String,
        /// The plugin's own version (its crate version).
        version: String,
        /// The backend.
        backend: Arc<PluginBackend>,
    },
    /// The plugin was skipped; the error ([`ErrorKind::Plugin`]) names the
    /// path and says why and what to do.
    Failed(Error),
}

impl fmt::Debug for PluginOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginOutcome::Loaded { name, version, .. } => f
                .debug_struct("Loaded")
                .field("name", name)
                .field("version", version)
                .finish_non_exhaustive(),
            PluginOutcome::Failed(e) => f.debug_tuple("Failed").field(e).finish(),
        }
    }
}

impl PluginReport {
    /// The backend, when the plugin loaded.
    pub fn backend(&self) -> Option<Arc<dyn Backend>> {
        match &self.outcome {
            PluginOutcome::Loaded { backend, .. } => Some(backend.clone() as Arc<dyn Backend>),
            PluginOutcome::Failed(_) => None,
        }
    }

    /// The error, when the plugin was skipped.
    pub fn error(&self) -> Option<&Error> {
        match &self.outcome {
            PluginOutcome::Loaded { .. } => None,
            PluginOutcome::Failed(e) => Some(e),
        }
    }
}

impl fmt::Display for PluginReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            PluginOutcome::Loaded { name, version, .. } => write!(
                f,
                "loaded plugin backend `{name}` {version} from {}",
                self.path.display()
            ),
            PluginOutcome::Failed(e) => write!(f, "skipped {}: {e}", self.path.display()),
        }
    }
}

/// Load every plugin named by [`PLUGIN_PATH_ENV`]; see [`load_plugin_paths`].
/// An unset or empty variable loads nothing.
pub fn load_plugins_from_env() -> Vec<PluginReport> {
    match std::env::var_os(PLUGIN_PATH_ENV) {
        Some(v) => load_plugin_paths(v),
        None => Vec::new(),
    }
}

/// Load every plugin named by `list`, an `ACCEL_PLUGIN_PATH`-style list of
/// files and directories separated like `PATH`.
///
/// A directory contributes every file in it whose extension is the
/// platform's shared-object extension (`.so` on Linux), sorted by name; it is
/// not searched recursively. Such a file that is not a regular file (a
/// FIFO, a device) or is a symlink resolving outside the directory is a
/// failed report naming it. Empty entries are ignored, and a file reached
/// twice is loaded once. The result has one report per file, in order; a
/// missing or broken plugin is a [`PluginOutcome::Failed`] report, never a
/// panic, and the other plugins load regardless.
pub fn load_plugin_paths(list: impl AsRef<OsStr>) -> Vec<PluginReport> {
    let mut seen = HashSet::new();
    let mut reports = Vec::new();
    for entry in std::env::split_paths(list.as_ref()) {
        if entry.as_os_str().is_empty() {
            continue;
        }
        let files = if entry.is_dir() {
            match plugin_files_in(&entry) {
                Ok(files) => files,
                Err(e) => {
                    reports.push(PluginReport {
                        path: entry,
                        outcome: PluginOutcome::Failed(e),
                    });
                    continue;
                }
            }
        } else {
            vec![Ok(entry)]
        };
        for file in files {
            let path = match file {
                Ok(p) => p,
                Err((path, e)) => {
                    seen.insert(std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone()));
                    reports.push(PluginReport {
                        path,
                        outcome: PluginOutcome::Failed(e),
                    });
                    continue;
                }
            };
            let key = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
            if !seen.insert(key) {
                continue;
            }
            let outcome = match PluginBackend::load(&path) {
                Ok(b) => PluginOutcome::Loaded {
                    name: b.name().to_string(),
                    version: b.plugin_version().to_string(),
                    backend: b,
                },
                Err(e) => PluginOutcome::Failed(e),
            };
            reports.push(PluginReport { path, outcome });
        }
    }
    reports
}

/// A file of a plugin directory, or why it is refused.
type Listed = Result<PathBuf, (PathBuf, Error)>;

/// The shared objects directly inside `dir`, sorted: regular files that stay
/// inside `dir` (a symlink out of it, a FIFO or a device is a failed entry
/// naming it).
fn plugin_files_in(dir: &Path) -> Result<Vec<Listed>, Error> {
    let list_error = |e: std::io::Error| {
        Error::new(
            ErrorKind::Plugin {
                path: dir.to_path_buf(),
                symbol: None,
            },
            format!("cannot list the plugin directory: {e}"),
        )
        .with_op("load plugin")
        .with_fix("check the directory's permissions, or take it off ACCEL_PLUGIN_PATH")
    };
    let mut files = Vec::new();
    for item in std::fs::read_dir(dir).map_err(list_error)? {
        let path = item.map_err(list_error)?.path();
        let is_lib = path.extension() == Some(OsStr::new(std::env::consts::DLL_EXTENSION));
        // Directories (even named `x.so`) are not searched, as documented.
        if !is_lib || path.is_dir() {
            continue;
        }
        let name = path.file_name().and_then(OsStr::to_str).unwrap_or("");
        files.push(
            accel_api::files::resolve_inside(dir, name, "file").map_err(|e| {
                let err = Error::new(
                    ErrorKind::Plugin {
                        path: path.clone(),
                        symbol: None,
                    },
                    e.message().to_string(),
                )
                .with_op("load plugin")
                .with_fix("put the plugin's own .so file in the directory, or take it off ACCEL_PLUGIN_PATH");
                (path.clone(), err)
            }),
        );
    }
    files.sort_by(|a, b| {
        let key = |x: &Listed| match x {
            Ok(p) | Err((p, _)) => p.clone(),
        };
        key(a).cmp(&key(b))
    });
    Ok(files)
}
