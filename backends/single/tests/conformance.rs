//! The conformance suite on the single backend, in this process.

use std::sync::Arc;

#[test]
fn the_suite_passes_on_one_rank() {
    accel_conformance::assert_conformance(Arc::new(accel_backend_single::BACKEND), &[1], None);
}
