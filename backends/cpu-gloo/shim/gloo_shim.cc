// accel-backend-cpu-gloo: the C++ side of the Gloo boundary.
//
// Rules of this file:
// * every exported function is wrapped in `guarded`, which catches every
//   exception (gloo::IoException, gloo::Exception, gloo::EnforceNotMet, which
//   is not a gloo::Exception, std::exception, and anything else) and turns it
//   into a status code plus a message: nothing is ever thrown into Rust;
// * the shim holds no global state; all state lives in the handles.

#include "gloo_shim.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/config.h>
#include <gloo/context.h>
#include <gloo/gather.h>
#include <gloo/math.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/buffer.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/pair.h>
#include <gloo/transport/tcp/unbound_buffer.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

namespace {

// Thrown by the store adapter when a Rust callback failed. The Rust side
// keeps the real error (with its kind: timeout, lost store server, ...).
struct StoreFailure : public std::runtime_error {
  explicit StoreFailure(const std::string& what) : std::runtime_error(what) {}
};

// Thrown by the shim's own argument checks.
struct ArgFailure : public std::runtime_error {
  explicit ArgFailure(const std::string& what) : std::runtime_error(what) {}
};

void write_msg(char* err, size_t cap, const char* prefix, const char* what) {
  if (err == nullptr || cap == 0) {
    return;
  }
  std::snprintf(err, cap, "%s%s", prefix, what == nullptr ? "" : what);
}

template <typename F>
int guarded(char* err, size_t cap, F&& f) noexcept {
  if (err != nullptr && cap > 0) {
    err[0] = '\0';
  }
  try {
    f();
    return ACCEL_GLOO_OK;
  } catch (const StoreFailure& e) {
    write_msg(err, cap, "", e.what());
    return ACCEL_GLOO_E_STORE;
  } catch (const ArgFailure& e) {
    write_msg(err, cap, "", e.what());
    return ACCEL_GLOO_E_ARG;
  } catch (const gloo::IoException& e) {
    write_msg(err, cap, "", e.what());
    return ACCEL_GLOO_E_IO;
  } catch (const gloo::Exception& e) {
    write_msg(err, cap, "", e.what());
    return ACCEL_GLOO_E_GLOO;
  } catch (const gloo::EnforceNotMet& e) {
    write_msg(err, cap, "", e.what());
    return ACCEL_GLOO_E_ENFORCE;
  } catch (const std::exception& e) {
    write_msg(err, cap, "", e.what());
    return ACCEL_GLOO_E_STD;
  } catch (...) {
    write_msg(err, cap, "", "unknown C++ exception");
    return ACCEL_GLOO_E_UNKNOWN;
  }
}

// A gloo::rendezvous::Store whose operations call back into Rust, which
// forwards them to the accel_api::Store of the communicator (with its key
// prefix and deadline). It remembers what it set, so that this rank's
// advertised listening addresses can be read back after the connection.
class CallbackStore : public gloo::rendezvous::Store {
 public:
  explicit CallbackStore(const accel_gloo_store_vtable& vt) : vt_(vt) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    set_values_[key] = data;
    int rc = vt_.set(vt_.user, key.data(), key.size(),
                     reinterpret_cast<const uint8_t*>(data.data()), data.size());
    if (rc != 0) {
      throw StoreFailure("rendezvous store set of `" + key + "` failed");
    }
  }

  std::vector<char> get(const std::string& key) override {
    std::vector<char> out;
    int rc = vt_.get(vt_.user, key.data(), key.size(), &out);
    if (rc != 0) {
      throw StoreFailure("rendezvous store get of `" + key + "` failed");
    }
    got_values_[key] = out;
    return out;
  }

  void wait(const std::vector<std::string>& keys) override {
    wait_impl(keys, -1);
  }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    wait_impl(keys, static_cast<int64_t>(timeout.count()));
  }

 private:
  void wait_impl(const std::vector<std::string>& keys, int64_t timeout_ms) {
    std::vector<const char*> ptrs;
    std::vector<size_t> lens;
    ptrs.reserve(keys.size());
    lens.reserve(keys.size());
    for (const auto& k : keys) {
      ptrs.push_back(k.data());
      lens.push_back(k.size());
    }
    int rc = vt_.wait(vt_.user, ptrs.data(), lens.data(), keys.size(),
                      timeout_ms);
    if (rc != 0) {
      throw StoreFailure("rendezvous store wait failed");
    }
  }

  accel_gloo_store_vtable vt_;
  std::map<std::string, std::vector<char>> set_values_;
  std::map<std::string, std::vector<char>> got_values_;

 public:
  // The value this rank set for `key`, if any.
  const std::vector<char>* value_set(const std::string& key) const {
    auto it = set_values_.find(key);
    return it == set_values_.end() ? nullptr : &it->second;
  }

  // The value this rank read for `key`, if any.
  const std::vector<char>* value_got(const std::string& key) const {
    auto it = got_values_.find(key);
    return it == got_values_.end() ? nullptr : &it->second;
  }
};

