// Megatron's tensor-parallel collectives as libtorch autograd functions
// (torch::autograd::Function, what a Python torch.autograd.Function is in
// C++), each running its collective over a group through a Rust callback:
//   f (copy to tp):           forward x unchanged, backward the gradient summed;
//   g (reduce from tp):       forward x summed, backward the gradient unchanged;
// and the sequence-parallel ones, along dimension 0 (the sequence):
//   scatter to sp:            forward this rank's rows, backward all-gathered;
//   gather from sp:           forward all-gathered, backward reduce-scattered;
//   reduce-scatter to sp:     forward reduce-scattered, backward all-gathered.
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
// Runs collective op over the group from in to out (both at::Tensor*,
// contiguous, out allocated by the caller): 0 sums out in place (in is
// out), 1 all-gathers in's rows into out, 2 reduce-scatters in's rows
// (summed) into out. 0, or non-zero with a NUL-terminated message in err.
using Collective = int (*)(const void* group, int op, const void* in, void* out, char* err, size_t err_len);
using Release = void (*)(void* group);

class Group final : public torch::CustomClassHolder {
 public:
  Group(void* handle, int64_t size, int64_t rank, Collective run, Release release)
      : handle_(handle), size_(size), rank_(rank), run_(run), release_(release) {}
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  ~Group() override { release_(handle_); }

  // The sum over the group of a contiguous copy of t.
  at::Tensor sum(const at::Tensor& t) const {
    at::Tensor out = t.clone(at::MemoryFormat::Contiguous);
    run(0, out, out);
    return out;
  }

  // Every rank's rows of t, in rank order, along dimension 0.
  at::Tensor gather_rows(const at::Tensor& t) const {
    at::Tensor in = t.contiguous();
    auto sizes = in.sizes().vec();
    sizes.at(0) *= size_;
    at::Tensor out = at::empty(sizes, in.options());
    run(1, in, out);
    return out;
  }

  // This rank's rows of the sum over the group of t.
  at::Tensor reduce_scatter_rows(const at::Tensor& t) const {
    at::Tensor in = t.contiguous();
    auto sizes = in.sizes().vec();
    sizes.at(0) = rows(in) / size_;
    at::Tensor out = at::empty(sizes, in.options());
    run(2, in, out);
    return out;
  }

  // This rank's rows of t.
  at::Tensor my_rows(const at::Tensor& t) const {
    int64_t n = rows(t) / size_;
    return t.narrow(0, rank_ * n, n).contiguous();
  }

 private:
  // t's rows, which must split evenly over the group.
  int64_t rows(const at::Tensor& t) const {
    if (t.dim() == 0 || t.size(0) % size_ != 0) {
      throw std::invalid_argument("sequence parallel: a tensor of shape " + c10::str(t.sizes()) +
                                  " does not split its first dimension (the sequence) evenly over " +
                                  std::to_string(size_) + " tensor-parallel ranks");
    }
    return t.size(0);
  }

  void run(int op, const at::Tensor& in, at::Tensor& out) const {
    char err[1024] = {0};
    if (run_(handle_, op, &in, &out, err, sizeof err) != 0) {
      throw std::runtime_error(err[0] != '\0' ? err : "a tensor-parallel collective failed");
    }
  }

  void* handle_;
  int64_t size_;
  int64_t rank_;
  Collective run_;
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

struct ScatterToSp : public torch::autograd::Function<ScatterToSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<Group> group) {
    at::Tensor out = group->my_rows(x);
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(group));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx)->gather_rows(grads[0]), at::Tensor()};
  }
};

struct GatherFromSp : public torch::autograd::Function<GatherFromSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<Group> group) {
    at::Tensor out = group->gather_rows(x);
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(group));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx)->reduce_scatter_rows(grads[0]), at::Tensor()};
  }
};

struct ReduceScatterToSp : public torch::autograd::Function<ReduceScatterToSp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::intrusive_ptr<Group> group) {
    at::Tensor out = group->reduce_scatter_rows(x);
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(group));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {group_of(ctx)->gather_rows(grads[0]), at::Tensor()};
  }
};

at::Tensor apply_kind(int kind, const at::Tensor& t, c10::intrusive_ptr<Group> g) {
  switch (kind) {
    case 0:
      return CopyToTp::apply(t, std::move(g));
    case 1:
      return ReduceFromTp::apply(t, std::move(g));
    case 2:
      return ScatterToSp::apply(t, std::move(g));
    case 3:
      return GatherFromSp::apply(t, std::move(g));
    case 4:
      return ReduceScatterToSp::apply(t, std::move(g));
    default:
      throw std::invalid_argument("no tensor-parallel function of kind " + std::to_string(kind));
  }
}

}  // namespace

extern "C" {

// f (kind 0), g (1), scatter to sp (2), gather from sp (3) or reduce-scatter
// to sp (4) applied to x (at::Tensor*) over a group of size ranks, this one
// rank: a new at::Tensor* the caller owns, or null with a message in err.
// The group handle is owned from here on: release(group) is called exactly
// once, when the last user (this call, or the autograd node it made) is
// done with it.
void* accel_tch_tp_apply(const void* x, int kind, void* group, int64_t size, int64_t rank, Collective run,
                         Release release, char* err, size_t err_len) {
  c10::intrusive_ptr<Group> owned;
  try {
    owned = c10::make_intrusive<Group>(group, size, rank, run, release);
  } catch (...) {
    release(group);
    accel_shim::write_error(err, err_len, "out of memory");
    return nullptr;
  }
  try {
    const auto& t = *static_cast<const at::Tensor*>(x);
    at::Tensor out = apply_kind(kind, t, std::move(owned));
    return new at::Tensor(std::move(out));
  } catch (const std::exception& e) {
    accel_shim::write_error(err, err_len, e.what());
  } catch (...) {
    accel_shim::write_error(err, err_len, "an unknown C++ exception");
  }
  return nullptr;
}

}  // extern "C"
