// libtorch's per-device autocast switches, which tch's C API does not expose
// (tch::autocast drives the CUDA one only). Compiled by build.rs against the
// headers of the libtorch tch links; no exception crosses the C boundary.
#include <ATen/autocast_mode.h>

namespace {
c10::DeviceType device_of(int cuda) { return cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU; }
}  // namespace

extern "C" {

// Enable autocast on the CPU (cuda == 0) or CUDA (cuda != 0) with bf16
// (half == 0) or f16 (half != 0). Stores the previous state in *prev_enabled
// and *prev_dtype. Returns 0, or -1 when libtorch refused.
int accel_tch_autocast_enter(int cuda, int half, int* prev_enabled, int* prev_dtype) {
  try {
    auto dev = device_of(cuda);
    *prev_enabled = at::autocast::is_autocast_enabled(dev) ? 1 : 0;
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(dev));
    at::autocast::set_autocast_dtype(dev, half ? at::kHalf : at::kBFloat16);
    at::autocast::set_autocast_enabled(dev, true);
    at::autocast::increment_nesting();
    return 0;
  } catch (...) {
    return -1;
  }
}

// Undo accel_tch_autocast_enter with the state it stored. Returns 0 or -1.
int accel_tch_autocast_exit(int cuda, int prev_enabled, int prev_dtype) {
  try {
    auto dev = device_of(cuda);
    if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
    at::autocast::set_autocast_enabled(dev, prev_enabled != 0);
    at::autocast::set_autocast_dtype(dev, static_cast<at::ScalarType>(prev_dtype));
    return 0;
  } catch (...) {
    return -1;
  }
}

// Whether autocast is on for the device (1), off (0), or unknown (-1).
int accel_tch_autocast_enabled(int cuda) {
  try {
    return at::autocast::is_autocast_enabled(device_of(cuda)) ? 1 : 0;
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
