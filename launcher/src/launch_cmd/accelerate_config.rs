//! Accelerate's config file (`accelerate config` writes it; `accelerate
//! launch --config_file FILE` reads it): YAML, or JSON for `.json` files
//! (`accelerate config default` writes JSON whatever the name; JSON is
//! YAML too, so both read alike).
//!
//! Each key is mapped to an option of `accel launch` or to a variable the
//! workers get, or refused naming the key and why accel cannot honour it.
//! A key that only restates a default (`use_cpu: false`, `fsdp_config:
//! {}`, `downcast_bf16: 'no'`) is accepted whatever it names.
//!
//! | key | accel launch |
//! |---|---|
//! | `num_processes` (all machines) | `--num-processes` (-1: not given) |
//! | `num_machines`, `machine_rank` | `--num-machines`, `--machine-rank` |
//! | `main_process_ip`, `main_process_port` | the same flags |
//! | `mixed_precision` `no`/`bf16`/`fp16` (old: `fp16: true`) | `--mixed-precision` |
//! | `gradient_accumulation_steps` | `--gradient-accumulation-steps` |
//! | `debug: true` | `--debug`, and ACCELERATE_DEBUG_MODE=true |
//! | `use_cpu: true` | `--backend cpu-gloo`, and ACCELERATE_USE_CPU=True |
//! | `distributed_type` `NO`, `MULTI_CPU`, `MULTI_GPU`, `MULTI_NPU`, ... | one process per rank (NO: one in all) |
//! | `rdzv_backend` `static`/`c10d` | machine 0 hosts the rendezvous |
//! | `compute_environment: LOCAL_MACHINE`, `same_network`, `main_training_function`, `gpu_ids: all` | nothing to do |

use std::path::Path;

use accel_api::{Error, ErrorKind, Result};
use yaml_rust2::{Yaml, YamlLoader};

use super::options::{parse_count, parse_index, parse_steps, Backends, Options};

/// What an Accelerate config file asks of a launch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccelerateConfig {
    /// The options it maps to (the config-file layer).
    pub options: Options,
    /// Variables of Accelerate's own that the workers get
    /// (`ACCELERATE_USE_CPU`, `ACCELERATE_DEBUG_MODE`).
    pub env: Vec<(String, String)>,
}

/// `true` for a file read as Accelerate's config: `.yaml`, `.yml`, `.json`.
pub fn is_accelerate_config(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| matches!(e.to_ascii_lowercase().as_str(), "yaml" | "yml" | "json"))
}

/// Read and map the Accelerate config file at `path`.
///
/// # Errors
/// [`ErrorKind::Io`] when it cannot be read; [`ErrorKind::InvalidConfig`]
/// for YAML syntax errors, unknown keys, wrong types and keys accel cannot
/// honour, naming the key and the file.
pub fn read(path: &Path) -> Result<AccelerateConfig> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::io(
            format!("cannot read Accelerate's config file {}", path.display()),
            e,
        )
        .with_fix("check the path given to --config_file")
    })?;
    parse(&text, path)
}

/// Keys accel cannot honour when set to anything but their default, and
/// why. Matched after the keys that map.
const REFUSED: &[(&str, &str)] = &[
    (
        "deepspeed_config",
        "accel does not drive DeepSpeed; its own ZeRO is --sharding (optimizer, gradients, full)",
    ),
    (
        "fsdp_config",
        "accel does not drive torch's FSDP; its own sharding of accel programs is --sharding full",
    ),
    (
        "megatron_lm_config",
        "accel does not drive Megatron-LM's tensor or pipeline parallelism",
    ),
    (
        "mpirun_config",
        "accel starts MPI jobs itself: use --backend mpi with --hostfile FILE",
    ),
    (
        "dynamo_config",
        "torch.compile settings are the program's own (pass them to torch.compile)",
    ),
    (
        "dynamo_backend",
        "torch.compile settings are the program's own (pass them to torch.compile)",
    ),
    (
        "gpu_ids",
        "accel gives each rank the device of its LOCAL_RANK among those visible: set \
         CUDA_VISIBLE_DEVICES (or your accelerator's variable) for accel launch instead",
    ),
    (
        "enable_cpu_affinity",
        "accel does not pin workers to CPUs; start the program under numactl or taskset",
    ),
    (
        "downcast_bf16",
        "it applies to TPUs under torch_xla, which accel does not launch",
    ),
    (
        "tpu_name",
        "accel does not launch on TPU pods (torch_xla); accel's xla backend runs under --backend xla",
    ),
    ("tpu_zone", "accel does not launch on TPU pods (torch_xla)"),
    ("tpu_use_cluster", "accel does not launch on TPU pods (torch_xla)"),
    ("tpu_use_sudo", "accel does not launch on TPU pods (torch_xla)"),
    ("tpu_vm", "accel does not launch on TPU pods (torch_xla)"),
    ("tpu_env", "accel does not launch on TPU pods (torch_xla)"),
    ("command_file", "accel does not launch on TPU pods (torch_xla)"),
    ("commands", "accel does not launch on TPU pods (torch_xla)"),
];

