//! The facade's face (ADR 0034): `accel::` exports the user API, an
//! explicit list, and the engine kit only as `accel::kit`. Absence cannot be
//! checked at compile time, so these tests read `lib.rs` (and the macros
//! exported from any file) and compare the root's public names with a fixed
//! list, and with the names of `accel_api::kit`.

use std::collections::BTreeSet;
use std::path::Path;

/// Every public name at `accel::`'s root. Adding one is adding user API:
/// a name for engine authors goes under `accel_api::kit` instead.
const ALLOWED: &[&str] = &[
    // The runtime and its modules.
    "Accelerator",
    "CollectivesExt",
    "DebugCommunicator",
    "DebugLayer",
    "Entry",
    "ErrorRecord",
    "KNOWN_BACKENDS",
    "LaunchSource",
    "Origin",
    "PluginFailure",
    "ProbeRow",
    "ProcessModel",
    "ProcessState",
    "Registry",
    "Scalar",
    "Threads",
    "WorkerEnv",
    "cuda_nccl",
    "debug_communicator",
    "env_check",
    "flight",
    "install_panic_hook",
    "mesh",
    "rank_eprintln",
    "rank_println",
    "rendezvous",
    "run",
    "stall",
    "state",
    "thread_rank",
    "threads",
    "tie_to_launcher",
    "train",
    "watch",
    "worker_env",
    "write_error_file",
    "zero",
    // accel-api's user contracts.
    "Availability",
    "Backend",
    "Buf",
    "BufMut",
    "CallCheck",
    "CallInfo",
    "Capabilities",
    "CasOutcome",
    "Communicator",
    "CommunicatorExt",
    "ConnectContext",
    "DType",
    "Device",
    "DeviceBuf",
    "DeviceBufMut",
    "DeviceKind",
    "Element",
    "Error",
    "ErrorKind",
    "HostBuf",
    "HostBufMut",
    "Layer",
    "Layered",
    "MismatchEntry",
    "OffloadStore",
    "Op",
    "Probe",
    "ProbeContext",
    "ReduceOp",
    "Result",
    "Store",
    "StoreExt",
    "TensorMeta",
    "Wrapper",
    "bf16",
    "f16",
    "with_dtype",
    "with_float",
    "worker",
    // Work in flight (ADR 0033): the handles a program holds, and the
    // module of the call a started handle owns.
    "HostBytes",
    "OwnedBuf",
    "Pending",
    "StartExt",
    "Work",
    "work",
    // The engine kit, as a module only.
    "kit",
];

fn src(crate_dir: &str, file: &str) -> String {
    let path = Path::new(crate_dir).join("src").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The text without `//` comments.
fn code(text: &str) -> String {
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The names a `use` tree brings in: each leaf, or its `as` alias.
fn use_names(tree: &str, out: &mut BTreeSet<String>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let inner = &tree[open + 1..tree.rfind('}').expect("a closed use list")];
        let (mut depth, mut start) = (0, 0);
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    use_names(&inner[start..i], out);
                    start = i + 1;
                }
                _ => {}
            }
        }
        use_names(&inner[start..], out);
        return;
    }
    if tree.is_empty() {
        return;
    }
    assert!(
        !tree.ends_with('*'),
        "`pub use {tree}` at accel's root: a glob cannot be checked; list the names"
    );
    let name = match tree.split_once(" as ") {
        Some((_, alias)) => alias.trim(),
        None => tree.rsplit("::").next().unwrap_or(tree),
    };
    out.insert(name.to_string());
}

/// The public names a file declares or re-exports at its module's root.
fn root_names(text: &str) -> BTreeSet<String> {
    let text = code(text);
    let mut names = BTreeSet::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("pub use ") {
        let stmt = &rest[at + "pub use ".len()..];
        let end = stmt.find(';').expect("a `pub use` ends with `;`");
        use_names(&stmt[..end], &mut names);
        rest = &stmt[end..];
    }
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() != Some(&"pub") {
            continue; // `pub(crate)` and private items are not the face
        }
        let kinds = [
            "mod", "fn", "struct", "enum", "trait", "type", "const", "static",
        ];
        if let (Some(kind), Some(name)) = (words.get(1), words.get(2)) {
            if kinds.contains(kind) {
                let name: String = name
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                names.insert(name);
            }
        }
    }
    names
}

/// Macros exported from any file of `src/`: they land at the root.
fn exported_macros(dir: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            exported_macros(&path, out);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = code(&std::fs::read_to_string(&path).unwrap());
        let mut exported = false;
        for line in text.lines().map(str::trim) {
            if line == "#[macro_export]" {
                exported = true;
            } else if let Some(rest) = line.strip_prefix("macro_rules! ") {
                if exported {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    out.insert(name);
                }
                exported = false;
            } else if !line.starts_with("#[") && !line.starts_with("///") && !line.is_empty() {
                exported = false;
            }
        }
    }
}

fn accel_root() -> BTreeSet<String> {
    let dir = env!("CARGO_MANIFEST_DIR");
    let mut names = root_names(&src(dir, "lib.rs"));
    exported_macros(&Path::new(dir).join("src"), &mut names);
    names
}

#[test]
fn the_root_exports_exactly_the_allowed_names() {
    let found = accel_root();
    let allowed: BTreeSet<String> = ALLOWED.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        allowed.len(),
        ALLOWED.len(),
        "a name listed twice in ALLOWED"
    );
    let appeared: Vec<_> = found.difference(&allowed).collect();
    assert!(
        appeared.is_empty(),
        "accel:: exports {appeared:?}, not in face.rs's ALLOWED: a name for engine authors \
         goes under accel_api::kit (ADR 0034); a user name is added to ALLOWED"
    );
    let gone: Vec<_> = allowed.difference(&found).collect();
    assert!(
        gone.is_empty(),
        "accel:: no longer exports {gone:?}: removing user API breaks programs; if meant, \
         take the names out of face.rs's ALLOWED"
    );
}

#[test]
fn no_kit_name_is_at_the_root() {
    let api = Path::new(env!("CARGO_MANIFEST_DIR")).join("../accel-api");
    let kit = root_names(&src(api.to_str().unwrap(), "kit.rs"));
    assert!(
        kit.len() >= 25 && kit.contains("Engine") && kit.contains("StaticBackend"),
        "read too few kit names: {kit:?}"
    );
    let root = accel_root();
    let leaked: Vec<_> = kit.intersection(&root).collect();
    assert!(
        leaked.is_empty(),
        "kit names at accel::'s root: {leaked:?}; engine authors reach them as accel::kit::X"
    );
    let api_root = root_names(&src(api.to_str().unwrap(), "lib.rs"));
    let leaked: Vec<_> = kit.intersection(&api_root).collect();
    assert!(
        leaked.is_empty(),
        "kit names at accel_api's root: {leaked:?}; they belong under accel_api::kit only"
    );
}

#[test]
fn the_reader_sees_what_it_must() {
    let mut names = BTreeSet::new();
    use_names("a::{b, c::{d as e, f}, g as h}", &mut names);
    let want: BTreeSet<String> = ["b", "e", "f", "h"].map(String::from).into();
    assert_eq!(names, want);
    let names =
        root_names("pub use x::Y;\npub(crate) fn hidden() {}\npub mod m;\n// pub fn no()\n");
    let want: BTreeSet<String> = ["Y", "m"].map(String::from).into();
    assert_eq!(names, want);
}
