use std::path::Path;

use accel_api::{ErrorKind, ProbeContext};
use accel_plugin::{load_plugin, load_plugin_paths, PluginOutcome};

use crate::common::{bounded, c_table, compile_c, with_plugins, TEST_LIMIT};
use crate::special_files::{mkfifo, timed};

/// Load `path`, expect a plugin error naming it (and `symbol`), return its
/// text.
fn expect_plugin_error(path: &Path, symbol: Option<&str>) -> String {
    let e = load_plugin(path).map(|_| ()).unwrap_err();
    match e.kind() {
        ErrorKind::Plugin { path: p, symbol: s } => {
            assert_eq!(p, path, "{e}");
            assert_eq!(s.as_deref(), symbol, "{e}");
        }
        other => panic!("expected a plugin error, got {other:?}: {e}"),
    }
    let text = e.to_string();
    assert!(text.contains(&*path.to_string_lossy()), "{text}");
    assert!(
        e.fix().is_some(),
        "every load error says what to do: {text}"
    );
    text
}

/// Compile the C `source` into the plugin file `name` of a fresh folder,
/// load it and expect a plugin error naming it and `symbol`; its text.
fn compiled_plugin_error(name: &str, source: &str, symbol: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = compile_c(dir.path(), name, source);
    expect_plugin_error(&path, Some(symbol))
}

#[test]
fn missing_file() {
    bounded(TEST_LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        let text = expect_plugin_error(&dir.path().join("libnothing.so"), None);
        assert!(text.contains("no such file"), "{text}");
    });
}

#[test]
fn a_directory_is_not_a_plugin() {
    bounded(TEST_LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        let text = expect_plugin_error(dir.path(), None);
        assert!(text.contains("is a directory"), "{text}");
    });
}

#[test]
fn not_a_shared_object() {
    bounded(TEST_LIMIT, || {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("libgarbage.so");
        std::fs::write(&path, b"this is not an ELF file at all, just text\n").unwrap();
        let text = expect_plugin_error(&path, None);
        assert!(text.contains("cannot load it as a shared object"), "{text}");
        // The loader's own words are included (glibc: "invalid ELF header"
        // or "file too short").
        assert!(text.contains("ELF") || text.contains("too short"), "{text}");
    });
}

#[test]
fn missing_entry_symbol() {
    bounded(TEST_LIMIT, || {
        let text = compiled_plugin_error(
            "libnotaplugin.so",
            "int not_a_plugin(void) { return 42; }\n",
            "accel_plugin_entry_v1",
        );
        assert!(
            text.contains("does not export `accel_plugin_entry_v1`"),
            "{text}"
        );
        assert!(text.contains("export_plugin!"), "{text}");
    });
}

#[test]
fn wrong_major_says_which_major_each_side_has() {
    bounded(TEST_LIMIT, || {
        let text = compiled_plugin_error(
            "libmajor99.so",
            &c_table("sizeof(struct table)", 99, 3),
            "accel_plugin_entry_v1",
        );
        assert!(
            text.contains("built for plugin ABI 99.3, but this host needs ABI major 1"),
            "{text}"
        );
    });
}

#[test]
fn a_table_smaller_than_abi_1_0() {
    bounded(TEST_LIMIT, || {
        let text =
            compiled_plugin_error("libshort.so", &c_table("16", 1, 0), "accel_plugin_entry_v1");
        assert!(
            text.contains(&format!(
                "table is 16 bytes, smaller than the {} bytes of ABI 1.0",
                accel_plugin::abi::min_size::PLUGIN
            )),
            "{text}"
        );
        let text =
            compiled_plugin_error("libtiny.so", &c_table("4", 1, 0), "accel_plugin_entry_v1");
        assert!(
            text.contains("too small to even hold the ABI header"),
            "{text}"
        );
    });
}

#[test]
fn a_null_table() {
    bounded(TEST_LIMIT, || {
        let text = compiled_plugin_error(
            "libnull.so",
            "const void *accel_plugin_entry_v1(void) { return 0; }\n",
            "accel_plugin_entry_v1",
        );
        assert!(text.contains("returned a null table"), "{text}");
    });
}

#[test]
fn null_entries_in_a_full_size_table() {
    bounded(TEST_LIMIT, || {
        // Right size, right version, every pointer null.
        let size = accel_plugin::abi::min_size::PLUGIN.to_string();
        let text = compiled_plugin_error("libhollow.so", &c_table(&size, 1, 7), "comm");
        assert!(text.contains("communicator table is null"), "{text}");
    });
}

