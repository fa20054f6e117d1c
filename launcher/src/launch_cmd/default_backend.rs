//! The default backend: what `accel launch` runs a program over when no
//! backend is named (`--backend`, `ACCEL_BACKEND` or the config file).
//!
//! On one machine, MPI's shared-memory collectives are 4–50× faster than
//! Gloo's TCP loopback (docs/benchmarks.md), so `accel launch -n N -- prog`
//! runs `prog` through the system's mpirun, with the mpi backend, when all
//! of these hold, and otherwise starts the workers itself as before (their
//! probe then picks cpu-gloo on a CPU machine):
//!
//! 1. one machine and at least 2 processes (`--backend mpi` on several
//!    machines needs `--mpi-hosts`; it is never picked for you);
//! 2. the program can use MPI: it is an ELF executable whose dynamic
//!    section needs an MPI library (`DT_NEEDED` `libmpi.so.*` or
//!    `libmpich.so.*`), which is what a program built with accel's `mpi`
//!    feature (rsmpi) has. Only the program's own entries count (not its
//!    libraries' libraries), and scripts are not followed;
//! 3. an MPI launcher exists (`ACCEL_MPIRUN`, else `mpirun` on `PATH`), of
//!    the same family as that library (Open MPI's `libmpi.so.40` under
//!    Open MPI's mpirun; MPICH's `libmpi.so.12` / `libmpich.so.*` under
//!    hydra): a binary under the other family's launcher would see N
//!    one-rank worlds;
//! 4. no accelerator backend compiled into this `accel` probes available
//!    (cuda-nccl, npu-hccl): under mpirun the ranks get `ACCEL_BACKEND=mpi`,
//!    which would keep a GPU program off NCCL.
//!
//! `--backend cpu-gloo` (or any backend) forces the choice. The launcher
//! links no MPI for this: it reads the program's ELF header, program headers
//! and dynamic section (a few KiB, with positioned reads: a debug binary is
//! tens of MiB, and the launch path is timed in milliseconds), and runs
//! `mpirun --version` only when the program links MPI.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use accel_launch::mpirun::{detect_flavor, MpiFlavor, MpirunSpec};
use accel_launch::program;

/// Which engine `accel launch` uses by default for one program, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Choice {
    /// `"mpi"` (launched through mpirun) or `"cpu-gloo"` (local workers;
    /// their probe decides, which is cpu-gloo on a CPU machine).
    pub backend: &'static str,
    /// Why, in one sentence.
    pub reason: String,
    /// The MPI launcher, when one was found.
    pub mpirun: Option<PathBuf>,
    /// Its family, when one was found.
    #[serde(skip)]
    pub flavor: Option<MpiFlavor>,
}

impl Choice {
    fn gloo(reason: impl Into<String>) -> Choice {
        Choice {
            backend: "cpu-gloo",
            reason: reason.into(),
            mpirun: None,
            flavor: None,
        }
    }

    /// `true` when the run goes through mpirun with the mpi backend.
    pub fn is_mpi(&self) -> bool {
        self.backend == "mpi"
    }
}

/// The MPI launcher (`ACCEL_MPIRUN`, else `mpirun` on `PATH`), or why not.
///
/// # Errors
/// Why it is missing or not executable.
pub fn find_mpirun() -> Result<PathBuf, program::ProgramError> {
    let spec = MpirunSpec::new(1, "x");
    program::resolve(
        spec.launcher.as_os_str(),
        std::env::var_os("PATH").as_deref(),
    )
}

/// The MPI family a `DT_NEEDED` entry belongs to: `Some(Some(flavor))` for
/// a known library, `Some(None)` for another `libmpi.so.*`, `None` when it
/// is no MPI library.
fn mpi_library(needed: &str) -> Option<Option<MpiFlavor>> {
    if needed.starts_with("libmpich.so") || needed == "libmpi.so.12" {
        Some(Some(MpiFlavor::Mpich))
    } else if needed == "libmpi.so.40" {
        Some(Some(MpiFlavor::OpenMpi))
    } else if needed.starts_with("libmpi.so") {
        Some(None)
    } else {
        None
    }
}

fn family(f: MpiFlavor) -> &'static str {
    match f {
        MpiFlavor::OpenMpi => "Open MPI",
        MpiFlavor::Mpich => "MPICH",
    }
}

/// An accelerator backend of this binary that probes available, if any.
fn accelerator_available() -> Option<String> {
    let reg = accel::Registry::builtin();
    let ctx = accel_api::ProbeContext::single_process();
    reg.entries()
        .iter()
        .filter(|e| e.backend.device_kind() != accel_api::DeviceKind::Cpu)
        .find(|e| {
            let p = e.backend.probe(&ctx);
            p.is_available() && p.device_count > 0
        })
        .map(|e| e.backend.name().to_string())
}

