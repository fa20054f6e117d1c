//! The probe, and the `libnccl.so` name fix-up.
//!
//! The probe never panics: it asks whether cudarc can `dlopen` each library
//! and whether the symbols it calls exist before calling anything, then
//! runs `cuInit`, the device count and the versions inside `catch_unwind`
//! as a second line of defence.
//!
//! cudarc opens NCCL as `libnccl.so` (never `libnccl.so.2`). The NCCL
//! wheels on PyPI (`nvidia-nccl-cu12`, `nvidia-nccl-cu13`, what PyTorch
//! installs) ship only `libnccl.so.2`, and `dlopen` reads
//! `LD_LIBRARY_PATH` once, at process start. So the fix is a directory
//! holding a `libnccl.so -> .../libnccl.so.2` link, put on `LD_LIBRARY_PATH`
//! before the process starts: [`prepare_link_dir`] makes it, the probe's
//! reason prints the command, and `scripts/nccl_libdir.sh` does the same
//! from a shell.

use std::path::{Path, PathBuf};

use accel_api::{Probe, ProbeContext};

use crate::ffi::{self, Lib};

/// What the probe found, for `accel env` and error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeReport {
    /// Visible CUDA devices (after `CUDA_VISIBLE_DEVICES`).
    pub devices: usize,
    /// The driver's CUDA version, `13.0`.
    pub driver: Option<String>,
    /// NCCL's version, `2.28.3`.
    pub nccl: Option<String>,
    /// `CUDA_VISIBLE_DEVICES`, when set.
    pub visible: Option<String>,
    /// Why the backend cannot run here (`None`: it can).
    pub unavailable: Option<String>,
}

impl ProbeReport {
    /// The engine version column of `accel env`:
    /// `NCCL 2.28.3, CUDA driver 13.0, CUDA_VISIBLE_DEVICES=0,1`.
    pub fn version_line(&self) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(n) = &self.nccl {
            parts.push(format!("NCCL {n}"));
        }
        if let Some(d) = &self.driver {
            parts.push(format!("CUDA driver {d}"));
        }
        if let Some(v) = &self.visible {
            parts.push(format!("CUDA_VISIBLE_DEVICES={v}"));
        }
        (!parts.is_empty()).then(|| parts.join(", "))
    }

    /// As an accel [`Probe`].
    pub fn to_probe(&self) -> Probe {
        match &self.unavailable {
            None => Probe::available(self.devices, self.version_line()),
            Some(why) => {
                let mut p = Probe::unavailable(why.clone());
                p.device_count = self.devices;
                p.engine_version = self.version_line();
                p
            }
        }
    }
}

/// `13000` -> `13.0`; `12080` -> `12.8`.
pub(crate) fn cuda_version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// `22803` -> `2.28.3` (NCCL >= 2.9 encodes `major*10000 + minor*100 + patch`).
pub(crate) fn nccl_version_text(v: i32) -> String {
    if v >= 10000 {
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100)
    }
}

/// Look at the machine. Never panics.
pub fn inspect() -> ProbeReport {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let mut r = ProbeReport {
        devices: 0,
        driver: None,
        nccl: None,
        visible,
        unavailable: None,
    };
    match std::panic::catch_unwind(|| inspect_into(&mut r.clone())) {
        Ok(done) => done,
        Err(_) => {
            r.unavailable = Some(
                "the CUDA or NCCL library panicked while being probed (a symbol cudarc expects is missing?)".into(),
            );
            r
        }
    }
}