// The listening address `rank` advertised at rendezvous for its pair with
// `me` (rendezvous::Context's layout: one address per peer in rank order,
// skipping the rank itself), as Gloo prints addresses; empty when unknown.
std::string advertised_for(const std::vector<char>* blob, int rank, int me,
                           int size) {
  if (blob == nullptr || size < 2 || blob->size() % (size - 1) != 0) {
    return "";
  }
  const size_t each = blob->size() / (size - 1);
  const int k = me < rank ? me : me - 1;
  std::vector<char> bytes(blob->begin() + k * each,
                          blob->begin() + (k + 1) * each);
  try {
    return gloo::transport::tcp::Address(bytes).str();
  } catch (...) {
    return "";
  }
}

// The element-wise reductions Gloo calls on every chunk it reduces,
// picked by code. Gloo's own kernels (gloo/math.h) count with an `int`
// (`for (auto i = 0; i < n; i++)`): under -fwrapv, which this shim was
// built with so that integer sums wrap, GCC cannot prove that the counter
// does not wrap and leaves the loop scalar (no `addps`), 3-4x slower than
// the vectorized loop of a program built without it, such as
// benches/raw_gloo (48-79 against 14-21 us for 128 Ki floats here): that
// was cpu-gloo's best-vs-best gap to raw Gloo from 256 KiB up. These count
// with size_t and do signed integer arithmetic in the unsigned type of the
// same width, so sums and products wrap (two's complement) by definition,
// without -fwrapv, and every type vectorizes. min and max are std::min and
// std::max, as in Gloo (the same result for NaN). float16 keeps Gloo's own
// kernels, compiled in libgloo (they go through float).
template <typename T>
struct Arith {
  using type = T;
};
template <>
struct Arith<int8_t> {
  using type = uint8_t;
};
template <>
struct Arith<int32_t> {
  using type = uint32_t;
};
template <>
struct Arith<int64_t> {
  using type = uint64_t;
};

struct Add {
  template <typename T>
  static T apply(T a, T b) {
    using U = typename Arith<T>::type;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  }
};
struct Mul {
  template <typename T>
  static T apply(T a, T b) {
    using U = typename Arith<T>::type;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  }
};
struct Min {
  template <typename T>
  static T apply(T a, T b) {
    return std::min(a, b);
  }
};
struct Max {
  template <typename T>
  static T apply(T a, T b) {
    return std::max(a, b);
  }
};

template <typename T, typename Op>
void elementwise(void* c_, const void* a_, const void* b_, size_t n) {
  T* c = static_cast<T*>(c_);
  const T* a = static_cast<const T*>(a_);
  const T* b = static_cast<const T*>(b_);
  for (size_t i = 0; i < n; i++) {
    c[i] = Op::apply(a[i], b[i]);
  }
}

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

template <typename T>
ReduceFn reduce_fn(int op) {
  if constexpr (std::is_same_v<T, gloo::float16>) {
    // Each name has two overloads; the function-pointer type selects the
    // (c, a, b, n) one.
    ReduceFn f = nullptr;
    switch (op) {
      case ACCEL_GLOO_SUM:
        f = &gloo::sum<T>;
        return f;
      case ACCEL_GLOO_PROD:
        f = &gloo::product<T>;
        return f;
      case ACCEL_GLOO_MIN:
        f = &gloo::min<T>;
        return f;
      case ACCEL_GLOO_MAX:
        f = &gloo::max<T>;
        return f;
      default:
        break;
    }
  } else {
    switch (op) {
      case ACCEL_GLOO_SUM:
        return &elementwise<T, Add>;
      case ACCEL_GLOO_PROD:
        return &elementwise<T, Mul>;
      case ACCEL_GLOO_MIN:
        return &elementwise<T, Min>;
      case ACCEL_GLOO_MAX:
        return &elementwise<T, Max>;
      default:
        break;
    }
  }
  throw ArgFailure("unknown reduction code " + std::to_string(op));
}

// Calls `f.template operator()<T>()` with the Gloo element type of `dtype`.
template <typename F>
void with_dtype(int dtype, F&& f) {
  switch (dtype) {
    case ACCEL_GLOO_F16:
      f(gloo::float16());
      break;
    case ACCEL_GLOO_F32:
      f(float());
      break;
    case ACCEL_GLOO_F64:
      f(double());
      break;
    case ACCEL_GLOO_I8:
      f(int8_t());
      break;
    case ACCEL_GLOO_U8:
      f(uint8_t());
      break;
    case ACCEL_GLOO_I32:
      f(int32_t());
      break;
    case ACCEL_GLOO_I64:
      f(int64_t());
      break;
    default:
      throw ArgFailure("element type code " + std::to_string(dtype) +
                       " has no Gloo reduction");
  }
}

// Slot prefix of the shim's own ring reduce-scatter (Gloo uses 0x01-0x08).
constexpr uint8_t kReduceScatterSlotPrefix = 0x40;