/// `distributed_type` values accel runs as one process per rank.
const PROCESS_TYPES: &[&str] = &[
    "NO",
    "MULTI_CPU",
    "MULTI_GPU",
    "MULTI_NPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_XPU",
    "MULTI_HPU",
    "MULTI_NEURON",
];

/// `distributed_type` values accel cannot honour, and why.
const REFUSED_TYPES: &[(&str, &str)] = &[
    (
        "DEEPSPEED",
        "accel does not drive DeepSpeed; use MULTI_GPU (or MULTI_CPU) and --sharding for ZeRO",
    ),
    (
        "FSDP",
        "accel does not drive torch's FSDP; use MULTI_GPU (or MULTI_CPU) and --sharding full",
    ),
    (
        "XLA",
        "accel does not launch torch_xla; accel programs on PJRT devices use --backend xla",
    ),
    ("MEGATRON_LM", "accel does not drive Megatron-LM"),
];

/// Parse the text of an Accelerate config; `path` is only used in messages.
///
/// # Errors
/// As [`read`].
pub fn parse(text: &str, path: &Path) -> Result<AccelerateConfig> {
    let docs = YamlLoader::load_from_str(text).map_err(|e| {
        Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "Accelerate's config file {} is not valid YAML: {e}",
                path.display()
            ),
        )
        .with_fix("write it again with `accelerate config`, or fix the line named")
    })?;
    let map = match docs.as_slice() {
        [Yaml::Hash(h)] => h,
        [] => {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!("Accelerate's config file {} is empty", path.display()),
            )
            .with_fix("write one with `accelerate config`"))
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "Accelerate's config file {} is not one mapping of keys to values",
                    path.display()
                ),
            )
            .with_fix("write one with `accelerate config`"))
        }
    };
    let mut out = AccelerateConfig::default();
    let mut distributed_type = None;
    let mut use_cpu = false;
    for (k, value) in map {
        let Some(key) = k.as_str() else {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "Accelerate's config file {}: a key is not a string ({k:?})",
                    path.display()
                ),
            ));
        };
        let ctx = Ctx { path, key };
        let o = &mut out.options;
        match key {
            "compute_environment" => {
                match ctx.string(value)?.as_str() {
                    "LOCAL_MACHINE" => {}
                    "AMAZON_SAGEMAKER" => return Err(ctx.refuse(
                        "AMAZON_SAGEMAKER",
                        "accel starts processes on the machines it runs on; SageMaker jobs are \
                         started by `accelerate launch` itself",
                    )),
                    other => return Err(ctx.wrong(&format!("has an unknown value `{other}`"))),
                }
            }
            "distributed_type" => distributed_type = Some(ctx.string(value)?),
            "num_processes" => {
                let n = ctx.integer(value)?;
                // Accelerate's "not given" (e.g. under Slurm).
                if n != -1 {
                    o.total_processes = Some(ctx.parsed(n, parse_count)?);
                }
            }
            "num_machines" => {
                o.num_machines = Some(ctx.parsed(ctx.integer(value)?, parse_count)?.into())
            }
            "machine_rank" => o.machine_rank = Some(ctx.parsed(ctx.integer(value)?, parse_index)?),
            "main_process_ip" => o.main_process_ip = ctx.opt_string(value)?,
            "main_process_port" => {
                if !value.is_null() {
                    let p = ctx.integer(value)?;
                    o.main_process_port = Some(u16::try_from(p).map_err(|_| {
                        ctx.wrong(&format!("must be a port between 0 and 65535, got {p}"))
                    })?);
                }
            }
            "mixed_precision" => {
                // Accelerate's default when unset is `no`, written as null;
                // an unquoted `no` is false to PyYAML.
                let s = match value {
                    Yaml::Boolean(false) => Some("no".to_string()),
                    v => ctx.opt_string(v)?,
                };
                if let Some(s) = s {
                    o.mixed_precision = Some(s.parse().map_err(|e: Error| {
                        ctx.wrong(&format!(
                            "= {s}: {} (accel's mixed precision is no, bf16 or fp16; fp8 is not \
                             supported)",
                            e.message()
                        ))
                    })?);
                }
            }
            // The format before `mixed_precision`.
            "fp16" => {
                if ctx.boolean(value)? {
                    o.mixed_precision = Some(accel::train::MixedPrecision::Fp16);
                }
            }
            "gradient_accumulation_steps" => {
                o.gradient_accumulation_steps = Some(ctx.parsed(ctx.integer(value)?, parse_steps)?)
            }
            "debug" => {
                if ctx.boolean(value)? {
                    o.debug = true;
                    out.env
                        .push(("ACCELERATE_DEBUG_MODE".into(), "true".into()));
                }
            }
            "use_cpu" => use_cpu = ctx.boolean(value)?,
            "rdzv_backend" => match ctx.opt_string(value)?.as_deref() {
                None | Some("static" | "c10d") => {}
                Some(other) => {
                    return Err(ctx.refuse(
                        other,
                        "accel's machine 0 hosts the rendezvous itself (static and c10d both \
                         mean that); Accelerate's file has no place for an etcd cluster's \
                         members: pass `--rdzv-backend etcd --rdzv-endpoint HOST:PORT,... \
                         --rdzv-id RUN` on the command line instead",
                    ))
                }
            },
            // Whether the machines share a network (for c10d), and the
            // function notebook_launcher calls: nothing to do for accel.
            "same_network" => {
                ctx.boolean(value)?;
            }
            "main_training_function" => {
                ctx.opt_string(value)?;
            }
            "parallelism_config" => parallelism_section(path, value, o)?,
            _ => match REFUSED.iter().find(|(k, _)| *k == key) {
                Some((_, why)) => {
                    if !is_default(key, value) {
                        return Err(ctx.refuse(&show(value), why));
                    }
                }
                None => {
                    return Err(Error::new(
                        ErrorKind::InvalidConfig,
                        format!(
                            "Accelerate's config file {}: unknown key `{key}`",
                            path.display()
                        ),
                    )
                    .with_fix(
                        "remove it; accel reads the keys accelerate 1.x writes (docs/torch.md \
                         lists how each maps)",
                    ))
                }
            },
        }
    }
    let dt = distributed_type.ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "Accelerate's config file {} has no `distributed_type` (Accelerate requires one)",
                path.display()
            ),
        )
        .with_fix("add e.g. `distributed_type: MULTI_GPU` (or MULTI_CPU, or NO for one process)")
    })?;
    let ctx = Ctx {
        path,
        key: "distributed_type",
    };
    if let Some((_, why)) = REFUSED_TYPES.iter().find(|(t, _)| *t == dt) {
        return Err(ctx.refuse(&dt, why));
    }
    if !PROCESS_TYPES.contains(&dt.as_str()) {
        return Err(ctx.wrong(&format!(
            "has an unknown value `{dt}` (known: {})",
            PROCESS_TYPES.join(", ")
        )));
    }
    let o = &mut out.options;
    if dt == "NO" {
        // One process, as Accelerate runs it.
        match o.total_processes {
            Some(n) if n > 1 => {
                return Err(ctx
                    .wrong(&format!("is NO (one process), but num_processes is {n}"))
                    .with_fix(
                        "set distributed_type to MULTI_GPU or MULTI_CPU, or num_processes to 1",
                    ))
            }
            _ => o.total_processes = Some(1),
        }
    }
    if use_cpu {
        o.backend = Some(Backends(vec!["cpu-gloo".into()]));
        out.env.push(("ACCELERATE_USE_CPU".into(), "True".into()));
    }
    Ok(out)
}

