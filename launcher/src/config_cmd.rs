//! `accel config`: write a launch config file from flags, or by asking.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use accel_api::{Error, ErrorKind, Result};

use crate::launch_cmd::config::{self, KEYS};
use crate::launch_cmd::options::Options;
use accel_launch::store::random_hex;

/// Arguments of `accel config`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  accel config -n 4 --max-restarts 2 -o train.toml\n  \
                        accel config --interactive\n  \
                        accel launch --config train.toml -- ./train"
)]
pub struct ConfigArgs {
    #[command(flatten)]
    options: Options,

    /// File to write (`-` for stdout).
    #[arg(short = 'o', long, default_value = "accel.toml", value_name = "FILE")]
    output: PathBuf,

    /// Replace an existing file.
    #[arg(long)]
    force: bool,

    /// Ask for each key (the default when no option is given and stdin is a
    /// terminal).
    #[arg(long, short = 'i')]
    interactive: bool,

    /// Put a freshly generated random token in the file (for runs over
    /// several machines: copy the file to each of them).
    #[arg(long)]
    generate_token: bool,
}

fn is_integer(ty: &str) -> bool {
    ty.starts_with("integer")
}

fn is_bool(ty: &str) -> bool {
    ty == "boolean"
}

/// One answer as a TOML value for `key` of type `ty`.
fn toml_value(ty: &str, answer: &str) -> String {
    let quoted = || toml::Value::String(answer.to_string()).to_string();
    if is_integer(ty) {
        // Not a number: quoted, so that the message is about the type.
        match answer.parse::<i64>() {
            Ok(n) => n.to_string(),
            Err(_) => quoted(),
        }
    } else if is_bool(ty) {
        match answer.to_ascii_lowercase().as_str() {
            "y" | "yes" | "true" | "1" | "on" => "true".into(),
            "n" | "no" | "false" | "0" | "off" => "false".into(),
            _ => quoted(), // reported as a wrong type
        }
    } else {
        toml::Value::String(answer.to_string()).to_string()
    }
}

/// Ask for every key on `input`, showing `current` values as defaults.
fn ask(current: Options, input: &mut dyn BufRead, out: &mut dyn Write) -> Result<Options> {
    let io = |e| Error::io("cannot talk to the terminal", e);
    let current_text = config::render(&current);
    let current_value = |key: &str| -> Option<String> {
        current_text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key} = ")).map(str::to_string))
    };
    writeln!(
        out,
        "accel config: press Enter to keep the value in brackets (or leave the key unset)."
    )
    .map_err(io)?;
    let mut lines = Vec::new();
    for (key, ty, doc) in KEYS {
        loop {
            let shown = current_value(key).unwrap_or_default();
            write!(out, "{doc} ({key}, {ty}) [{shown}]: ").map_err(io)?;
            out.flush().map_err(io)?;
            let mut answer = String::new();
            let n = input.read_line(&mut answer).map_err(io)?;
            let answer = answer.trim();
            let line = if answer.is_empty() {
                current_value(key).map(|v| format!("{key} = {v}"))
            } else {
                Some(format!("{key} = {}", toml_value(ty, answer)))
            };
            match &line {
                Some(l) => match config::parse(l, Path::new("<answer>")) {
                    Ok(_) => {
                        lines.push(l.clone());
                        break;
                    }
                    Err(e) if n > 0 => {
                        writeln!(out, "  {e}; try again").map_err(io)?;
                    }
                    Err(e) => return Err(e),
                },
                None => break,
            }
            if n == 0 {
                break;
            }
        }
    }
    config::parse(&lines.join("\n"), Path::new("<answers>"))
}

/// Run `accel config`.
///
/// # Errors
/// An existing file without `--force`, I/O errors, bad answers at EOF.
pub fn run(args: ConfigArgs) -> Result<ExitCode> {
    let mut o = args.options.clone();
    if args.generate_token {
        o.token = Some(random_hex(16)?);
    }
    let interactive = args.interactive
        || (o == Options::default() && std::io::stdin().is_terminal() && !args.generate_token);
    if interactive {
        let stdin = std::io::stdin();
        let mut input = stdin.lock();
        let mut out = std::io::stderr();
        o = ask(o, &mut input, &mut out)?;
    }
    let text = config::render(&o);
    if args.output.as_os_str() == "-" {
        out!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
    if args.output.exists() && !args.force {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("{} already exists", args.output.display()),
        )
        .with_op("accel config")
        .with_fix("pass --force to replace it, or -o another file"));
    }
    std::fs::write(&args.output, text)
        .map_err(|e| Error::io(format!("cannot write {}", args.output.display()), e))?;
    eprintln!(
        "accel: wrote {}; use it with `accel launch --config {} -- PROGRAM ARGS...`",
        args.output.display(),
        args.output.display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asking_validates_each_answer() {
        // num_processes: first a bad answer, then 4; num_machines: default;
        // ...; debug: yes; the rest: Enter (EOF).
        let mut answers = String::from("four\n4\n\n\n\n\n\n\n90s\nyes\n");
        answers.push_str(&"\n".repeat(KEYS.len()));
        let mut input = std::io::Cursor::new(answers.into_bytes());
        let mut out = Vec::new();
        let o = ask(Options::default(), &mut input, &mut out).unwrap();
        assert_eq!(o.num_processes, Some(4));
        assert_eq!(o.timeout, Some(std::time::Duration::from_secs(90)));
        assert!(o.debug);
        assert_eq!(o.num_machines, None);
        let shown = String::from_utf8(out).unwrap();
        assert!(shown.contains("must be an integer"), "{shown}");
    }

    #[test]
    fn current_values_are_the_defaults() {
        let current = Options {
            max_restarts: Some(2),
            ..Options::default()
        };
        let mut input = std::io::Cursor::new(Vec::new());
        let mut out = Vec::new();
        let o = ask(current, &mut input, &mut out).unwrap();
        assert_eq!(o.max_restarts, Some(2));
    }
}