std::chrono::milliseconds ms(int64_t timeout_ms) {
  if (timeout_ms <= 0) {
    throw ArgFailure("timeout must be positive");
  }
  return std::chrono::milliseconds(timeout_ms);
}

// Dead peers and queued sends.
//
// When a TCP pair fails (the peer died: a read sees EOF or a reset), Gloo
// wakes every unbound buffer with an operation pending on that pair, except
// one: a send whose bytes were already queued on the pair's transmit queue
// (a write that hit a full socket, or EPIPE/ECONNRESET, which Gloo's async
// write leaves for the event loop). Pair::signalException only wakes bound
// buffers of that queue, so such a send's waitSend sleeps until its own
// timeout. That is the race a survivor loses when its peer is killed while
// it sends: it waits out the whole timeout instead of seeing the lost peer.
// Likewise a receive whose payload was being read when the pair failed.
//
// Every unbound buffer of the main mesh is therefore a GuardedBuffer: it
// waits in slices of kPeerCheck, and between slices asks each pair it has
// an operation on whether the pair failed (tcp::Pair::tryRecv on a slot
// nobody uses rethrows the pair's exception and otherwise does nothing);
// a failed pair's exception wakes the wait as Gloo would have.
constexpr auto kPeerCheck = std::chrono::milliseconds(50);
// Never used by Gloo's collectives (prefixes 0x01-0x08), the shim's
// reduce-scatter (0x40) or point-to-point slots (below 2^56).
constexpr uint64_t kPeerCheckSlot = uint64_t(0xfe) << 56;

class GuardedBuffer : public gloo::transport::tcp::UnboundBuffer {
 public:
  GuardedBuffer(const std::shared_ptr<gloo::transport::tcp::Context>& ctx,
                void* ptr, size_t size)
      : gloo::transport::tcp::UnboundBuffer(ctx, ptr, size) {}

  void send(int dst, uint64_t slot, size_t offset, size_t nbytes) override {
    note(send_peers_, dst);
    gloo::transport::tcp::UnboundBuffer::send(dst, slot, offset, nbytes);
  }

  void recv(int src, uint64_t slot, size_t offset, size_t nbytes) override {
    note(recv_peers_, src);
    gloo::transport::tcp::UnboundBuffer::recv(src, slot, offset, nbytes);
  }

  void recv(std::vector<int> srcs, uint64_t slot, size_t offset,
            size_t nbytes) override {
    for (int s : srcs) {
      note(recv_peers_, s);
    }
    gloo::transport::tcp::UnboundBuffer::recv(std::move(srcs), slot, offset,
                                              nbytes);
  }

  bool waitSend(int* rank, std::chrono::milliseconds timeout) override {
    return guarded_wait(timeout, "send", sendCv_, send_peers_,
                        [&] { return abortWaitSend_ || sendCompletions_ > 0; },
                        [&](std::chrono::milliseconds t) {
                          return gloo::transport::tcp::UnboundBuffer::waitSend(
                              rank, t);
                        });
  }

  bool waitRecv(int* rank, std::chrono::milliseconds timeout) override {
    return guarded_wait(timeout, "recv", recvCv_, recv_peers_,
                        [&] { return abortWaitRecv_ || recvCompletions_ > 0; },
                        [&](std::chrono::milliseconds t) {
                          return gloo::transport::tcp::UnboundBuffer::waitRecv(
                              rank, t);
                        });
  }

 private:
  void note(std::vector<int>& peers, int rank) {
    std::lock_guard<std::mutex> lock(m_);
    if (std::find(peers.begin(), peers.end(), rank) == peers.end()) {
      peers.push_back(rank);
    }
  }

