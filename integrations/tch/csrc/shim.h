// What the shim's C entry points share.
#pragma once

#include <cstddef>
#include <cstring>

namespace accel_shim {

// Copy msg into the caller's buffer err of len bytes, cut to fit and
// NUL-terminated (nothing when there is no buffer).
inline void write_error(char* err, size_t len, const char* msg) {
  if (err == nullptr || len == 0) {
    return;
  }
  std::strncpy(err, msg, len - 1);
  err[len - 1] = '\0';
}

}  // namespace accel_shim