#[test]
fn a_plugin_directory_with_good_and_broken_files() {
    with_plugins(|p| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(&p.vendor, dir.path().join("a-vendor.so")).unwrap();
        compile_c(
            dir.path(),
            "b-major99.so",
            &c_table("sizeof(struct table)", 99, 0),
        );
        std::fs::write(dir.path().join("c-garbage.so"), b"garbage").unwrap();
        std::fs::write(dir.path().join("README.txt"), b"not a plugin, ignored").unwrap();
        std::fs::create_dir(dir.path().join("nested.so")).unwrap();
        let missing = dir.path().join("gone/libmissing.so");

        let list = std::env::join_paths([
            dir.path().to_path_buf(),
            missing.clone(),
            // A file reached a second time is loaded once.
            dir.path().join("a-vendor.so"),
        ])
        .unwrap();
        let reports = load_plugin_paths(&list);
        let summary: Vec<String> = reports.iter().map(|r| r.to_string()).collect();
        assert_eq!(reports.len(), 4, "{summary:#?}");

        assert_eq!(reports[0].path, dir.path().join("a-vendor.so"));
        match &reports[0].outcome {
            PluginOutcome::Loaded { name, version, .. } => {
                assert_eq!(name, "vendor-single");
                assert_eq!(version, env!("CARGO_PKG_VERSION"));
            }
            PluginOutcome::Failed(e) => panic!("the good plugin failed: {e}"),
        }
        let backend = reports[0].backend().unwrap();
        assert!(backend
            .probe(&ProbeContext::single_process())
            .is_available());

        assert_eq!(reports[1].path, dir.path().join("b-major99.so"));
        let e = reports[1].error().expect("major 99 is refused");
        assert!(e.to_string().contains("ABI 99.0"), "{e}");
        assert!(summary[1].starts_with("skipped "), "{}", summary[1]);

        assert_eq!(reports[2].path, dir.path().join("c-garbage.so"));
        assert!(reports[2].error().is_some());

        assert_eq!(reports[3].path, missing);
        assert!(reports[3]
            .error()
            .unwrap()
            .to_string()
            .contains("no such file"));

        assert!(
            summary[0].starts_with("loaded plugin backend `vendor-single`"),
            "{}",
            summary[0]
        );
        // An empty list loads nothing.
        assert!(load_plugin_paths("").is_empty());
    });
}

#[test]
fn fifos_devices_and_links_out_of_a_plugin_directory_are_refused_at_once() {
    with_plugins(|p| {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("plugins");
        std::fs::create_dir(&dir).unwrap();
        if !mkfifo(&dir.join("a-fifo.so")) {
            return;
        }
        // The good plugin copied outside, reached by a link from inside.
        let outside = root.path().join("outside.so");
        std::fs::copy(&p.vendor, &outside).unwrap();
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/dev/zero", dir.join("b-zero.so")).unwrap();
            std::os::unix::fs::symlink(&outside, dir.join("c-out.so")).unwrap();
            std::fs::copy(&p.vendor, dir.join("d-real.so")).unwrap();
            std::os::unix::fs::symlink("d-real.so", dir.join("e-in.so")).unwrap();
        }
        let list = std::env::join_paths([dir.clone(), dir.join("a-fifo.so")]).unwrap();
        let (reports, took) = timed(move || load_plugin_paths(&list));
        let summary: Vec<String> = reports.iter().map(|r| r.to_string()).collect();
        println!("{summary:#?}");
        assert!(took < std::time::Duration::from_secs(1), "took {took:?}");
        let failed = |name: &str, why: &str| {
            let r = reports
                .iter()
                .find(|r| r.path == dir.join(name) && r.error().is_some())
                .unwrap_or_else(|| panic!("no failed report for {name}: {summary:#?}"));
            let e = r.error().unwrap();
            assert!(matches!(e.kind(), ErrorKind::Plugin { .. }), "{e}");
            assert!(
                e.to_string().contains(name) && e.to_string().contains(why),
                "{e}"
            );
        };
        failed("a-fifo.so", "FIFO");
        #[cfg(unix)]
        {
            failed("b-zero.so", "device");
            failed("c-out.so", "outside");
            // A link that stays inside is followed (and loads the same file once).
            assert!(reports
                .iter()
                .any(|r| r.path == dir.join("d-real.so") && r.backend().is_some()));
        }
    });
}
