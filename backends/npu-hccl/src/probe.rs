//! The probe: find and load AscendCL and HCCL, resolve every symbol the
//! backend uses, `aclInit`, count the visible NPUs. Every failure is a
//! reason naming the library, symbol or call; nothing here panics.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use accel_api::{Probe, ProbeContext};

use crate::error::HcclError;
use crate::ffi::{self, Runtime};

/// AscendCL's file name.
pub const ACL_LIBRARY: &str = "libascendcl.so";
/// HCCL's file name.
pub const HCCL_LIBRARY: &str = "libhccl.so";
/// Where CANN installs by default (toolkit layout, then CANN >= 8.5).
const DEFAULT_DIRS: [&str; 2] = [
    "/usr/local/Ascend/ascend-toolkit/latest/lib64",
    "/usr/local/Ascend/cann/lib64",
];

/// Where to look for the two libraries, in order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Search {
    dirs: Vec<PathBuf>,
    /// After the folders, let the dynamic loader search (LD_LIBRARY_PATH,
    /// the ld.so cache): what CANN's `set_env.sh` sets up.
    loader: bool,
}

impl Search {
    /// Only `dir` (tests, `NpuHcclBackend::with_lib_dir`).
    pub(crate) fn only(dir: &Path) -> Search {
        Search {
            dirs: vec![dir.to_path_buf()],
            loader: false,
        }
    }

    /// `ACCEL_ASCEND_LIB_DIR` alone when set; otherwise
    /// `$ASCEND_TOOLKIT_HOME/lib64`, `$ASCEND_HOME_PATH/lib64`, the default
    /// install folders, then the loader's search path.
    pub(crate) fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Search {
        if let Some(d) = env("ACCEL_ASCEND_LIB_DIR").filter(|d| !d.is_empty()) {
            return Search::only(Path::new(&d));
        }
        let mut dirs = Vec::new();
        for var in ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"] {
            if let Some(home) = env(var).filter(|d| !d.is_empty()) {
                dirs.push(Path::new(&home).join("lib64"));
            }
        }
        dirs.extend(DEFAULT_DIRS.iter().map(PathBuf::from));
        dirs.dedup();
        Search { dirs, loader: true }
    }

    fn describe(&self) -> String {
        let mut places: Vec<String> = self.dirs.iter().map(|d| d.display().to_string()).collect();
        if self.loader {
            places.push("the dynamic loader's path (LD_LIBRARY_PATH)".into());
        }
        places.join(", ")
    }

    /// Open `name` from the first folder holding it, else through the
    /// loader's search.
    fn open(&self, name: &str, global: bool) -> Result<(libloading::Library, PathBuf), HcclError> {
        for dir in &self.dirs {
            let path = dir.join(name);
            if path.exists() {
                return ffi::open_library(&path, global)
                    .map(|l| (l, path.clone()))
                    .map_err(|e| HcclError::Load {
                        library: path.display().to_string(),
                        detail: format!("exists but failed to load: {e}"),
                    });
            }
        }
        if self.loader {
            if let Ok(l) = ffi::open_library(Path::new(name), global) {
                return Ok((l, PathBuf::from(name)));
            }
        }
        Err(HcclError::Load {
            library: name.to_string(),
            detail: format!("not found (looked in {})", self.describe()),
        })
    }
}

type Cache = Mutex<HashMap<Search, Result<Arc<Runtime>, HcclError>>>;

/// The loaded and initialised runtime for `search`, loaded once per process
/// (libraries are never unloaded; a failure is remembered too).
pub(crate) fn runtime(search: &Search) -> Result<Arc<Runtime>, HcclError> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    cache
        .entry(search.clone())
        .or_insert_with(|| load(search))
        .clone()
}

fn load(search: &Search) -> Result<Arc<Runtime>, HcclError> {
    // AscendCL first and global: HCCL binds runtime symbols against it.
    let (acl, acl_path) = search.open(ACL_LIBRARY, true)?;
    let (hccl, hccl_path) = search.open(HCCL_LIBRARY, false)?;
    let rt = Runtime::new(acl, acl_path, hccl, hccl_path)?;
    rt.init()?;
    Ok(Arc::new(rt))
}

