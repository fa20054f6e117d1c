//! Reading a demo's flags: `--flag VALUE` pairs and bare switches, with
//! the same messages in every demo.

use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;

/// A demo's `main`: `parse` the command line (without the program name);
/// when it does not parse, print the message and exit with 2; else `run`
/// the settings, and exit with 1 after printing `"{demo}: {error}"` when
/// that fails.
pub fn main<T>(
    demo: &str,
    parse: impl FnOnce(&[String]) -> Result<T, String>,
    run: impl FnOnce(T) -> accel::Result<()>,
) -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let settings = match parse(&args) {
        Ok(s) => s,
        Err(m) => {
            eprintln!("{m}");
            return ExitCode::from(2);
        }
    };
    match run(settings) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{demo}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Read the command line `args` (without the program name) flag by flag:
/// `own(flag, flags)` reads a flag (and its value from `flags`) and says
/// whether it knew it. `-h`/`--help` and any flag it did not know end the
/// reading with `usage` (after naming the unknown one).
///
/// # Errors
/// `own`'s, or the usage as above.
pub fn read_flags(
    args: &[String],
    usage: &str,
    mut own: impl FnMut(&str, &mut Flags<'_>) -> Result<bool, String>,
) -> Result<(), String> {
    let mut flags = Flags::new(args);
    while let Some(flag) = flags.next_flag() {
        if !own(flag, &mut flags)? {
            return Err(match flag {
                "-h" | "--help" => usage.to_string(),
                other => format!("unknown argument {other:?}\n{usage}"),
            });
        }
    }
    Ok(())
}

/// The arguments of a command line, read flag by flag.
#[derive(Debug)]
pub struct Flags<'a> {
    it: std::slice::Iter<'a, String>,
}

impl<'a> Flags<'a> {
    /// Read `args` (without the program name).
    pub fn new(args: &'a [String]) -> Flags<'a> {
        Flags { it: args.iter() }
    }

    /// The next flag; `None` after the last.
    pub fn next_flag(&mut self) -> Option<&'a str> {
        self.it.next().map(String::as_str)
    }

    /// The value that follows `flag`.
    ///
    /// # Errors
    /// `"{flag} needs a value"` after the last argument.
    pub fn value(&mut self, flag: &str) -> Result<String, String> {
        self.it
            .next()
            .cloned()
            .ok_or_else(|| format!("{flag} needs a value"))
    }

    /// The value that follows `flag`, as a path.
    ///
    /// # Errors
    /// As [`value`](Self::value).
    pub fn path(&mut self, flag: &str) -> Result<PathBuf, String> {
        self.value(flag).map(PathBuf::from)
    }

    /// The value that follows `flag`, as a number.
    ///
    /// # Errors
    /// As [`value`](Self::value), or `"{flag}: \"...\" is not a valid
    /// number"`.
    pub fn num<T: FromStr>(&mut self, flag: &str) -> Result<T, String> {
        let v = self.value(flag)?;
        v.parse()
            .map_err(|_| format!("{flag}: {v:?} is not a valid number"))
    }

    /// The value that follows `flag`, parsed with `T`'s own message.
    ///
    /// # Errors
    /// As [`value`](Self::value), or `"{flag}: {T's error}"`.
    pub fn parsed<T>(&mut self, flag: &str) -> Result<T, String>
    where
        T: FromStr,
        T::Err: std::fmt::Display,
    {
        self.value(flag)?
            .parse()
            .map_err(|e| format!("{flag}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn flags_values_and_their_messages() {
        let a = args(&["--epochs", "3", "--lr", "x", "--data"]);
        let mut f = Flags::new(&a);
        assert_eq!(f.next_flag(), Some("--epochs"));
        assert_eq!(f.num::<u64>("--epochs"), Ok(3));
        assert_eq!(f.next_flag(), Some("--lr"));
        assert_eq!(
            f.num::<f64>("--lr"),
            Err("--lr: \"x\" is not a valid number".to_string())
        );
        assert_eq!(f.next_flag(), Some("--data"));
        assert_eq!(f.path("--data"), Err("--data needs a value".to_string()));
        assert_eq!(f.next_flag(), None);
    }

    #[test]
    fn read_flags_stops_at_help_and_at_an_unknown_flag() {
        let mut seen = Vec::new();
        let mut own = |flag: &str, flags: &mut Flags<'_>| {
            let known = flag == "--lr";
            if known {
                seen.push(flags.num::<f64>(flag)?);
            }
            Ok(known)
        };
        assert_eq!(
            read_flags(&args(&["--lr", "0.5"]), "USAGE", &mut own),
            Ok(())
        );
        assert_eq!(
            read_flags(&args(&["-h"]), "USAGE", &mut own),
            Err("USAGE".into())
        );
        assert_eq!(
            read_flags(&args(&["--lr", "1", "--nope"]), "USAGE", &mut own),
            Err("unknown argument \"--nope\"\nUSAGE".into())
        );
        assert_eq!(seen, vec![0.5, 1.0]);
    }
}