  // Wait until `ready` (or an exception) in slices, checking the pairs of
  // `peers` between them, then let Gloo's own wait finish the call: it
  // returns at once, rethrows the pair's exception, or times out.
  template <typename Ready, typename Base>
  bool guarded_wait(std::chrono::milliseconds timeout, const char* what,
                    std::condition_variable& cv, const std::vector<int>& peers,
                    Ready ready, Base base) {
    if (timeout == gloo::transport::kUnsetTimeout) {
      timeout = context_->getTimeout();
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    bool expired = false;
    for (;;) {
      std::vector<int> check;
      {
        std::unique_lock<std::mutex> lock(m_);
        auto done = [&] { return ex_ != nullptr || ready(); };
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (done()) {
          break;
        }
        if (left.count() <= 0) {
          expired = true;
          break;
        }
        if (cv.wait_for(lock, std::min(left, kPeerCheck), done)) {
          break;
        }
        check = peers;
      }
      for (int p : check) {
        check_pair(p);
      }
    }
    try {
      return base(expired ? std::chrono::milliseconds(1)
                          : std::max(std::chrono::milliseconds(1), timeout));
    } catch (const gloo::IoException&) {
      if (expired) {
        throw gloo::IoException(GLOO_ERROR_MSG("Timed out waiting ",
                                               timeout.count(), "ms for ",
                                               what,
                                               " operation to complete"));
      }
      throw;
    }
  }

  // Wake this buffer with pair `rank`'s exception if that pair failed.
  void check_pair(int rank) {
    auto& pair = context_->getPair(rank);
    auto* tcp = dynamic_cast<gloo::transport::tcp::Pair*>(pair.get());
    if (tcp == nullptr) {
      return;
    }
    if (!probe_) {
      probe_ = context_->createUnboundBuffer(nullptr, 0);
    }
    try {
      tcp->tryRecv(probe_.get(), kPeerCheckSlot, 0, 0);
    } catch (...) {
      signalException(std::current_exception());
    }
  }

  std::vector<int> send_peers_;
  std::vector<int> recv_peers_;
  std::unique_ptr<gloo::transport::UnboundBuffer> probe_;
};

// The transport context of a main mesh as Gloo's collectives see it: the
// TCP context's pairs, and GuardedBuffers for its unbound buffers.
class GuardedTransport : public gloo::transport::Context {
 public:
  explicit GuardedTransport(std::shared_ptr<gloo::transport::Context> inner)
      : gloo::transport::Context(inner->rank, inner->size),
        tcp_(std::dynamic_pointer_cast<gloo::transport::tcp::Context>(inner)),
        inner_(std::move(inner)) {
    setTimeout(inner_->getTimeout());
  }

  std::unique_ptr<gloo::transport::Pair>& getPair(int rank) override {
    return inner_->getPair(rank);
  }

  std::unique_ptr<gloo::transport::Pair>& createPair(int rank) override {
    return inner_->createPair(rank);
  }

  std::unique_ptr<gloo::transport::UnboundBuffer> createUnboundBuffer(
      void* ptr, size_t size) override {
    if (!tcp_) {
      return inner_->createUnboundBuffer(ptr, size);
    }
    return std::make_unique<GuardedBuffer>(tcp_, ptr, size);
  }

 private:
  std::shared_ptr<gloo::transport::tcp::Context> tcp_;
  std::shared_ptr<gloo::transport::Context> inner_;
};

// A rendezvous context whose unbound buffers are guarded (see above).
class GuardedContext : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;

  // After connectFullMesh: route unbound buffers through GuardedTransport.
  void guard() {
    transportContext_ =
        std::make_shared<GuardedTransport>(std::move(transportContext_));
  }
};

// Small all-gathers over a second mesh in Gloo's synchronous mode.
//
// Every collective of an accel group starts with the call check (ADR 0016),
// an all-gather of 36 bytes per rank. Through gloo::allgather that costs a
// full exchange of Gloo's asynchronous transport: each transfer of an
// unbound buffer waits for the receiver's "ready to receive" notice, and
// both the notice and the data are read by the device's event-loop thread,
// which then wakes the caller (two thread hand-offs per message): about
// 75-125 us best, 240 us median on 2 loopback ranks of a 2-core machine,
// where a 1 MiB all-reduce takes 0.5-0.8 ms. This mesh, connected next to
// the main one, keeps its pairs in Gloo's synchronous mode (no event loop:
// the calling thread writes and reads the socket itself, blocking, with the
// context's timeout as the socket timeout) and sends each peer one frame
// into a buffer registered at connect (no notice): 9-10 us best, 40-70 us
// median on the same machine.
//
// A frame is a header (a magic number, the payload's byte count and the
// exchange's number on this mesh) and up to kSmallPayload bytes. Frames on
// one pair arrive in order; a pair holds at most two unread frames (a rank
// sends exchange k+1 only after it has read every peer's frame k), far
// below a socket's buffer, so the sends never block on a slow reader.
// The receiver checks the header: a peer that passed another byte count
// fails the all-gather on both ranks with an argument error (where Gloo's
// own all-gather aborts the process), one out of step fails it too.
class SmallMesh {
 public:
  struct Header {
    uint32_t magic;
    uint32_t bytes;
    uint64_t seq;
  };
  static constexpr size_t kFrame = 256;
  static constexpr size_t kSmallPayload = kFrame - sizeof(Header);
  static constexpr uint32_t kMagic = 0x61636331;  // "acc1"
  // Larger worlds use gloo::allgather (the mesh doubles the sockets).
  static constexpr int kMaxRanks = 128;

  // `peer_names[j]`: an address rank j published for its main connection
  // to this rank, named in errors so that the Rust side maps them to j.
  SmallMesh(std::shared_ptr<gloo::rendezvous::Context> ctx,
            std::vector<std::string> peer_names)
      : ctx_(std::move(ctx)),
        peer_names_(std::move(peer_names)),
        send_(kFrame),
        recv_(kFrame * static_cast<size_t>(ctx_->size)),
        send_bufs_(ctx_->size),
        recv_bufs_(ctx_->size) {
    for (int j = 0; j < ctx_->size; j++) {
      if (j == ctx_->rank) {
        continue;
      }
      auto& pair = ctx_->getPair(j);
      pair->setSync(true, false);
      recv_bufs_[j] = pair->createRecvBuffer(0, frame(j), kFrame);
      send_bufs_[j] = pair->createSendBuffer(0, send_.data(), kFrame);
    }
  }