/// The default engine for running `program` on `world` processes over
/// `machines` machines (see the module documentation for the rules).
pub fn choose(program: &Path, world: usize, machines: usize) -> Choice {
    if machines > 1 {
        return Choice::gloo(
            "several machines: MPI is used only when asked for (--backend mpi with --mpi-hosts)",
        );
    }
    if world < 2 {
        return Choice::gloo("one process: no collective engine to choose");
    }
    let shown = program.display();
    let needed = match needed_libraries(program) {
        Ok(n) => n,
        Err(why) => return Choice::gloo(format!("{shown} cannot use MPI: {why}")),
    };
    let Some((lib, lib_flavor)) = needed
        .iter()
        .find_map(|n| mpi_library(n).map(|f| (n.clone(), f)))
    else {
        return Choice::gloo(format!("{shown} does not link an MPI library (libmpi.so)"));
    };
    let mpirun = match find_mpirun() {
        Ok(p) => p,
        Err(why) => {
            return Choice::gloo(format!(
                "{shown} links {lib}, but there is no MPI launcher: {why}"
            ))
        }
    };
    let flavor = detect_flavor(&mpirun);
    if lib_flavor.is_some_and(|f| f != flavor) {
        return Choice::gloo(format!(
            "{shown} links {lib} ({}), but {} is {}'s launcher (ACCEL_MPIRUN picks another)",
            family(lib_flavor.unwrap_or(flavor)),
            mpirun.display(),
            family(flavor)
        ));
    }
    if let Some(dev) = accelerator_available() {
        return Choice::gloo(format!(
            "{shown} links {lib}, but the {dev} backend is available here: the program's \
             probe chooses (--backend mpi forces MPI)"
        ));
    }
    Choice {
        backend: "mpi",
        reason: format!(
            "{shown} links {lib} and {} is {}'s launcher (the fastest CPU engine here; \
             --backend cpu-gloo forces Gloo)",
            mpirun.display(),
            family(flavor)
        ),
        mpirun: Some(mpirun),
        flavor: Some(flavor),
    }
}

/// Why [`needed_libraries`] found none: not an ELF file, or unreadable.
type ElfResult<T> = Result<T, String>;

/// Largest program-header table, dynamic section and string table read.
const MAX_TABLE: u64 = 1 << 20;

