//! The launch config file: TOML, one key per long flag of `accel launch`
//! (`num_processes = 4`, `main_process_ip = "10.0.0.1"`, `timeout = "90s"`).
//!
//! Keys may be spelled with `_` or `-`. Unknown keys and values of the wrong
//! type are errors that name the key and the file.

use std::path::{Path, PathBuf};
use std::time::Duration;

use accel_api::{Error, ErrorKind, Result};

use super::options::{
    format_dur, parse_count, parse_dur, parse_index, parse_machines, parse_steps, Options, TeeArg,
};

/// Every key the file may hold, with the type it takes (for messages and for
/// the commented template `accel config` writes).
pub const KEYS: &[(&str, &str, &str)] = &[
    (
        "num_processes",
        "integer >= 1",
        "worker processes on each machine",
    ),
    (
        "num_machines",
        "integer >= 1, or \"MIN:MAX\"",
        "machines in the run (MIN:MAX: elastic)",
    ),
    (
        "machine_rank",
        "integer >= 0",
        "rank of this machine (0 hosts the store)",
    ),
    ("main_process_ip", "string", "address of machine 0"),
    (
        "main_process_port",
        "integer 0-65535",
        "port of the store on machine 0",
    ),
    ("token", "string", "shared secret of the store"),
    (
        "backend",
        "string or array of strings",
        "backend(s) for the workers",
    ),
    (
        "timeout",
        "duration (\"90s\") or seconds",
        "bound of every blocking call",
    ),
    ("debug", "boolean", "debug mode in the workers"),
    (
        "mixed_precision",
        "string: no, bf16 or fp16",
        "mixed precision of the workers' training loop",
    ),
    (
        "sharding",
        "string: none, optimizer, gradients or full",
        "ZeRO sharding stage of the workers' training loop",
    ),
    (
        "gradient_accumulation_steps",
        "integer >= 1",
        "batches per optimizer step where the program leaves it at 1",
    ),
    (
        "tee",
        "string (directory)",
        "also write rank-N.log files there (alias: log_dir)",
    ),
    (
        "ranks",
        "string (\"0,2-3\") or array of integers",
        "show only these ranks' output",
    ),
    ("quiet_ranks", "boolean", "show only rank 0's output"),
    (
        "max_restarts",
        "integer >= 0",
        "restarts of the group after a failure",
    ),
    (
        "grace_period",
        "duration or seconds",
        "SIGTERM to SIGKILL delay",
    ),
    (
        "hang_timeout",
        "duration or seconds",
        "silence after which a worker is hung",
    ),
    (
        "join_timeout",
        "duration or seconds",
        "how long machines wait for each other",
    ),
    (
        "join_window",
        "duration or seconds",
        "elastic runs: how long a round stays open once MIN machines joined",
    ),
    ("run_id", "string", "name of the run"),
];

/// Read and check the config file at `path`.
///
/// # Errors
/// [`ErrorKind::Io`] when it cannot be read; [`ErrorKind::InvalidConfig`]
/// for TOML syntax errors, unknown keys and wrong types, naming the key.
pub fn read(path: &Path) -> Result<Options> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::io(format!("cannot read the config file {}", path.display()), e)
            .with_fix("check the path given to --config (or ACCEL_CONFIG_FILE)")
    })?;
    parse(&text, path)
}

