//! Find the worker program before spawning anything, so that a typo is one
//! clear error instead of N identical spawn failures.

use std::ffi::{OsStr, OsString};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Why the program cannot be started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProgramError {
    /// No such file (a path), or nothing of that name on PATH.
    NotFound(String),
    /// The file exists but cannot be executed.
    NotExecutable(String),
}

impl ProgramError {
    /// The shell's exit code for this error (127 not found, 126 not
    /// executable).
    pub fn exit_code(&self) -> u8 {
        match self {
            ProgramError::NotFound(_) => 127,
            ProgramError::NotExecutable(_) => 126,
        }
    }
}

impl std::fmt::Display for ProgramError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProgramError::NotFound(m) | ProgramError::NotExecutable(m) => f.write_str(m),
        }
    }
}

fn is_executable(p: &Path) -> std::result::Result<(), String> {
    let meta = std::fs::metadata(p).map_err(|e| e.to_string())?;
    if meta.is_dir() {
        return Err("it is a directory".into());
    }
    let mode = meta.permissions().mode();
    if mode & 0o111 == 0 {
        return Err(format!(
            "it has no execute permission (mode {:o})",
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Resolve `program` as `execvp` would: a name with a `/` is a path, any
/// other name is looked up in `path_var` (the PATH the workers get).
///
/// # Errors
/// [`ProgramError`] naming the program and what to do.
pub fn resolve(program: &OsStr, path_var: Option<&OsStr>) -> Result<PathBuf, ProgramError> {
    let shown = program.to_string_lossy();
    if program.is_empty() {
        return Err(ProgramError::NotFound(
            "no program given: write it after `--`, e.g. `accel launch -n 2 -- ./train`".into(),
        ));
    }
    if shown.contains('/') {
        let p = PathBuf::from(program);
        if !p.exists() {
            return Err(ProgramError::NotFound(format!(
                "program `{shown}` not found: no such file"
            )));
        }
        return match is_executable(&p) {
            Ok(()) => Ok(p),
            Err(why) => Err(ProgramError::NotExecutable(format!(
                "program `{shown}` is not executable: {why} (fix: chmod +x {shown}, or run it through its interpreter)"
            ))),
        };
    }
    let path_var: OsString = path_var
        .map(OsStr::to_os_string)
        .unwrap_or_else(|| OsString::from("/usr/local/bin:/usr/bin:/bin"));
    let mut not_exec: Option<(PathBuf, String)> = None;
    for dir in std::env::split_paths(&path_var) {
        let dir = if dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            dir
        };
        let cand = dir.join(program);
        if cand.exists() {
            match is_executable(&cand) {
                Ok(()) => return Ok(cand),
                Err(why) => {
                    not_exec.get_or_insert((cand, why));
                }
            }
        }
    }
    match not_exec {
        Some((p, why)) => Err(ProgramError::NotExecutable(format!(
            "program `{shown}` found at {} is not executable: {why}",
            p.display()
        ))),
        None => Err(ProgramError::NotFound(format!(
            "program `{shown}` not found on PATH (fix: check the spelling, give a path like ./{shown}, or extend PATH)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_on_path_and_names_what_is_missing() {
        assert!(resolve(OsStr::new("sh"), None).is_ok());
        let e = resolve(OsStr::new("no-such-program-xyz"), None).unwrap_err();
        assert!(e
            .to_string()
            .contains("`no-such-program-xyz` not found on PATH"));
        assert_eq!(e.exit_code(), 127);
        let e = resolve(OsStr::new("./no/such"), None).unwrap_err();
        assert!(e.to_string().contains("`./no/such` not found"));
    }

    #[test]
    fn refuses_files_without_execute_bit() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("script.sh");
        std::fs::write(&f, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = resolve(f.as_os_str(), None).unwrap_err();
        assert!(e.to_string().contains("is not executable"), "{e}");
        assert!(e.to_string().contains("mode 644"), "{e}");
        assert_eq!(e.exit_code(), 126);
        let e = resolve(OsStr::new("script.sh"), Some(dir.path().as_os_str())).unwrap_err();
        assert!(e.to_string().contains("is not executable"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            resolve(OsStr::new("script.sh"), Some(dir.path().as_os_str())).unwrap(),
            f
        );
    }
}
