//! The environments cluster schedulers give each machine of a job, read as
//! defaults of `accel launch`'s flags (below the flags and the config file's
//! place in the layers, as torchrun reads them):
//!
//! * **Kubeflow Trainer v2** runs torchrun in each pod with `PET_NNODES`,
//!   `PET_NPROC_PER_NODE`, `PET_NODE_RANK`, `PET_MASTER_ADDR`,
//!   `PET_MASTER_PORT` (and `PET_MAX_RESTARTS`): torchrun takes every
//!   `PET_<FLAG>` as the default of `--<flag>`. accel does the same for
//!   these, so a TrainJob whose command is `accel launch -- ./train` runs at
//!   the job's world size.
//! * **SkyPilot** gives `SKYPILOT_NODE_RANK`, `SKYPILOT_NODE_IPS` (one
//!   address per line, the first is the head) and
//!   `SKYPILOT_NUM_GPUS_PER_NODE`: the machine rank, the machine count and
//!   machine 0's address, and the ranks per machine when GPUs are given.
//!
//! Precedence: flags, then `PET_*`, then `SKYPILOT_*`.

use accel_api::{Error, Result};

use super::options::{parse_count, parse_index, parse_machines, Options};

/// Fill `o`'s unset machine options from `PET_*`, then from `SKYPILOT_*`.
///
/// # Errors
/// `InvalidConfig` naming the variable whose value is malformed, and how
/// to fix it.
pub fn apply(get: &impl Fn(&str) -> Option<String>, o: &mut Options) -> Result<()> {
    let var = |k: &str| {
        get(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let bad = |k: &str, v: &str, why: String| {
        Error::invalid_config(k, v, why).with_fix(format!(
            "fix or unset {k} (flags of accel launch override it)"
        ))
    };
    // Kubeflow Trainer (torchrun's PET_<FLAG> defaults).
    if let Some(v) = var("PET_NNODES") {
        o.num_machines = o.num_machines.or(Some(
            parse_machines(&v).map_err(|w| bad("PET_NNODES", &v, w))?,
        ));
    }
    if let Some(v) = var("PET_NPROC_PER_NODE") {
        // torchrun's `auto`, `cpu`, `gpu`: accel's default (one rank, or
        // what the backend's device count gives) stands.
        if !matches!(v.as_str(), "auto" | "cpu" | "gpu" | "xpu") {
            let n = parse_count(&v).map_err(|w| bad("PET_NPROC_PER_NODE", &v, w))?;
            o.num_processes = o.num_processes.or(Some(n));
        }
    }
    if let Some(v) = var("PET_NODE_RANK") {
        let k = parse_index(&v).map_err(|w| bad("PET_NODE_RANK", &v, w))?;
        o.machine_rank = o.machine_rank.or(Some(k));
    }
    if let Some(v) = var("PET_MASTER_ADDR") {
        o.main_process_ip = o.main_process_ip.take().or(Some(v));
    }
    if let Some(v) = var("PET_MASTER_PORT") {
        let p = v
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("PET_MASTER_PORT", &v, "not a port in 1-65535".into()))?;
        o.main_process_port = o.main_process_port.or(Some(p));
    }
    if let Some(v) = var("PET_MAX_RESTARTS") {
        let n = v
            .parse::<u32>()
            .map_err(|_| bad("PET_MAX_RESTARTS", &v, "not a whole number".into()))?;
        o.max_restarts = o.max_restarts.or(Some(n));
    }
    // SkyPilot.
    if let Some(v) = get("SKYPILOT_NODE_IPS").filter(|v| !v.trim().is_empty()) {
        let ips: Vec<&str> = v.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        o.num_machines = o.num_machines.or(Some(ips.len().into()));
        o.main_process_ip = o.main_process_ip.take().or(Some(ips[0].to_string()));
    }
    if let Some(v) = var("SKYPILOT_NODE_RANK") {
        let k = parse_index(&v).map_err(|w| bad("SKYPILOT_NODE_RANK", &v, w))?;
        o.machine_rank = o.machine_rank.or(Some(k));
    }
    if let Some(v) = var("SKYPILOT_NUM_GPUS_PER_NODE") {
        let n: usize = v.parse().map_err(|_| {
            bad(
                "SKYPILOT_NUM_GPUS_PER_NODE",
                &v,
                "not a whole number".into(),
            )
        })?;
        // A CPU cluster says 0: accel's default stands.
        if n > 0 {
            o.num_processes = o.num_processes.or(Some(n));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)], base: Options) -> Result<Options> {
        let get = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        let mut o = base;
        apply(&get, &mut o)?;
        Ok(o)
    }

    #[test]
    fn kubeflow_pet_variables_are_torchrun_s_flag_defaults() {
        let o = from(
            &[
                ("PET_NNODES", "2"),
                ("PET_NPROC_PER_NODE", "4"),
                ("PET_NODE_RANK", "1"),
                ("PET_MASTER_ADDR", "job-node-0-0.job"),
                ("PET_MASTER_PORT", "29400"),
                ("PET_MAX_RESTARTS", "3"),
            ],
            Options::default(),
        )
        .unwrap();
        assert_eq!(o.num_machines, Some(2.into()));
        assert_eq!(o.num_processes, Some(4));
        assert_eq!(o.machine_rank, Some(1));
        assert_eq!(o.main_process_ip.as_deref(), Some("job-node-0-0.job"));
        assert_eq!(o.main_process_port, Some(29400));
        assert_eq!(o.max_restarts, Some(3));
        // Elastic ranges as torchrun's; `auto` leaves accel's default.
        let o = from(
            &[("PET_NNODES", "1:3"), ("PET_NPROC_PER_NODE", "auto")],
            Options::default(),
        )
        .unwrap();
        assert_eq!(o.num_machines.map(|m| (m.min, m.max)), Some((1, 3)));
        assert_eq!(o.num_processes, None);
    }

    #[test]
    fn flags_win_over_pet_and_pet_over_skypilot() {
        let flags = Options {
            machine_rank: Some(0),
            ..Options::default()
        };
        let o = from(
            &[
                ("PET_NODE_RANK", "1"),
                ("PET_MASTER_ADDR", "10.0.0.9"),
                ("SKYPILOT_NODE_RANK", "2"),
                ("SKYPILOT_NODE_IPS", "10.0.0.1\n10.0.0.2\n10.0.0.3\n"),
            ],
            flags,
        )
        .unwrap();
        assert_eq!(o.machine_rank, Some(0), "the flag");
        assert_eq!(o.main_process_ip.as_deref(), Some("10.0.0.9"), "PET_");
        assert_eq!(o.num_machines, Some(3.into()), "SkyPilot's count");
    }

    #[test]
    fn skypilot_gives_machines_rank_head_and_gpus() {
        let o = from(
            &[
                ("SKYPILOT_NODE_RANK", "1"),
                ("SKYPILOT_NODE_IPS", "10.1.0.5\n10.1.0.6"),
                ("SKYPILOT_NUM_GPUS_PER_NODE", "8"),
            ],
            Options::default(),
        )
        .unwrap();
        assert_eq!(o.num_machines, Some(2.into()));
        assert_eq!(o.machine_rank, Some(1));
        assert_eq!(o.main_process_ip.as_deref(), Some("10.1.0.5"));
        assert_eq!(o.num_processes, Some(8));
        let cpu = from(&[("SKYPILOT_NUM_GPUS_PER_NODE", "0")], Options::default()).unwrap();
        assert_eq!(cpu.num_processes, None);
    }

    #[test]
    fn malformed_values_name_the_variable() {
        for (k, v) in [
            ("PET_NNODES", "two"),
            ("PET_NPROC_PER_NODE", "0"),
            ("PET_NODE_RANK", "-1"),
            ("PET_MASTER_PORT", "99999"),
            ("PET_MAX_RESTARTS", "many"),
            ("SKYPILOT_NODE_RANK", "x"),
            ("SKYPILOT_NUM_GPUS_PER_NODE", "-8"),
        ] {
            let e = from(&[(k, v)], Options::default()).unwrap_err().to_string();
            assert!(e.contains(k), "{k}={v}: {e}");
        }
    }
}
