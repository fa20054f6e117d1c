//! `load_plugins_from_env` reads ACCEL_PLUGIN_PATH. Its own test binary, so
//! that setting the variable races with no other test.

#[path = "plugins/common.rs"]
mod common;

use accel_plugin::{load_plugins_from_env, PLUGIN_PATH_ENV};

#[test]
fn reads_accel_plugin_path() {
    common::with_plugins(|p| {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("libmissing.so");
        let list = std::env::join_paths([p.vendor.clone(), missing.clone()]).unwrap();
        std::env::set_var(PLUGIN_PATH_ENV, &list);
        let reports = load_plugins_from_env();
        assert_eq!(reports.len(), 2, "{reports:?}");
        assert_eq!(reports[0].backend().unwrap().name(), "vendor-single");
        assert_eq!(reports[1].path, missing);
        assert!(reports[1].error().is_some());
        std::env::remove_var(PLUGIN_PATH_ENV);
        assert!(load_plugins_from_env().is_empty());
    });
}