fn inspect_into(r: &mut ProbeReport) -> ProbeReport {
    if !ffi::library_present(Lib::Driver) {
        r.unavailable = Some(
            "the NVIDIA driver library (libcuda.so) was not found: no NVIDIA driver on this machine, or it is not on the loader path".into(),
        );
        return r.clone();
    }
    r.unavailable = lacking(
        Lib::Driver,
        ffi::DRIVER_PROBE_SYMBOLS,
        "the NVIDIA driver is too old or not the real one",
    );
    if r.unavailable.is_some() {
        return r.clone();
    }
    match ffi::driver_init_and_count() {
        Err(code) => {
            r.unavailable = Some(match format!("{code:?}").as_str() {
                "CUDA_ERROR_NO_DEVICE" => format!(
                    "no CUDA device visible (cuInit: CUDA_ERROR_NO_DEVICE){}",
                    r.visible
                        .as_deref()
                        .map(|v| format!(
                            "; CUDA_VISIBLE_DEVICES={v:?} limits which devices are seen"
                        ))
                        .unwrap_or_default()
                ),
                other => format!("the CUDA driver failed to start (cuInit: {other})"),
            });
            return r.clone();
        }
        Ok(0) => {
            r.unavailable = Some("the CUDA driver sees no device".into());
            return r.clone();
        }
        Ok(n) => r.devices = n,
    }
    r.driver = ffi::driver_version().map(cuda_version_text);
    if !ffi::library_present(Lib::Nccl) {
        r.unavailable = Some(nccl_missing_reason(&candidate_dirs()));
        return r.clone();
    }
    r.unavailable = lacking(Lib::Nccl, ffi::NCCL_SYMBOLS, "NCCL 2.18 or newer is needed");
    if r.unavailable.is_some() {
        return r.clone();
    }
    r.nccl = ffi::nccl_version().map(nccl_version_text);
    r.unavailable = lacking(
        Lib::Driver,
        ffi::DRIVER_SYMBOLS,
        "the NVIDIA driver is too old",
    );
    r.clone()
}

/// "`libcuda.so` (or `libnccl.so`) lacks the symbols of `symbols` that
/// `lib` does not export: `why`", or `None` when it exports them all.
fn lacking(lib: Lib, symbols: &[&str], why: &str) -> Option<String> {
    let missing = ffi::missing_symbols(lib, symbols);
    let name = match lib {
        Lib::Driver => "libcuda.so",
        Lib::Nccl => "libnccl.so",
    };
    (!missing.is_empty()).then(|| format!("{name} lacks {}: {why}", missing.join(", ")))
}

/// The reason when `libnccl.so` cannot be opened, with the fix.
pub(crate) fn nccl_missing_reason(dirs: &[PathBuf]) -> String {
    match find_soname(dirs) {
        Some(lib) => format!(
            "NCCL is installed as {} but cudarc opens `libnccl.so`: start the program with LD_LIBRARY_PATH=\"$(scripts/nccl_libdir.sh)\" (a folder with a libnccl.so link to it; accel_backend_cuda_nccl::prepare_link_dir makes it)",
            lib.display()
        ),
        None => "libnccl.so was not found: install NCCL (`pip install nvidia-nccl-cu12` or `nvidia-nccl-cu13`, or the distribution's libnccl2), set ACCEL_NCCL_LIB to its libnccl.so.2, and put a folder with a libnccl.so link on LD_LIBRARY_PATH (scripts/nccl_libdir.sh)".into(),
    }
}

/// Folders that may hold `libnccl.so.2`: `ACCEL_NCCL_LIB` (the file or its
/// folder), `LD_LIBRARY_PATH`, the pip wheel's `nvidia/nccl/lib` under the
/// usual Python prefixes, and the distribution's library folders.
pub fn candidate_dirs() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(p) = std::env::var("ACCEL_NCCL_LIB") {
        let p = PathBuf::from(p);
        out.push(if p.is_file() {
            p.parent().map(Path::to_path_buf).unwrap_or(p)
        } else {
            p
        });
    }
    if let Ok(lp) = std::env::var("LD_LIBRARY_PATH") {
        out.extend(std::env::split_paths(&lp).filter(|p| !p.as_os_str().is_empty()));
    }
    let mut prefixes: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|k| std::env::var_os(k).map(PathBuf::from))
        .collect();
    if let Some(h) = std::env::var_os("HOME") {
        prefixes.push(PathBuf::from(h).join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    for pre in prefixes {
        for lib in ["lib", "lib64"] {
            let Ok(rd) = std::fs::read_dir(pre.join(lib)) else {
                continue;
            };
            let mut pys: Vec<PathBuf> = rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("python3"))
                })
                .collect();
            pys.sort();
            for py in pys {
                for sp in ["site-packages", "dist-packages"] {
                    out.push(py.join(sp).join("nvidia/nccl/lib"));
                }
            }
        }
    }
    out.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/local/cuda/lib64",
        ]
        .map(PathBuf::from),
    );
    out
}

/// The first `libnccl.so.2` in `dirs`.
pub(crate) fn find_soname(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter()
        .map(|d| d.join("libnccl.so.2"))
        .find(|p| p.is_file())
}