/// Parse config text; `path` is only used in messages.
///
/// # Errors
/// As [`read`].
pub fn parse(text: &str, path: &Path) -> Result<Options> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "config file {} is not valid TOML: {}",
                path.display(),
                e.message()
            ),
        )
        .with_fix("see `accel config --help` for the format")
    })?;
    let mut o = Options::default();
    for (raw_key, value) in &table {
        let key = raw_key.replace('-', "_");
        let ctx = Ctx { path, key: raw_key };
        match key.as_str() {
            "num_processes" => o.num_processes = Some(ctx.int_with(value, parse_count)?),
            "num_machines" => {
                o.num_machines = Some(match value {
                    toml::Value::String(v) => parse_machines(v).map_err(|why| ctx.wrong(&why))?,
                    _ => ctx.int_with(value, parse_count)?.into(),
                })
            }
            "machine_rank" => o.machine_rank = Some(ctx.int_with(value, parse_index)?),
            "main_process_ip" => o.main_process_ip = Some(ctx.string(value)?),
            "main_process_port" => {
                let p = ctx.integer(value)?;
                o.main_process_port = Some(u16::try_from(p).map_err(|_| {
                    ctx.wrong(&format!("must be a port between 0 and 65535, got {p}"))
                })?);
            }
            "token" => o.token = Some(ctx.string(value)?),
            "backend" => {
                let s = ctx.string_or_list(value)?;
                o.backend = Some(s.parse().map_err(|why: String| ctx.wrong(&why))?);
            }
            "timeout" => o.timeout = Some(ctx.duration(value)?),
            "debug" => o.debug = ctx.boolean(value)?,
            "mixed_precision" => {
                let s = ctx.string(value)?;
                o.mixed_precision = Some(s.parse().map_err(|e: Error| ctx.wrong(e.message()))?);
            }
            "sharding" | "zero_stage" => {
                let s = ctx.string(value)?;
                o.sharding = Some(s.parse().map_err(|e: Error| ctx.wrong(e.message()))?);
            }
            "gradient_accumulation_steps" => {
                o.gradient_accumulation_steps = Some(ctx.int_with(value, parse_steps)?)
            }
            "tee" | "log_dir" => o.tee = Some(TeeArg::Dir(PathBuf::from(ctx.string(value)?))),
            "ranks" => {
                let s = ctx.string_or_list(value)?;
                o.ranks = Some(s.parse().map_err(|why: String| ctx.wrong(&why))?);
            }
            "quiet_ranks" => o.quiet_ranks = ctx.boolean(value)?,
            "max_restarts" => {
                let n = ctx.integer(value)?;
                o.max_restarts = Some(
                    u32::try_from(n)
                        .map_err(|_| ctx.wrong(&format!("must be 0 or more, got {n}")))?,
                );
            }
            "grace_period" => o.grace_period = Some(ctx.duration(value)?),
            "hang_timeout" => o.hang_timeout = Some(ctx.duration(value)?),
            "join_timeout" => o.join_timeout = Some(ctx.duration(value)?),
            "join_window" => o.join_window = Some(ctx.duration(value)?),
            "run_id" => o.run_id = Some(ctx.string(value)?),
            _ => {
                let known: Vec<&str> = KEYS.iter().map(|k| k.0).collect();
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!("config file {}: unknown key `{raw_key}`", path.display()),
                )
                .with_fix(format!("known keys: {}", known.join(", "))));
            }
        }
    }
    Ok(o)
}

struct Ctx<'a> {
    path: &'a Path,
    key: &'a str,
}

fn type_name(v: &toml::Value) -> &'static str {
    match v {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a float",
        toml::Value::Boolean(_) => "a boolean",
        toml::Value::Datetime(_) => "a date",
        toml::Value::Array(_) => "an array",
        toml::Value::Table(_) => "a table",
    }
}