  // All-gather `n` (at most kSmallPayload) bytes from every rank into `out`
  // (rank-major, size * n bytes).
  void allgather(const void* in, size_t n, void* out) {
    const int size = ctx_->size, rank = ctx_->rank;
    const Header mine{kMagic, static_cast<uint32_t>(n), seq_++};
    std::memcpy(send_.data(), &mine, sizeof(mine));
    std::memcpy(send_.data() + sizeof(mine), in, n);
    auto* dst = static_cast<char*>(out);
    std::memcpy(dst + static_cast<size_t>(rank) * n, in, n);
    for (int k = 1; k < size; k++) {
      const int j = (rank + k) % size;
      on_pair(j, [&] {
        send_bufs_[j]->send(0, sizeof(mine) + n);
        send_bufs_[j]->waitSend();
      });
    }
    // Read every peer's frame before judging any, so that the pairs stay
    // in step after a disagreement.
    for (int k = 1; k < size; k++) {
      const int j = (rank + size - k) % size;
      on_pair(j, [&] { recv_bufs_[j]->waitRecv(); });
    }
    for (int j = 0; j < size; j++) {
      if (j == rank) {
        continue;
      }
      Header h;
      std::memcpy(&h, frame(j), sizeof(h));
      if (h.magic != kMagic || h.seq != mine.seq) {
        throw std::runtime_error(
            "small all_gather out of step with rank " + std::to_string(j) +
            " (exchange " + std::to_string(mine.seq) + " here, frame " +
            std::to_string(h.seq) + " from it)");
      }
      if (h.bytes != n) {
        throw ArgFailure("all_gather: this rank contributes " +
                         std::to_string(n) + " bytes, rank " +
                         std::to_string(j) + " " + std::to_string(h.bytes) +
                         " (every rank must pass the same byte count; with "
                         "ACCEL_CHECK_CALLS=1, the default, the call check "
                         "names the mismatched call)");
      }
      std::memcpy(dst + static_cast<size_t>(j) * n, frame(j) + sizeof(h), n);
    }
  }

  void close() { ctx_->closeConnections(); }

 private:
  char* frame(int j) { return recv_.data() + static_cast<size_t>(j) * kFrame; }

  // Runs `f` on pair j; a transport failure names rank j's main connection
  // too (the Rust side maps Gloo's addresses to ranks by those names).
  template <typename F>
  void on_pair(int j, F&& f) {
    try {
      f();
    } catch (const gloo::IoException& e) {
      throw gloo::IoException(std::string(e.what()) +
                              " (the small all-gather connection to rank " +
                              std::to_string(j) + ", main connection " +
                              peer_names_[j] + ")");
    }
  }

  // Declared first, destroyed last: the buffers unregister from its pairs.
  std::shared_ptr<gloo::rendezvous::Context> ctx_;
  std::vector<std::string> peer_names_;
  std::vector<char> send_;
  std::vector<char> recv_;
  std::vector<std::unique_ptr<gloo::transport::Buffer>> send_bufs_;
  std::vector<std::unique_ptr<gloo::transport::Buffer>> recv_bufs_;
  uint64_t seq_ = 0;
};

}  // namespace

struct accel_gloo_device {
  std::shared_ptr<gloo::transport::Device> dev;
};

struct accel_gloo_context {
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  // For each peer, the names the peer's Gloo may print for its connection
  // to this rank in error messages ("connection closed by peer <name>"):
  // the local address of this rank's socket (set when the peer's side of
  // the pair completed after its connect call), or the listening address
  // this rank advertised for that pair at rendezvous (when the peer
  // accepted before its connect call, which then stores the advertised
  // address). Both are kept.
  std::vector<std::string> self_names;
  std::vector<std::string> listen_names;
  // Small all-gathers (the call check's), when the world has 2 to
  // SmallMesh::kMaxRanks ranks.
  std::unique_ptr<SmallMesh> small;
};