/// NPUs this process may use: AscendCL's count, cut down to the length of
/// `ASCEND_RT_VISIBLE_DEVICES` when set (AscendCL applies the mask itself;
/// the cut keeps the count honest if it did not).
///
/// # Errors
/// A reason naming the variable when it is malformed.
pub(crate) fn visible(count: u32, mask: Option<&str>) -> Result<usize, String> {
    let count = count as usize;
    let Some(mask) = mask else {
        return Ok(count);
    };
    let mask = mask.trim();
    if mask.is_empty() {
        return Ok(0);
    }
    let mut ids: Vec<u32> = Vec::new();
    for part in mask.split(',') {
        let id = part.trim().parse::<u32>().map_err(|_| {
            format!(
                "ASCEND_RT_VISIBLE_DEVICES={mask:?}: `{}` is not a device id (use a comma-separated list such as 0,1,2,3)",
                part.trim()
            )
        })?;
        if ids.contains(&id) {
            return Err(format!(
                "ASCEND_RT_VISIBLE_DEVICES={mask:?}: device {id} is listed twice"
            ));
        }
        ids.push(id);
    }
    Ok(count.min(ids.len()))
}

/// The probe of the backend searching `search`, for a run shaped like
/// `ctx`, reading the mask through `env`.
pub(crate) fn probe(
    search: &Search,
    ctx: &ProbeContext,
    env: &dyn Fn(&str) -> Option<String>,
) -> Probe {
    match devices(search, env) {
        Err(reason) => Probe::unavailable(reason),
        Ok((n, _)) if ctx.local_world_size > n => Probe::unavailable(format!(
            "this run puts {} ranks on this machine but {n} NPU(s) are visible: HCCL needs one NPU per rank",
            ctx.local_world_size
        )),
        Ok((n, version)) => Probe::available(n, Some(version)),
    }
}

/// The visible NPU count and the engine version, or why there is none.
pub(crate) fn devices(
    search: &Search,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(usize, String), String> {
    let rt = runtime(search).map_err(|e| e.reason())?;
    let count = rt.device_count().map_err(|e| e.reason())?;
    let mask = env("ASCEND_RT_VISIBLE_DEVICES");
    let n = visible(count, mask.as_deref())?;
    if n == 0 {
        let detail = match &mask {
            Some(m) => {
                format!("aclrtGetDeviceCount reports {count}, ASCEND_RT_VISIBLE_DEVICES={m:?}")
            }
            None => format!("aclrtGetDeviceCount reports {count}"),
        };
        return Err(HcclError::NoDevice { detail }.reason());
    }
    let version = match rt.version() {
        Some(v) => format!("AscendCL {v} ({})", rt.acl_path().display()),
        None => format!("AscendCL ({})", rt.acl_path().display()),
    };
    tracing::debug!(acl = %rt.acl_path().display(), hccl = %rt.hccl_path().display(), n, "npu-hccl probe");
    Ok((n, version))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_cuts_and_names_itself() {
        assert_eq!(visible(8, None), Ok(8));
        assert_eq!(visible(8, Some("0,1")), Ok(2));
        assert_eq!(visible(2, Some("0,1,2,3")), Ok(2));
        assert_eq!(visible(8, Some(" ")), Ok(0));
        let e = visible(8, Some("0,x")).unwrap_err();
        assert!(
            e.contains("ASCEND_RT_VISIBLE_DEVICES") && e.contains("`x`"),
            "{e}"
        );
        assert!(visible(8, Some("1,1")).unwrap_err().contains("twice"));
    }

    #[test]
    fn search_order_follows_the_environment() {
        let env = |k: &str| match k {
            "ASCEND_TOOLKIT_HOME" => Some("/opt/cann".to_string()),
            _ => None,
        };
        let s = Search::from_env(&env);
        assert_eq!(s.dirs[0], PathBuf::from("/opt/cann/lib64"));
        assert_eq!(s.dirs[1], PathBuf::from(DEFAULT_DIRS[0]));
        assert!(s.loader);
        let env = |k: &str| (k == "ACCEL_ASCEND_LIB_DIR").then(|| "/x".to_string());
        assert_eq!(Search::from_env(&env), Search::only(Path::new("/x")));
    }

    #[test]
    fn a_missing_library_is_a_reason_naming_it() {
        let dir = std::env::temp_dir().join("accel-npu-hccl-no-such-dir");
        let e = runtime(&Search::only(&dir)).unwrap_err().reason();
        assert!(e.starts_with("libascendcl.so not found"), "{e}");
        assert!(e.contains(&dir.display().to_string()), "{e}");
    }
}