/// `value` says nothing beyond the default of `key` (what `accelerate
/// config` writes when the feature is off).
/// Accelerate's `parallelism_config` section (what `accelerate config`
/// writes: `parallelism_config_dp_replicate_size`, `_dp_shard_size`,
/// `_tp_size`, `_cp_size`, and the context- and sequence-parallel
/// settings) into the sizes of `accel launch --parallelism-config-*`, a
/// layer below the flags. The settings accel does not drive are refused
/// unless at their defaults.
fn parallelism_section(path: &Path, value: &Yaml, o: &mut Options) -> Result<()> {
    let map = match value {
        Yaml::Null => return Ok(()),
        Yaml::Hash(h) => h,
        v => {
            let ctx = Ctx {
                path,
                key: "parallelism_config",
            };
            return Err(ctx.wrong_type("a mapping of parallelism_config_* keys", v));
        }
    };
    for (k, v) in map {
        let name = k.as_str().unwrap_or_default();
        let key = format!("parallelism_config.{name}");
        let ctx = Ctx { path, key: &key };
        let bare = name.strip_prefix("parallelism_config_").unwrap_or(name);
        let size = |ctx: &Ctx<'_>| -> Result<Option<usize>> {
            if v.is_null() {
                return Ok(None);
            }
            ctx.parsed(ctx.integer(v)?, parse_count).map(Some)
        };
        match bare {
            "dp_replicate_size" => o.pc_dp_replicate = size(&ctx)?,
            "dp_shard_size" => o.pc_dp_shard = size(&ctx)?,
            "tp_size" => o.pc_tp = size(&ctx)?,
            "cp_size" => o.pc_cp = size(&ctx)?,
            // How context-parallel ranks exchange keys and values: cp_size
            // above 1 is refused when the sizes are checked.
            "cp_comm_strategy" | "cp_backend" => {
                ctx.opt_string(v)?;
            }
            "sp_size" => {
                if size(&ctx)?.unwrap_or(1) > 1 {
                    return Err(ctx.refuse(
                        &show(v),
                        "DeepSpeed's sequence parallelism (Ulysses) is not driven by accel",
                    ));
                }
            }
            "sp_backend"
            | "sp_seq_length"
            | "sp_seq_length_is_variable"
            | "sp_attn_implementation" => {}
            _ => {
                return Err(ctx.wrong(
                    "is not a parallelism_config key accel knows (dp_replicate_size, \
                     dp_shard_size, tp_size, cp_size, cp_comm_strategy, sp_*)",
                ))
            }
        }
    }
    Ok(())
}