namespace {

gloo::rendezvous::Context& checked(accel_gloo_context* c) {
  if (c == nullptr || !c->ctx) {
    throw ArgFailure("null Gloo context");
  }
  return *c->ctx;
}

void check_peer(const gloo::Context& ctx, int peer, const char* what) {
  if (peer < 0 || peer >= ctx.size || peer == ctx.rank) {
    throw ArgFailure(std::string(what) + " " + std::to_string(peer) +
                     " is not another rank of this context");
  }
}

// Ring reduce-scatter on unbound buffers. At step s (0 <= s < size - 1)
// rank r sends its partial sum of chunk (r - s - 1) to rank r + 1, receives
// rank r - 1's partial sum of chunk (r - s - 2) and adds its own input to
// it; after the last step it holds chunk r summed over every rank. Each
// element is reduced on one rank only, so no two ranks can disagree on it.
// Gloo's own ReduceScatterHalvingDoubling is an old-style algorithm on
// bound buffers without a per-call timeout; this one waits against one
// deadline for the whole call.
template <typename T>
void ring_reduce_scatter(gloo::rendezvous::Context& c, const T* in, T* out,
                         size_t count, ReduceFn reduce, uint32_t tag,
                         std::chrono::milliseconds timeout) {
  const int size = c.size, rank = c.rank;
  const size_t bytes = count * sizeof(T);
  if (size == 1) {
    std::copy(in, in + count, out);
    return;
  }
  if (count == 0) {
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left_ms = [&] {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  };
  auto chunk = [&](int i) { return ((i % size) + size) % size; };
  // Two chunk buffers, alternately received into (and reduced in place)
  // and sent on: the one received into at step s was sent at step s - 1,
  // whose send completed. Not zero-filled: every use is written first.
  const int nbuf = std::min(size - 1, 2);
  std::unique_ptr<T[]> work(new T[static_cast<size_t>(nbuf) * count]);
  auto part = [&](int s) { return work.get() + (s % nbuf) * count; };
  auto input = c.createUnboundBuffer(const_cast<T*>(in), bytes * size);
  std::unique_ptr<gloo::transport::UnboundBuffer> bufs[2];
  for (int i = 0; i < nbuf; i++) {
    bufs[i] = c.createUnboundBuffer(part(i), bytes);
  }
  const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  for (int s = 0; s < size - 1; s++) {
    auto& recv = bufs[s % nbuf];
    recv->recv(left, slot);
    gloo::transport::UnboundBuffer* sent;
    if (s == 0) {
      input->send(right, slot, chunk(rank - 1) * bytes, bytes);
      sent = input.get();
    } else {
      sent = bufs[(s - 1) % nbuf].get();
      sent->send(right, slot);
    }
    recv->waitRecv(left_ms());
    T* dst = s == size - 2 ? out : part(s);
    reduce(dst, part(s), in + chunk(rank - s - 2) * count, count);
    sent->waitSend(left_ms());
  }
}

}  // namespace

extern "C" {

int accel_gloo_bytes_assign(void* sink, const uint8_t* data, size_t len) {
  char err[8];
  return guarded(err, sizeof(err), [&] {
    if (sink == nullptr || (data == nullptr && len > 0)) {
      throw ArgFailure("null sink");
    }
    auto* out = static_cast<std::vector<char>*>(sink);
    out->assign(reinterpret_cast<const char*>(data),
                reinterpret_cast<const char*>(data) + len);
  });
}

const char* accel_gloo_version(void) {
#define ACCEL_GLOO_STR2(x) #x
#define ACCEL_GLOO_STR(x) ACCEL_GLOO_STR2(x)
  return ACCEL_GLOO_STR(GLOO_VERSION_MAJOR) "." ACCEL_GLOO_STR(
      GLOO_VERSION_MINOR) "." ACCEL_GLOO_STR(GLOO_VERSION_PATCH);
#undef ACCEL_GLOO_STR
#undef ACCEL_GLOO_STR2
}

int accel_gloo_device_new(const char* hostname, const char* iface,
                          accel_gloo_device** out, char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (out == nullptr) {
      throw ArgFailure("null output pointer");
    }
    *out = nullptr;
    gloo::transport::tcp::attr attr;
    if (iface != nullptr && iface[0] != '\0') {
      attr.iface = iface;
    } else if (hostname != nullptr && hostname[0] != '\0') {
      attr.hostname = hostname;
    }
    auto handle = std::make_unique<accel_gloo_device>();
    handle->dev = gloo::transport::tcp::CreateDevice(attr);
    *out = handle.release();
  });
}

void accel_gloo_device_free(accel_gloo_device* dev) {
  try {
    delete dev;
  } catch (...) {
    // Destructors must not throw; if Gloo's does, drop it on the floor
    // rather than crossing into Rust.
  }
}

int accel_gloo_device_describe(const accel_gloo_device* dev, char* buf,
                               size_t cap) {
  return guarded(buf, cap, [&] {
    if (dev == nullptr || !dev->dev) {
      throw ArgFailure("null device");
    }
    std::string s = dev->dev->str();
    write_msg(buf, cap, "", s.c_str());
  });
}

