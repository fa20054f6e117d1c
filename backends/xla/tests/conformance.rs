//! The conformance suite on xla: ranks as threads of this process, one PJRT
//! CPU device each, at world sizes 1 to 4 (skipped with the reason without
//! the plugin, failed under CI).

mod common;

#[test]
fn the_suite_passes_with_ranks_as_threads() {
    if !common::plugin_or_skip("the_suite_passes_with_ranks_as_threads") {
        return;
    }
    accel_conformance::assert_conformance(
        std::sync::Arc::new(accel_backend_xla::BACKEND),
        &[1, 2, 3, 4],
        None,
    );
}
