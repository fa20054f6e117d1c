//! cuda-nccl at world size 1 on a real GPU, on device buffers (and host
//! buffers through staging). Without a usable GPU every test prints why it
//! is skipped and passes, unless `ACCEL_REQUIRE_GPU=1` (what
//! `scripts/gpu_check.sh` sets), which turns the skip into a failure.

mod common;

use std::time::Duration;

use accel_backend_cuda_nccl::__test::NcclCommunicator;
use accel_backend_cuda_nccl::inspect;

/// The world communicator on cuda:0, or `None` (skip) without a GPU.
fn world() -> Option<NcclCommunicator> {
    if let Some(why) = inspect().unavailable {
        assert!(
            std::env::var("ACCEL_REQUIRE_GPU").as_deref() != Ok("1"),
            "ACCEL_REQUIRE_GPU=1 but cuda-nccl is unavailable: {why}"
        );
        accel_test_support::skips::skip_absent_hardware(&format!("no usable GPU: {why}"));
        return None;
    }
    Some(common::connect_one(Duration::from_secs(60)))
}

/// One `#[test]` per shared case, each on its own world communicator.
macro_rules! gpu_tests {
    ($($name:ident => $case:path;)*) => {
        $(
            #[test]
            fn $name() {
                if let Some(c) = world() {
                    $case(&c);
                }
            }
        )*
    };
}

gpu_tests! {
    every_dtype_and_reduction_on_device_memory => common::every_dtype_and_reduction;
    data_movement_on_device_memory => common::data_movement;
    host_buffers_are_staged => common::host_buffers;
    cudarc_slices_are_device_views => common::cudarc_slices;
    split_and_abort => common::split_and_abort;
    started_calls_on_device_memory => common::started_calls;
}

/// The shared conformance suite, ranks as threads, at world size 1 (one
/// GPU: NCCL refuses two ranks on one device).
#[test]
fn the_conformance_suite_passes_at_world_size_1() {
    if world().is_some() {
        accel_conformance::assert_conformance(
            std::sync::Arc::new(accel_backend_cuda_nccl::BACKEND),
            &[1],
            None,
        );
    }
}