int accel_gloo_context_new(accel_gloo_device* dev, int rank, int size,
                           int64_t timeout_ms,
                           const accel_gloo_store_vtable* store,
                           accel_gloo_context** out, char* err,
                           size_t err_cap) {
  return guarded(err, err_cap, [&] {
    if (out == nullptr || dev == nullptr || !dev->dev || store == nullptr ||
        store->set == nullptr || store->get == nullptr ||
        store->wait == nullptr) {
      throw ArgFailure("null argument to context_new");
    }
    *out = nullptr;
    if (size < 1 || rank < 0 || rank >= size) {
      throw ArgFailure("rank " + std::to_string(rank) + " of world size " +
                       std::to_string(size) + " is out of range");
    }
    CallbackStore cb(*store);
    auto ctx = std::make_shared<GuardedContext>(rank, size);
    ctx->setTimeout(ms(timeout_ms));
    ctx->connectFullMesh(cb, dev->dev);
    ctx->guard();
    auto handle = std::make_unique<accel_gloo_context>();
    handle->self_names.resize(size);
    handle->listen_names.resize(size);
    for (int j = 0; j < size; j++) {
      auto& pair = ctx->getPair(j);
      if (j != rank && pair) {
        // After connecting, a TCP pair's address is its socket's local end.
        handle->self_names[j] = pair->address().str();
      }
    }
    // What this rank advertised: one address per peer, in rank order
    // skipping itself (the layout rendezvous::Context writes and reads).
    // Unknown layouts leave the names empty.
    const std::vector<char>* blob = cb.value_set(std::to_string(rank));
    std::vector<std::string> peer_names(size);
    for (int j = 0; j < size; j++) {
      if (j != rank) {
        handle->listen_names[j] = advertised_for(blob, rank, j, size);
        peer_names[j] =
            advertised_for(cb.value_got(std::to_string(j)), j, rank, size);
      }
    }
    if (size > 1 && size <= SmallMesh::kMaxRanks) {
      gloo::rendezvous::PrefixStore small_store("accel-small", cb);
      auto small = std::make_shared<gloo::rendezvous::Context>(rank, size);
      small->setTimeout(ms(timeout_ms));
      small->connectFullMesh(small_store, dev->dev);
      handle->small =
          std::make_unique<SmallMesh>(std::move(small), std::move(peer_names));
    }
    handle->ctx = std::move(ctx);
    *out = handle.release();
  });
}

void accel_gloo_context_free(accel_gloo_context* ctx) {
  try {
    delete ctx;
  } catch (...) {
  }
}

size_t accel_gloo_context_self_name(const accel_gloo_context* ctx, int peer,
                                    int which, char* buf, size_t cap) {
  if (ctx == nullptr || peer < 0 ||
      static_cast<size_t>(peer) >= ctx->self_names.size()) {
    if (buf != nullptr && cap > 0) {
      buf[0] = '\0';
    }
    return 0;
  }
  const std::string& s =
      which == 0 ? ctx->self_names[peer] : ctx->listen_names[peer];
  if (buf != nullptr && cap > 0) {
    std::snprintf(buf, cap, "%s", s.c_str());
  }
  return s.size();
}

void accel_gloo_context_close(accel_gloo_context* ctx) {
  try {
    if (ctx != nullptr && ctx->ctx) {
      ctx->ctx->closeConnections();
    }
    if (ctx != nullptr && ctx->small) {
      ctx->small->close();
    }
  } catch (...) {
  }
}

int accel_gloo_allreduce(accel_gloo_context* ctx, void* buf, size_t count,
                         int dtype, int op, uint32_t tag, int64_t timeout_ms,
                         char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    checked(ctx);
    with_dtype(dtype, [&](auto zero) {
      using T = decltype(zero);
      gloo::AllreduceOptions opts(ctx->ctx);
      opts.setOutput(static_cast<T*>(buf), count);
      opts.setReduceFunction(reduce_fn<T>(op));
      opts.setTag(tag);
      opts.setTimeout(ms(timeout_ms));
      gloo::allreduce(opts);
    });
  });
}

int accel_gloo_reduce(accel_gloo_context* ctx, void* buf, size_t count,
                      int dtype, int op, int root, uint32_t tag,
                      int64_t timeout_ms, char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    auto& c = checked(ctx);
    if (root < 0 || root >= c.size) {
      throw ArgFailure("root out of range");
    }
    with_dtype(dtype, [&](auto zero) {
      using T = decltype(zero);
      gloo::ReduceOptions opts(ctx->ctx);
      opts.setOutput(static_cast<T*>(buf), count);
      opts.setReduceFunction(reduce_fn<T>(op));
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(ms(timeout_ms));
      gloo::reduce(opts);
    });
  });
}

int accel_gloo_reduce_scatter(accel_gloo_context* ctx, const void* in,
                              void* out, size_t count, int dtype, int op,
                              uint32_t tag, int64_t timeout_ms, char* err,
                              size_t err_cap) {
  return guarded(err, err_cap, [&] {
    auto& c = checked(ctx);
    with_dtype(dtype, [&](auto zero) {
      using T = decltype(zero);
      ring_reduce_scatter<T>(c, static_cast<const T*>(in), static_cast<T*>(out),
                             count, reduce_fn<T>(op), tag, ms(timeout_ms));
    });
  });
}