/// Make (or reuse) `into/libnccl.so -> <found libnccl.so.2>` and return
/// `into`, for `LD_LIBRARY_PATH`. `Ok(None)` when no `libnccl.so.2` is in
/// [`candidate_dirs`] (or when one of them already has `libnccl.so`, so
/// nothing is needed).
///
/// # Errors
/// The I/O error of creating the folder or the link.
pub fn prepare_link_dir(into: &Path) -> std::io::Result<Option<PathBuf>> {
    let dirs = candidate_dirs();
    if dirs.iter().any(|d| d.join("libnccl.so").exists()) {
        return Ok(None);
    }
    let Some(lib) = find_soname(&dirs) else {
        return Ok(None);
    };
    std::fs::create_dir_all(into)?;
    let link = into.join("libnccl.so");
    if std::fs::read_link(&link).ok().as_deref() != Some(lib.as_path()) {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link)?;
    }
    Ok(Some(into.to_path_buf()))
}

/// The backend's probe: available when the driver, a device and NCCL are
/// all there, and there are at least as many visible GPUs as ranks on this
/// machine (NCCL refuses two ranks on one GPU).
pub(crate) fn probe(ctx: &ProbeContext) -> Probe {
    fit(inspect(), ctx).to_probe()
}

/// `report`, unavailable when the run puts more ranks on this machine than
/// there are GPUs.
pub(crate) fn fit(mut report: ProbeReport, ctx: &ProbeContext) -> ProbeReport {
    if report.unavailable.is_none() && ctx.local_world_size > report.devices {
        report.unavailable = Some(format!(
            "{} ranks on this machine but {} visible GPU(s): NCCL refuses two ranks on one GPU",
            ctx.local_world_size, report.devices
        ));
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the probe finds on a machine with `devices` GPUs, CUDA 13.0 and
    /// NCCL 2.28.3.
    fn found(devices: usize, visible: Option<&str>) -> ProbeReport {
        ProbeReport {
            devices,
            driver: Some("13.0".into()),
            nccl: Some("2.28.3".into()),
            visible: visible.map(String::from),
            unavailable: None,
        }
    }

    #[test]
    fn versions_read_like_the_libraries_print_them() {
        assert_eq!(cuda_version_text(13000), "13.0");
        assert_eq!(cuda_version_text(12080), "12.8");
        assert_eq!(nccl_version_text(22803), "2.28.3");
        assert_eq!(nccl_version_text(2708), "2.7.8");
    }

    #[test]
    fn the_version_line_has_what_was_found() {
        let r = found(2, Some("0,1"));
        assert_eq!(
            r.version_line().unwrap(),
            "NCCL 2.28.3, CUDA driver 13.0, CUDA_VISIBLE_DEVICES=0,1"
        );
        let p = r.to_probe();
        assert!(p.is_available());
        assert_eq!(p.device_count, 2);
        let r = ProbeReport {
            unavailable: Some("no".into()),
            nccl: None,
            visible: None,
            ..r
        };
        let p = r.to_probe();
        assert_eq!(p.reason(), Some("no"));
        assert_eq!(p.engine_version.as_deref(), Some("CUDA driver 13.0"));
    }

    #[test]
    fn more_local_ranks_than_gpus_is_unavailable() {
        let one_gpu = found(1, None);
        let mut ctx = ProbeContext::single_process();
        assert!(fit(one_gpu.clone(), &ctx).unavailable.is_none());
        ctx.world_size = 2;
        ctx.local_world_size = 2;
        let why = fit(one_gpu, &ctx).unavailable.unwrap();
        assert!(
            why.contains("2 ranks on this machine but 1 visible GPU"),
            "{why}"
        );
    }

    #[test]
    fn a_wheel_soname_gets_a_link_and_the_reason_names_it() {
        let t = tempfile::tempdir().unwrap();
        let wheel = t.path().join("site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&wheel).unwrap();
        assert!(find_soname(std::slice::from_ref(&wheel)).is_none());
        let why = nccl_missing_reason(std::slice::from_ref(&wheel));
        assert!(why.contains("libnccl.so was not found"), "{why}");
        std::fs::write(wheel.join("libnccl.so.2"), b"not really").unwrap();
        let why = nccl_missing_reason(&[t.path().into(), wheel.clone()]);
        assert!(
            why.contains("libnccl.so.2 but cudarc opens `libnccl.so`"),
            "{why}"
        );
        assert!(why.contains("LD_LIBRARY_PATH"), "{why}");
    }
}
