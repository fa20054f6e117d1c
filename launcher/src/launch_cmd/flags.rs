//! Words after `accel launch` that are no flag of its: torchrun's and
//! accelerate launch's flags it does not take (and why), and near misses
//! of its own flags ("did you mean").

use accel_api::{Error, ErrorKind};

use super::LaunchArgs;

/// Levenshtein distance, for "did you mean".
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// torchrun's and accelerate launch's flags that `accel launch` does not
/// take, and why (docs/torch.md has the whole table).
const NOT_MAPPED: &[(&str, &str)] = &[
    (
        "rdzv-timeout",
        "use --join-timeout for the machines' join and --timeout for every blocking call",
    ),
    (
        "start-method",
        "accel always starts workers as new processes (fork and exec)",
    ),
    (
        "role",
        "accel runs one role; ROLE_RANK and ROLE_WORLD_SIZE equal RANK and WORLD_SIZE",
    ),
    (
        "local-addr",
        "machines are addressed through --master-addr only",
    ),
    (
        "local-ranks-filter",
        "use --ranks to choose whose output is shown",
    ),
    (
        "logs-specs",
        "use --tee DIR (or --log-dir DIR) to write each rank's output to DIR/rank-N.log",
    ),
    ("max-restarts-per-node", "use --max-restarts"),
    (
        "multi-gpu",
        "accel launches one process per -n; devices follow LOCAL_RANK",
    ),
    (
        "cpu",
        "accel launches -n processes on CPU backends already (choose one with --backend); \
         an Accelerate script that must not use a GPU needs ACCELERATE_USE_CPU=1 in its \
         environment (or `use_cpu: true` in the Accelerate config file accel reads)",
    ),
    (
        "use-deepspeed",
        "accel has its own ZeRO (--sharding); DeepSpeed is not driven",
    ),
    ("use-fsdp", "use --sharding full (ZeRO stage 3)"),
    (
        "dynamo-backend",
        "torch.compile settings are the program's own",
    ),
];

/// A "program" that starts with `-` is a flag `accel launch` does not know
/// (clap hands everything after the first unknown word to the program):
/// say so, with the closest known flag.
pub(super) fn unknown_flag(word: &std::ffi::OsStr) -> Option<Error> {
    let w = word.to_string_lossy();
    if !w.starts_with('-') || w == "-" {
        return None;
    }
    let name = w.trim_start_matches('-');
    let name = name.split_once('=').map_or(name, |(n, _)| n);
    if let Some((_, why)) = NOT_MAPPED
        .iter()
        .find(|(f, _)| f.replace('_', "-") == name.replace('_', "-"))
    {
        return Some(
            Error::new(
                ErrorKind::InvalidArgument,
                format!("`{w}` (torchrun's or accelerate launch's) has no counterpart in `accel launch`"),
            )
            .with_fix(why.to_string()),
        );
    }
    let cmd = <LaunchArgs as clap::Args>::augment_args(clap::Command::new("launch"));
    let mut known: Vec<String> = Vec::new();
    for a in cmd.get_arguments() {
        if let Some(l) = a.get_long() {
            known.push(l.to_string());
        }
        known.extend(
            a.get_all_aliases()
                .unwrap_or_default()
                .into_iter()
                .map(str::to_string),
        );
    }
    let best = known
        .iter()
        .map(|k| (distance(&name.replace('_', "-"), &k.replace('_', "-")), k))
        .min();
    // Only near misses (a typo), never a flag that merely shares a word.
    let hint = match best {
        Some((d, k)) if d <= 2.min(name.len() / 3) => format!("did you mean `--{k}`? "),
        _ => String::new(),
    };
    Some(
        Error::new(
            ErrorKind::InvalidArgument,
            format!("`{w}` is not a flag of `accel launch`"),
        )
        .with_fix(format!(
            "{hint}see `accel launch --help`; put the program after `--` (a program whose name \
             starts with `-` needs a path, like ./{w})"
        )),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accelerates_cpu_flag_is_refused_naming_what_an_accelerate_script_needs() {
        let e = unknown_flag(std::ffi::OsStr::new("--cpu")).expect("refused");
        let text = e.to_string();
        assert!(text.contains("`--cpu`"), "{text}");
        assert!(text.contains("ACCELERATE_USE_CPU=1"), "{text}");
        assert!(unknown_flag(std::ffi::OsStr::new("prog.py")).is_none());
    }
}
