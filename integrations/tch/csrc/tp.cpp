// Megatron's two tensor-parallel collectives as libtorch autograd functions
// (torch::autograd::Function, what a Python torch.autograd.Function is in
// C++), each summing over a group through a Rust callback:
//   f (copy to tp):      forward x unchanged, backward the gradient summed;
//   g (reduce from tp):  forward x summed, backward the gradient unchanged.
// The group is an opaque Rust handle owned by a Group, which the autograd
// node keeps until it is destroyed (release is called once, then). No
// exception crosses the C boundary; an error in backward is a C++ exception
// that libtorch's backward turns into tch's error.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>

#include "shim.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
// Sums the tensor (at::Tensor*) over the group in place: 0, or non-zero
// with a NUL-terminated message in err.
using Reduce = int (*)(const void* group, void* tensor, char* err, size_t err_len);
using Release = void (*)(void* group);

class Group final : public torch::CustomClassHolder {
 public:
  Group(void* handle, Reduce reduce, Release release) : handle_(handle), reduce_(reduce), release_(release) {}
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  ~Group() override { release_(handle_); }

  // The sum over the group of a contiguous copy of t.
  at::Tensor sum(const at::Tensor& t) const {
    at::Tensor out = t.contiguous().clone();
    char err[1024] = {0};
    if (reduce_(handle_, &out, err, sizeof err) != 0) {
      throw std::runtime_error(err[0] != '\0' ? err : "the tensor-parallel all-reduce failed");
    }
    return out;
  }

 private:
  void* handle_;
  Reduce reduce_;
  Release release_;
};

c10::intrusive_ptr<Group> group_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<Group>(ctx->saved_data["group"].toCapsule());
}

struct CopyToTp : public torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<Group> group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(group));
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx)->sum(grads[0]), at::Tensor()};
  }
};

struct ReduceFromTp : public torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext* /*ctx*/, const at::Tensor& x, c10::intrusive_ptr<Group> group) {
    return group->sum(x);
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

extern "C" {

// f (kind 0) or g (kind 1) applied to x (at::Tensor*): a new at::Tensor* the
// caller owns, or null with a message in err. The group handle is owned
// from here on: release(group) is called exactly once, when the last user
// (this call, or the autograd node it made) is done with it.
void* accel_tch_tp_apply(const void* x, int kind, void* group, Reduce reduce, Release release, char* err,
                         size_t err_len) {
  c10::intrusive_ptr<Group> owned;
  try {
    owned = c10::make_intrusive<Group>(group, reduce, release);
  } catch (...) {
    release(group);
    accel_shim::write_error(err, err_len, "out of memory");
    return nullptr;
  }
  try {
    const auto& t = *static_cast<const at::Tensor*>(x);
    at::Tensor out = kind == 0 ? CopyToTp::apply(t, std::move(owned)) : ReduceFromTp::apply(t, std::move(owned));
    return new at::Tensor(std::move(out));
  } catch (const std::exception& e) {
    accel_shim::write_error(err, err_len, e.what());
  } catch (...) {
    accel_shim::write_error(err, err_len, "an unknown C++ exception");
  }
  return nullptr;
}

}  // extern "C"
