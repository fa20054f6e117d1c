// Post hooks on the gradient accumulators of leaf tensors, the hooks torch
// DDP's Reducer registers: each calls back into Rust with the tensor's index
// once autograd has accumulated that tensor's gradient for the running
// backward. Compiled by build.rs against the headers of the libtorch tch
// links; no exception crosses the C boundary.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "shim.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;
using Ready = void (*)(const void* ctx, size_t index);

// Runs after the AccumulateGrad node of one tensor: its .grad is final.
class ReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(Ready ready, const void* ctx, size_t index) : ready_(ready), ctx_(ctx), index_(index) {}

  variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
    // The Rust side never unwinds (it catches panics).
    ready_(ctx_, index_);
    return outputs;
  }

 private:
  Ready ready_;
  const void* ctx_;
  size_t index_;
};

// The armed hooks, each with the accumulator it is on (held, so the node
// cannot be replaced while the hook is armed); the destructor removes them.
struct Armed {
  std::vector<std::pair<c10::intrusive_ptr<Node>, uintptr_t>> hooks;

  ~Armed() {
    for (auto& [node, key] : hooks) {
      node->del_post_hook(key);
    }
  }
};

}  // namespace

extern "C" {

// Arm one post hook on the gradient accumulator of each of the n tensors
// (at::Tensor*, leaves that require a gradient): the hook of tensors[i]
// calls ready(ctx, i). Returns the armed set for accel_tch_grad_hooks_disarm,
// or null with a message in err (nothing armed then).
void* accel_tch_grad_hooks_arm(const void* const* tensors, size_t n, Ready ready, const void* ctx,
                               char* err, size_t err_len) {
  try {
    auto armed = std::make_unique<Armed>();
    armed->hooks.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const auto& t = *static_cast<const at::Tensor*>(tensors[i]);
      auto node = torch::autograd::impl::grad_accumulator(t);
      if (!node) {
        throw std::invalid_argument("tensor " + std::to_string(i) +
                                    " does not require a gradient (no gradient accumulator)");
      }
      auto key = node->add_post_hook(std::make_unique<ReadyHook>(ready, ctx, i));
      armed->hooks.emplace_back(std::move(node), key);
    }
    return armed.release();
  } catch (const std::exception& e) {
    accel_shim::write_error(err, err_len, e.what());
  } catch (...) {
    accel_shim::write_error(err, err_len, "an unknown C++ exception");
  }
  return nullptr;
}

// Remove the hooks of a set armed by accel_tch_grad_hooks_arm and free it.
void accel_tch_grad_hooks_disarm(void* armed) {
  try {
    delete static_cast<Armed*>(armed);
  } catch (...) {
  }
}

// The post hooks on the gradient accumulator of a tensor (at::Tensor*): 0
// when it has none, -1 on an error.
int64_t accel_tch_grad_post_hooks(const void* tensor) {
  try {
    auto node = torch::autograd::impl::try_get_grad_accumulator(*static_cast<const at::Tensor*>(tensor));
    return node ? static_cast<int64_t>(node->post_hooks().size()) : 0;
  } catch (...) {
    return -1;
  }
}

// Set the gradient of a tensor (at::Tensor*) to none, as torch's
// zero_grad(set_to_none=True): autograd allocates it again at the next
// backward. 0, or -1 on an error.
int accel_tch_grad_to_none(const void* tensor) {
  try {
    static_cast<const at::Tensor*>(tensor)->mutable_grad().reset();
    return 0;
  } catch (...) {
    return -1;
  }
}

}  // extern "C"