/// The `DT_NEEDED` entries of the ELF executable at `path` (empty for a
/// static executable).
///
/// # Errors
/// A text saying why: unreadable, not ELF (a script), or malformed.
pub fn needed_libraries(path: &Path) -> ElfResult<Vec<String>> {
    let f = File::open(path).map_err(|e| format!("cannot read it ({e})"))?;
    let read = |off: u64, len: u64| -> ElfResult<Vec<u8>> {
        if len > MAX_TABLE {
            return Err("malformed ELF file (a table is too large)".into());
        }
        let mut b = vec![0u8; len as usize];
        f.read_exact_at(&mut b, off)
            .map_err(|_| "malformed ELF file (a table lies outside the file)".to_string())?;
        Ok(b)
    };
    let head = read(0, 64).map_err(|_| "not an ELF executable (a script?)".to_string())?;
    if head[..4] != *b"\x7fELF" {
        return Err("not an ELF executable (a script?)".into());
    }
    let wide = match head[4] {
        1 => false,
        2 => true,
        _ => return Err("malformed ELF file (unknown class)".into()),
    };
    let big = match head[5] {
        1 => false,
        2 => true,
        _ => return Err("malformed ELF file (unknown byte order)".into()),
    };
    let num = |b: &[u8], at: usize, n: usize| -> u64 {
        let mut v: u64 = 0;
        for i in 0..n {
            let byte = u64::from(b[at + if big { i } else { n - 1 - i }]);
            v = (v << 8) | byte;
        }
        v
    };
    let word = if wide { 8 } else { 4 };
    let (phoff, phentsize, phnum) = if wide {
        (
            num(&head, 0x20, 8),
            num(&head, 0x36, 2),
            num(&head, 0x38, 2),
        )
    } else {
        (
            num(&head, 0x1C, 4),
            num(&head, 0x2A, 2),
            num(&head, 0x2C, 2),
        )
    };
    let min_ph = if wide { 56 } else { 32 };
    if phentsize < min_ph {
        return Err("malformed ELF file (program header size)".into());
    }
    let ph = read(phoff, phentsize * phnum)?;
    // (type, offset, vaddr, filesz) of each program header.
    let headers: Vec<(u64, u64, u64, u64)> = (0..phnum as usize)
        .map(|i| {
            let at = i * phentsize as usize;
            if wide {
                (
                    num(&ph, at, 4),
                    num(&ph, at + 8, 8),
                    num(&ph, at + 16, 8),
                    num(&ph, at + 32, 8),
                )
            } else {
                (
                    num(&ph, at, 4),
                    num(&ph, at + 4, 4),
                    num(&ph, at + 8, 4),
                    num(&ph, at + 16, 4),
                )
            }
        })
        .collect();
    const PT_LOAD: u64 = 1;
    const PT_DYNAMIC: u64 = 2;
    let Some(&(_, dyn_off, _, dyn_size)) = headers.iter().find(|h| h.0 == PT_DYNAMIC) else {
        return Ok(Vec::new());
    };
    let dynamic = read(dyn_off, dyn_size)?;
    const DT_NEEDED: u64 = 1;
    const DT_STRTAB: u64 = 5;
    const DT_STRSZ: u64 = 10;
    let (mut needed, mut strtab, mut strsz) = (Vec::new(), None, None);
    for entry in dynamic.chunks_exact(2 * word) {
        let (tag, val) = (num(entry, 0, word), num(entry, word, word));
        match tag {
            0 => break,
            DT_NEEDED => needed.push(val),
            DT_STRTAB => strtab = Some(val),
            DT_STRSZ => strsz = Some(val),
            _ => {}
        }
    }
    if needed.is_empty() {
        return Ok(Vec::new());
    }
    let (Some(addr), Some(size)) = (strtab, strsz) else {
        return Err("malformed ELF file (no dynamic string table)".into());
    };
    // The string table's address, as a file offset through its segment.
    let off = headers
        .iter()
        .find(|h| h.0 == PT_LOAD && h.2 <= addr && addr < h.2.saturating_add(h.3))
        .map(|h| addr - h.2 + h.1)
        .ok_or("malformed ELF file (the dynamic string table is in no segment)")?;
    let strings = read(off, size)?;
    Ok(needed
        .into_iter()
        .filter_map(|i| {
            let rest = strings.get(i as usize..)?;
            let end = rest.iter().position(|&c| c == 0)?;
            Some(String::from_utf8_lossy(&rest[..end]).into_owned())
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_binary_needs_libc_and_the_choice_follows_its_libraries() {
        let me = std::env::current_exe().unwrap();
        let needed = needed_libraries(&me).unwrap();
        assert!(
            needed.iter().any(|n| n.starts_with("libc.so")),
            "{needed:?}"
        );
        let c = choose(&me, 2, 1);
        // Whether this binary links MPI depends on the features cargo
        // unified for the whole build (the conformance crate's `mpi` turns
        // on the facade's), not only on this crate's `mpi` feature: read it.
        if needed.iter().any(|n| mpi_library(n).is_some()) {
            assert!(c.reason.contains("links libmpi"), "{c:?}");
        } else {
            assert_eq!(c.backend, "cpu-gloo");
            assert!(c.reason.contains("does not link an MPI library"), "{c:?}");
        }
    }

    #[test]
    fn scripts_and_missing_files_are_not_mpi_programs() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("run.sh");
        std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
        let e = needed_libraries(&script).unwrap_err();
        assert!(e.contains("not an ELF executable"), "{e}");
        let c = choose(&script, 2, 1);
        assert_eq!(c.backend, "cpu-gloo");
        assert!(c.reason.contains("cannot use MPI"), "{c:?}");
        let e = needed_libraries(&dir.path().join("missing")).unwrap_err();
        assert!(e.contains("cannot read"), "{e}");
        let short = dir.path().join("short");
        std::fs::write(&short, b"\x7fELF\x02\x01").unwrap();
        assert!(needed_libraries(&short).is_err());
    }

    #[test]
    fn truncated_or_corrupt_elf_files_are_errors_not_panics() {
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cut");
        for len in [16usize, 63, 64, 100, 4096] {
            std::fs::write(&p, &me[..len.min(me.len())]).unwrap();
            let _ = needed_libraries(&p);
        }
        let mut bad = me[..4096.min(me.len())].to_vec();
        bad[4] = 9;
        std::fs::write(&p, &bad).unwrap();
        assert!(needed_libraries(&p).unwrap_err().contains("class"));
    }

    #[test]
    fn mpi_libraries_are_recognised_by_family() {
        assert_eq!(mpi_library("libmpi.so.40"), Some(Some(MpiFlavor::OpenMpi)));
        assert_eq!(mpi_library("libmpi.so.12"), Some(Some(MpiFlavor::Mpich)));
        assert_eq!(mpi_library("libmpich.so.12"), Some(Some(MpiFlavor::Mpich)));
        assert_eq!(mpi_library("libmpi.so.20"), Some(None));
        assert_eq!(mpi_library("libmpi_cxx.so.40"), None);
        assert_eq!(mpi_library("libc.so.6"), None);
    }

    #[test]
    fn one_process_and_several_machines_keep_gloo() {
        let me = std::env::current_exe().unwrap();
        assert!(choose(&me, 1, 1).reason.contains("one process"));
        assert!(choose(&me, 4, 2).reason.contains("several machines"));
    }
}
