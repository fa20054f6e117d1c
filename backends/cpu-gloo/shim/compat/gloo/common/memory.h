// Stand-in for <gloo/common/memory.h>, which Gloo's tcp/{context,pair,
// unbound_buffer}.h include but Debian's libgloo-dev (0.0~git20220518)
// does not install. build.rs adds this folder to the include path only when
// the real header is missing.
//
// The shim derives from gloo::transport::tcp::UnboundBuffer (GuardedBuffer
// in gloo_shim.cc), so these types must have the layout of Gloo's: one
// std::shared_ptr (ShareableNonOwningPtr, NonOwningPtr) or std::weak_ptr
// (WeakNonOwningPtr) each. The shim calls none of their members; Gloo's
// own code (compiled against the real header) constructs and destroys them.
#pragma once

#include <memory>

namespace gloo {

template <typename T>
class ShareableNonOwningPtr;

template <typename T>
class WeakNonOwningPtr final {
 public:
  WeakNonOwningPtr() = default;
  explicit WeakNonOwningPtr(const ShareableNonOwningPtr<T>& p) : ptr_(p.ptr_) {}

 private:
  std::weak_ptr<T> ptr_;
};

template <typename T>
class ShareableNonOwningPtr final {
 public:
  explicit ShareableNonOwningPtr(T* t) : ptr_(t, [](T*) {}) {}
  ShareableNonOwningPtr(const ShareableNonOwningPtr&) = delete;
  ShareableNonOwningPtr& operator=(const ShareableNonOwningPtr&) = delete;

 private:
  std::shared_ptr<T> ptr_;
  friend class WeakNonOwningPtr<T>;
};

template <typename T>
class NonOwningPtr final {
 public:
  NonOwningPtr() = default;

 private:
  std::shared_ptr<T> ptr_;
};

}  // namespace gloo