fn is_default(key: &str, value: &Yaml) -> bool {
    match value {
        Yaml::Null | Yaml::BadValue => true,
        Yaml::Boolean(b) => !b,
        Yaml::Hash(h) => h.is_empty(),
        Yaml::Array(a) => a.is_empty(),
        Yaml::String(s) => match key {
            "gpu_ids" => s == "all",
            "downcast_bf16" => s == "no",
            "dynamo_backend" => s.eq_ignore_ascii_case("no"),
            _ => s.is_empty(),
        },
        _ => false,
    }
}

/// A value as it reads in a message.
fn show(v: &Yaml) -> String {
    match v {
        Yaml::String(s) | Yaml::Real(s) => s.clone(),
        Yaml::Integer(n) => n.to_string(),
        Yaml::Boolean(b) => b.to_string(),
        Yaml::Null => "null".into(),
        Yaml::Hash(h) => {
            let keys: Vec<String> = h.keys().map(show).collect();
            format!("a mapping of {}", keys.join(", "))
        }
        Yaml::Array(a) => format!("a list of {}", a.len()),
        _ => format!("{v:?}"),
    }
}

struct Ctx<'a> {
    path: &'a Path,
    key: &'a str,
}

impl Ctx<'_> {
    fn wrong(&self, why: &str) -> Error {
        Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "Accelerate's config file {}: key `{}` {why}",
                self.path.display(),
                self.key
            ),
        )
    }

    /// `key: value` is valid for Accelerate but accel cannot honour it.
    fn refuse(&self, value: &str, why: &str) -> Error {
        Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "Accelerate's config file {}: `{}: {value}` has no counterpart in accel launch: \
                 {why}",
                self.path.display(),
                self.key
            ),
        )
        .with_fix(format!(
            "remove `{}` from the file (or set it to its default) to launch with accel",
            self.key
        ))
    }

    fn wrong_type(&self, want: &str, v: &Yaml) -> Error {
        self.wrong(&format!("must be {want}, not `{}`", show(v)))
    }

    fn integer(&self, v: &Yaml) -> Result<i64> {
        v.as_i64().ok_or_else(|| self.wrong_type("an integer", v))
    }

    fn parsed(
        &self,
        n: i64,
        parse: fn(&str) -> std::result::Result<usize, String>,
    ) -> Result<usize> {
        parse(&n.to_string()).map_err(|why| self.wrong(&why))
    }

    /// YAML 1.2's true/false, and the yes/no/on/off PyYAML also reads
    /// as booleans (YAML 1.1).
    fn boolean(&self, v: &Yaml) -> Result<bool> {
        if let Some(b) = v.as_bool() {
            return Ok(b);
        }
        match v.as_str().map(str::to_ascii_lowercase).as_deref() {
            Some("true" | "yes" | "on") => Ok(true),
            Some("false" | "no" | "off") => Ok(false),
            _ => Err(self.wrong_type("true or false", v)),
        }
    }

    fn string(&self, v: &Yaml) -> Result<String> {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| self.wrong_type("a string", v))
    }

    /// A string, or nothing for null.
    fn opt_string(&self, v: &Yaml) -> Result<Option<String>> {
        match v {
            Yaml::Null => Ok(None),
            v => self.string(v).map(Some),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel::train::MixedPrecision;

    fn p() -> &'static Path {
        Path::new("default_config.yaml")
    }

    fn err(text: &str) -> String {
        parse(text, p()).unwrap_err().to_string()
    }

    /// What `accelerate config` writes for two machines of 4 GPUs.
    const MULTI_GPU: &str = "\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 1
main_process_ip: 10.0.0.1
main_process_port: 29501
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
";

    #[test]
    fn a_multi_gpu_config_maps_to_the_launch_options() {
        let c = parse(MULTI_GPU, p()).unwrap();
        let o = &c.options;
        assert_eq!(o.total_processes, Some(8), "Accelerate counts all machines");
        assert_eq!((o.num_machines, o.machine_rank), (Some(2.into()), Some(1)));
        assert_eq!(o.main_process_ip.as_deref(), Some("10.0.0.1"));
        assert_eq!(o.main_process_port, Some(29501));
        assert_eq!(o.mixed_precision, Some(MixedPrecision::Bf16));
        assert!(!o.debug && o.backend.is_none() && c.env.is_empty());
    }

    #[test]
    fn the_parallelism_config_section_gives_the_mesh_sizes() {
        let text = format!(
            "{MULTI_GPU}parallelism_config:\n  parallelism_config_dp_replicate_size: 1\n  \
             parallelism_config_dp_shard_size: 2\n  parallelism_config_tp_size: 4\n  \
             parallelism_config_cp_size: 1\n  parallelism_config_cp_comm_strategy: allgather\n"
        );
        let o = parse(&text, p()).unwrap().options;
        assert_eq!(
            (o.pc_dp_replicate, o.pc_dp_shard, o.pc_tp, o.pc_cp),
            (Some(1), Some(2), Some(4), Some(1))
        );
        // Empty, or null: nothing.
        let o = parse(&format!("{MULTI_GPU}parallelism_config: {{}}\n"), p())
            .unwrap()
            .options;
        assert_eq!((o.pc_dp_shard, o.pc_tp), (None, None));
        for (section, says) in [
            (
                "{parallelism_config_tp_size: 0}",
                "parallelism_config.parallelism_config_tp_size",
            ),
            (
                "{parallelism_config_pp_size: 2}",
                "not a parallelism_config key",
            ),
            ("{parallelism_config_sp_size: 2}", "sequence parallelism"),
            ("{parallelism_config_tp_size: two}", "must be an integer"),
            ("[1, 2]", "must be a mapping"),
        ] {
            let e = err(&format!("{MULTI_GPU}parallelism_config: {section}\n"));
            assert!(e.contains(says), "{section}: {e}");
        }
    }

    #[test]
    fn cpu_debug_accumulation_and_the_old_fp16_key() {
        let c = parse(
            "{distributed_type: MULTI_CPU, num_processes: 4, use_cpu: true, debug: true, \
             fp16: true, gradient_accumulation_steps: 4, num_machines: 1}",
            p(),
        )
        .unwrap();
        assert_eq!(c.options.backend, Some(Backends(vec!["cpu-gloo".into()])));
        assert_eq!(c.options.mixed_precision, Some(MixedPrecision::Fp16));
        assert_eq!(c.options.gradient_accumulation_steps, Some(4));
        assert!(c.options.debug);
        assert!(c
            .env
            .contains(&("ACCELERATE_USE_CPU".into(), "True".into())));
        assert!(c
            .env
            .contains(&("ACCELERATE_DEBUG_MODE".into(), "true".into())));
        // NO is one process; -1 is "not given".
        let c = parse("distributed_type: 'NO'\nnum_processes: -1\n", p()).unwrap();
        assert_eq!(c.options.total_processes, Some(1));
    }

    #[test]
    fn keys_accel_cannot_honour_are_refused_naming_the_key_and_why() {
        let cases: &[(&str, &[&str])] = &[
            (
                "distributed_type: DEEPSPEED",
                &["`distributed_type: DEEPSPEED`", "DeepSpeed", "--sharding"],
            ),
            ("distributed_type: FSDP", &["FSDP", "--sharding full"]),
            ("distributed_type: XLA", &["torch_xla"]),
            (
                "distributed_type: MULTI_GPU\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n",
                &["`fsdp_config: a mapping of fsdp_sharding_strategy`", "FSDP"],
            ),
            (
                "distributed_type: MULTI_GPU\ngpu_ids: 0,1\n",
                &["`gpu_ids: 0,1`", "CUDA_VISIBLE_DEVICES"],
            ),
            (
                "distributed_type: MULTI_GPU\ndynamo_config:\n  dynamo_backend: INDUCTOR\n",
                &["dynamo_config", "torch.compile"],
            ),
            (
                "distributed_type: MULTI_GPU\nenable_cpu_affinity: true\n",
                &["enable_cpu_affinity", "numactl"],
            ),
            (
                "distributed_type: MULTI_GPU\nrdzv_backend: etcd\n",
                &["`rdzv_backend: etcd`", "hosts the rendezvous"],
            ),
            (
                "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: DATA_PARALLEL\n",
                &["AMAZON_SAGEMAKER", "SageMaker"],
            ),
            (
                "distributed_type: MULTI_GPU\nmixed_precision: fp8\n",
                &["`mixed_precision`", "fp8"],
            ),
            (
                "distributed_type: MULTI_GPU\nnum_procs: 2\n",
                &["unknown key `num_procs`"],
            ),
            ("num_processes: 2\n", &["no `distributed_type`"]),
            (
                "distributed_type: 'NO'\nnum_processes: 2\n",
                &["is NO (one process), but num_processes is 2"],
            ),
            (
                "distributed_type: MULTI_GPU\nnum_processes: two\n",
                &["`num_processes` must be an integer, not `two`"],
            ),
            (
                "distributed_type: MULTI_GPU\ngradient_accumulation_steps: 0\n",
                &["`gradient_accumulation_steps`", "at least 1"],
            ),
            ("distributed_type: [", &["not valid YAML"]),
            ("", &["is empty"]),
        ];
        for (yaml, says) in cases {
            let m = err(yaml);
            assert!(
                says.iter().all(|s| m.contains(s)) && m.contains("default_config.yaml"),
                "{yaml}: {m}"
            );
        }
        // The same keys at their defaults say nothing.
        parse(
            "distributed_type: MULTI_GPU\nfsdp_config: {}\ndeepspeed_config: {}\ngpu_ids: all\n\
             dynamo_config: {}\ndowncast_bf16: 'no'\ntpu_name: null\ncommands: []\n",
            p(),
        )
        .unwrap();
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// A config `accelerate config` wrote, cut and spliced anywhere:
        /// mapped or refused naming the file, never a panic.
        #[test]
        fn any_edit_of_a_config_is_mapped_or_refused_never_a_crash(
            cut in 0usize..MULTI_GPU.len(),
            insert in proptest::sample::select(vec![
                "", ":", "- ", "{", "[", "'", "\"", "\n  ", "&a ", "*a", "!!int ", "? ", "\t",
                "num_processes: 99999999999999999999\n", "distributed_type: [1]\n",
            ]),
            keep in 0usize..MULTI_GPU.len(),
        ) {
            let mut text = MULTI_GPU[..cut].to_string();
            text.push_str(insert);
            text.push_str(&MULTI_GPU[cut.min(keep)..]);
            if let Err(e) = parse(&text, p()) {
                proptest::prop_assert!(e.to_string().contains("default_config.yaml"), "{e}");
            }
        }
    }

    #[test]
    fn deep_nesting_is_refused_not_a_stack_overflow() {
        let deep = format!(
            "distributed_type: MULTI_GPU\nfsdp_config: {}",
            "[".repeat(100_000)
        );
        let m = err(&deep);
        assert!(m.contains("default_config.yaml"), "{m}");
    }

    #[test]
    fn yaml_json_and_toml_files_are_told_apart_by_name() {
        for (name, acc) in [
            ("a.yaml", true),
            ("a.YML", true),
            ("a.json", true),
            ("accel.toml", false),
            ("config", false),
        ] {
            assert_eq!(is_accelerate_config(Path::new(name)), acc, "{name}");
        }
    }
}