int accel_gloo_broadcast(accel_gloo_context* ctx, void* buf, size_t nbytes,
                         int root, uint32_t tag, int64_t timeout_ms, char* err,
                         size_t err_cap) {
  return guarded(err, err_cap, [&] {
    auto& c = checked(ctx);
    if (root < 0 || root >= c.size) {
      throw ArgFailure("root out of range");
    }
    gloo::BroadcastOptions opts(ctx->ctx);
    opts.setOutput(static_cast<uint8_t*>(buf), nbytes);
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::broadcast(opts);
  });
}

int accel_gloo_allgather(accel_gloo_context* ctx, const void* in,
                         size_t in_bytes, void* out, uint32_t tag,
                         int64_t timeout_ms, char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    auto& c = checked(ctx);
    if (ctx->small && in_bytes <= SmallMesh::kSmallPayload) {
      ctx->small->allgather(in, in_bytes, out);
      return;
    }
    gloo::AllgatherOptions opts(ctx->ctx);
    // Gloo only reads from the input buffer; its API takes a non-const
    // pointer for both directions.
    opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), in_bytes);
    opts.setOutput(static_cast<uint8_t*>(out), in_bytes * c.size);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::allgather(opts);
  });
}

int accel_gloo_gather(accel_gloo_context* ctx, const void* in, size_t in_bytes,
                      void* out, int root, uint32_t tag, int64_t timeout_ms,
                      char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    auto& c = checked(ctx);
    if (root < 0 || root >= c.size) {
      throw ArgFailure("root out of range");
    }
    gloo::GatherOptions opts(ctx->ctx);
    opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), in_bytes);
    if (c.rank == root) {
      if (out == nullptr) {
        throw ArgFailure("the root needs an output buffer");
      }
      opts.setOutput(static_cast<uint8_t*>(out), in_bytes * c.size);
    }
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::gather(opts);
  });
}

int accel_gloo_scatter(accel_gloo_context* ctx, const void* in, void* out,
                       size_t out_bytes, int root, uint32_t tag,
                       int64_t timeout_ms, char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    auto& c = checked(ctx);
    if (root < 0 || root >= c.size) {
      throw ArgFailure("root out of range");
    }
    gloo::ScatterOptions opts(ctx->ctx);
    if (c.rank == root) {
      if (in == nullptr) {
        throw ArgFailure("the root needs an input buffer");
      }
      std::vector<uint8_t*> chunks(c.size);
      auto* base = static_cast<uint8_t*>(const_cast<void*>(in));
      for (int i = 0; i < c.size; i++) {
        chunks[i] = base + static_cast<size_t>(i) * out_bytes;
      }
      opts.setInputs(chunks, out_bytes);
    }
    opts.setOutput(static_cast<uint8_t*>(out), out_bytes);
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::scatter(opts);
  });
}

int accel_gloo_alltoall(accel_gloo_context* ctx, const void* in, void* out,
                        size_t nbytes, uint32_t tag, int64_t timeout_ms,
                        char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    auto& c = checked(ctx);
    if (nbytes % static_cast<size_t>(c.size) != 0) {
      throw ArgFailure("all_to_all byte count is not a multiple of the size");
    }
    gloo::AlltoallOptions opts(ctx->ctx);
    opts.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), nbytes);
    opts.setOutput(static_cast<uint8_t*>(out), nbytes);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::alltoall(opts);
  });
}

int accel_gloo_barrier(accel_gloo_context* ctx, uint32_t tag,
                       int64_t timeout_ms, char* err, size_t err_cap) {
  return guarded(err, err_cap, [&] {
    checked(ctx);
    gloo::BarrierOptions opts(ctx->ctx);
    opts.setTag(tag);
    opts.setTimeout(ms(timeout_ms));
    gloo::barrier(opts);
  });
}

int accel_gloo_send(accel_gloo_context* ctx, const void* buf, size_t nbytes,
                    int dst, uint64_t slot, int64_t timeout_ms, char* err,
                    size_t err_cap) {
  return guarded(err, err_cap, [&] {
    auto& c = checked(ctx);
    check_peer(c, dst, "destination");
    if (slot >= (uint64_t(1) << 56)) {
      throw ArgFailure("point-to-point slot out of range");
    }
    auto ubuf = c.createUnboundBuffer(const_cast<void*>(buf), nbytes);
    ubuf->send(dst, slot);
    ubuf->waitSend(ms(timeout_ms));
  });
}

int accel_gloo_recv(accel_gloo_context* ctx, void* buf, size_t nbytes, int src,
                    uint64_t slot, int64_t timeout_ms, char* err,
                    size_t err_cap) {
  return guarded(err, err_cap, [&] {
    auto& c = checked(ctx);
    check_peer(c, src, "source");
    if (slot >= (uint64_t(1) << 56)) {
      throw ArgFailure("point-to-point slot out of range");
    }
    auto ubuf = c.createUnboundBuffer(buf, nbytes);
    ubuf->recv(src, slot);
    ubuf->waitRecv(ms(timeout_ms));
  });
}

}  // extern "C"