impl Ctx<'_> {
    fn wrong(&self, why: &str) -> Error {
        Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "config file {}: key `{}` {why}",
                self.path.display(),
                self.key
            ),
        )
    }

    fn wrong_type(&self, want: &str, v: &toml::Value) -> Error {
        self.wrong(&format!("must be {want}, not {} ({v})", type_name(v)))
    }

    fn integer(&self, v: &toml::Value) -> Result<i64> {
        v.as_integer()
            .ok_or_else(|| self.wrong_type("an integer", v))
    }

    fn int_with(
        &self,
        v: &toml::Value,
        parse: fn(&str) -> std::result::Result<usize, String>,
    ) -> Result<usize> {
        let n = self.integer(v)?;
        parse(&n.to_string()).map_err(|why| self.wrong(&why))
    }

    fn string(&self, v: &toml::Value) -> Result<String> {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| self.wrong_type("a string", v))
    }

    fn boolean(&self, v: &toml::Value) -> Result<bool> {
        v.as_bool()
            .ok_or_else(|| self.wrong_type("a boolean (true or false)", v))
    }

    fn string_or_list(&self, v: &toml::Value) -> Result<String> {
        match v {
            toml::Value::String(s) => Ok(s.clone()),
            toml::Value::Array(items) => {
                let mut parts = Vec::new();
                for i in items {
                    match i {
                        toml::Value::String(s) => parts.push(s.clone()),
                        toml::Value::Integer(n) => parts.push(n.to_string()),
                        other => return Err(self.wrong_type("a string or an integer", other)),
                    }
                }
                Ok(parts.join(","))
            }
            other => Err(self.wrong_type("a string or an array", other)),
        }
    }

    fn duration(&self, v: &toml::Value) -> Result<Duration> {
        let s = match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(n) => n.to_string(),
            toml::Value::Float(f) => f.to_string(),
            other => {
                return Err(
                    self.wrong_type("a duration such as \"90s\" or a number of seconds", other)
                )
            }
        };
        parse_dur(&s).map_err(|why| self.wrong(&format!("= {s:?}: {why}")))
    }
}

