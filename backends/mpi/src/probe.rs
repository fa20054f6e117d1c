//! The probe: MPI is available when an MPI launcher started this process.

use accel_api::{Probe, ProbeContext};

use crate::ffi;

/// Variables an MPI launcher sets in every process it starts: Open MPI's
/// mpirun (`OMPI_COMM_WORLD_*`), PMIx-based launchers (`PMIX_RANK`),
/// MPICH/Intel MPI hydra and `srun --mpi=pmi2` (`PMI_RANK`, `PMI_SIZE`),
/// MVAPICH (`MV2_COMM_WORLD_*`).
pub const LAUNCHER_VARIABLES: [&str; 5] = [
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MV2_COMM_WORLD_RANK",
];

/// `true` when `var` shows a variable of [`LAUNCHER_VARIABLES`].
pub fn launched_by_mpi(var: &dyn Fn(&str) -> Option<String>) -> bool {
    LAUNCHER_VARIABLES.iter().any(|v| var(v).is_some())
}

/// The MPI library's own version line (`MPI_Get_library_version`, which
/// MPI allows before `MPI_Init`): `Open MPI v4.1.4, package: ...`.
pub fn engine_version() -> String {
    ffi::library_version()
}

/// Available when an MPI launcher started this process.
pub fn probe(ctx: &ProbeContext) -> Probe {
    let env = |k: &str| std::env::var(k).ok();
    if !(ctx.mpi_launched || launched_by_mpi(&env)) {
        return Probe::unavailable(
            "not started by mpirun/mpiexec/srun (no OMPI_COMM_WORLD_*, PMI_*, PMIX_RANK or MV2_* variables): start the program with `mpirun -n N` or `accel launch --backend mpi`",
        );
    }
    Probe::available(1, Some(engine_version()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launcher_variables_are_recognised() {
        let none = |_: &str| None;
        assert!(!launched_by_mpi(&none));
        let ompi = |k: &str| (k == "OMPI_COMM_WORLD_RANK").then(|| "1".to_string());
        assert!(launched_by_mpi(&ompi));
        let pmix = |k: &str| (k == "PMIX_RANK").then(|| "0".to_string());
        assert!(launched_by_mpi(&pmix));
    }

    #[test]
    fn probe_explains_why_not() {
        if launched_by_mpi(&|k| std::env::var(k).ok()) {
            return;
        }
        let p = probe(&ProbeContext::single_process());
        assert!(!p.is_available());
        assert!(p.reason().unwrap().contains("mpirun"), "{p:?}");
    }
}