/// Render `o` as a config file: the keys that are set, then the others
/// commented out, each with its meaning.
pub fn render(o: &Options) -> String {
    let mut set: Vec<(&str, toml::Value)> = Vec::new();
    let s = |v: &str| toml::Value::String(v.to_string());
    let i = |v: i64| toml::Value::Integer(v);
    if let Some(v) = o.num_processes {
        set.push(("num_processes", i(v as i64)));
    }
    if let Some(v) = o.num_machines {
        set.push((
            "num_machines",
            if v.min == v.max {
                i(v.max as i64)
            } else {
                s(&v.to_string())
            },
        ));
    }
    if let Some(v) = o.machine_rank {
        set.push(("machine_rank", i(v as i64)));
    }
    if let Some(v) = &o.main_process_ip {
        set.push(("main_process_ip", s(v)));
    }
    if let Some(v) = o.main_process_port {
        set.push(("main_process_port", i(i64::from(v))));
    }
    if let Some(v) = &o.token {
        set.push(("token", s(v)));
    }
    if let Some(v) = &o.backend {
        set.push(("backend", s(&v.to_string())));
    }
    if let Some(v) = o.timeout {
        set.push(("timeout", s(&format_dur(v))));
    }
    if o.debug {
        set.push(("debug", toml::Value::Boolean(true)));
    }
    if let Some(m) = o.mixed_precision {
        set.push(("mixed_precision", s(m.name())));
    }
    if let Some(z) = o.sharding {
        set.push(("sharding", s(z.as_str())));
    }
    if let Some(v) = o.gradient_accumulation_steps {
        set.push(("gradient_accumulation_steps", i(v as i64)));
    }
    if let Some(TeeArg::Dir(v)) = &o.tee {
        set.push(("tee", s(&v.to_string_lossy())));
    }
    if let Some(v) = &o.ranks {
        set.push(("ranks", s(&v.to_string())));
    }
    if o.quiet_ranks {
        set.push(("quiet_ranks", toml::Value::Boolean(true)));
    }
    if let Some(v) = o.max_restarts {
        set.push(("max_restarts", i(i64::from(v))));
    }
    if let Some(v) = o.grace_period {
        set.push(("grace_period", s(&format_dur(v))));
    }
    if let Some(v) = o.hang_timeout {
        set.push(("hang_timeout", s(&format_dur(v))));
    }
    if let Some(v) = o.join_timeout {
        set.push(("join_timeout", s(&format_dur(v))));
    }
    if let Some(v) = o.join_window {
        set.push(("join_window", s(&format_dur(v))));
    }
    if let Some(v) = &o.run_id {
        set.push(("run_id", s(v)));
    }
    let mut out = String::from(
        "# accel launch configuration: `accel launch --config THIS_FILE -- PROGRAM ARGS...`\n\
         # Flags given to `accel launch` override these values.\n\n",
    );
    for (key, ty, doc) in KEYS {
        match set.iter().find(|(k, _)| k == key) {
            Some((_, v)) => out.push_str(&format!("# {doc} ({ty})\n{key} = {v}\n")),
            None => out.push_str(&format!("# {doc} ({ty})\n# {key} =\n")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("accel.toml")
    }

    fn err(text: &str) -> String {
        parse(text, p()).unwrap_err().to_string()
    }

    #[test]
    fn reads_every_key() {
        let o = parse(
            r#"
            num_processes = 4
            num-machines = 2
            machine_rank = 1
            main_process_ip = "10.0.0.1"
            main_process_port = 29501
            token = "s3cret"
            backend = ["cpu-gloo", "mpi"]
            timeout = 90
            debug = true
            mixed_precision = "bf16"
            log_dir = "logs"
            ranks = [0, 2]
            quiet_ranks = true
            max_restarts = 2
            grace_period = "500ms"
            hang_timeout = "10m"
            join_timeout = 1.5
            join_window = "3s"
            run_id = "exp1"
            "#,
            p(),
        )
        .unwrap();
        assert_eq!(o.num_processes, Some(4));
        assert_eq!(o.num_machines, Some(2.into()));
        assert_eq!(o.machine_rank, Some(1));
        assert_eq!(o.main_process_port, Some(29501));
        assert_eq!(o.backend.unwrap().0, vec!["cpu-gloo", "mpi"]);
        assert_eq!(o.timeout, Some(Duration::from_secs(90)));
        assert!(o.debug && o.quiet_ranks);
        assert_eq!(o.mixed_precision, Some(accel::train::MixedPrecision::Bf16));
        assert_eq!(o.tee, Some(TeeArg::Dir(PathBuf::from("logs"))));
        assert_eq!(o.ranks.unwrap().to_string(), "0,2");
        assert_eq!(o.grace_period, Some(Duration::from_millis(500)));
        assert_eq!(o.join_timeout, Some(Duration::from_millis(1500)));
        assert_eq!(o.join_window, Some(Duration::from_secs(3)));
        assert_eq!(o.run_id.as_deref(), Some("exp1"));
    }

    #[test]
    fn unknown_keys_and_wrong_types_name_the_key() {
        let m = err("num_procs = 2");
        assert!(
            m.contains("unknown key `num_procs`") && m.contains("accel.toml"),
            "{m}"
        );
        assert!(m.contains("num_processes"), "{m}");
        let cases: [(&str, &[&str]); 7] = [
            (
                "num_processes = \"four\"",
                &["key `num_processes` must be an integer, not a string"],
            ),
            ("num_processes = 0", &["`num_processes`", "at least 1"]),
            ("mixed_precision = \"fp8\"", &["`mixed_precision`", "fp8"]),
            ("debug = 1", &["`debug` must be a boolean"]),
            (
                "main_process_port = 70000",
                &["`main_process_port`", "70000"],
            ),
            ("timeout = \"soon\"", &["`timeout`", "soon"]),
            ("num_processes = ", &["not valid TOML"]),
        ];
        for (toml, says) in cases {
            let m = err(toml);
            assert!(says.iter().all(|s| m.contains(s)), "{toml}: {m}");
        }
    }

    #[test]
    fn render_reads_back() {
        let o = Options {
            num_processes: Some(8),
            main_process_ip: Some("10.1.2.3".into()),
            timeout: Some(Duration::from_millis(2500)),
            backend: Some("cpu-gloo".parse().unwrap()),
            debug: true,
            mixed_precision: Some(accel::train::MixedPrecision::Fp16),
            gradient_accumulation_steps: Some(4),
            ranks: Some("0-1".parse().unwrap()),
            num_machines: Some(super::super::options::MachineCount { min: 2, max: 4 }),
            join_window: Some(Duration::from_secs(3)),
            ..Options::default()
        };
        let text = render(&o);
        assert!(text.contains("num_machines = \"2:4\""), "{text}");
        assert!(text.contains("# max_restarts ="), "{text}");
        assert_eq!(parse(&text, p()).unwrap(), o);
    }
}
