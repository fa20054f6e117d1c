/*
 * accel-backend-cpu-gloo: the C boundary between Rust and Gloo.
 *
 * Every function is `extern "C"`, takes plain pointers and integers, and
 * never lets a C++ exception escape: each one catches everything and
 * returns one of the ACCEL_GLOO_* status codes, with a NUL-terminated
 * message written into the caller's `err` buffer (truncated to `err_cap`).
 *
 * Handles are opaque: an `accel_gloo_device` owns a Gloo TCP device (and its
 * event-loop thread), an `accel_gloo_context` a connected full-mesh Gloo
 * context. Both are freed with their `_free` function; a context keeps its
 * device alive on its own, so the two can be freed in any order.
 *
 * Data-movement collectives take byte counts (they move raw bytes, which is
 * exact for every element type); reductions take an element count, a dtype
 * code and a reduction code.
 */
#ifndef ACCEL_GLOO_SHIM_H
#define ACCEL_GLOO_SHIM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes. */
#define ACCEL_GLOO_OK 0
/* gloo::IoException: socket errors, lost peers, timeouts. */
#define ACCEL_GLOO_E_IO 1
/* Any other gloo::Exception (invalid operation, ...). */
#define ACCEL_GLOO_E_GLOO 2
/* gloo::EnforceNotMet: a failed internal Gloo assertion. */
#define ACCEL_GLOO_E_ENFORCE 3
/* Another std::exception (std::system_error, std::bad_alloc, ...). */
#define ACCEL_GLOO_E_STD 4
/* Something thrown that is not a std::exception. */
#define ACCEL_GLOO_E_UNKNOWN 5
/* A store callback reported an error; the Rust side holds the details. */
#define ACCEL_GLOO_E_STORE 6
/* The shim itself rejected an argument (null handle, unknown code). */
#define ACCEL_GLOO_E_ARG 7

/* Element type codes for reductions (same numbers as accel_api::DType::code). */
#define ACCEL_GLOO_F16 1
#define ACCEL_GLOO_F32 3
#define ACCEL_GLOO_F64 4
#define ACCEL_GLOO_I8 5
#define ACCEL_GLOO_U8 6
#define ACCEL_GLOO_I32 7
#define ACCEL_GLOO_I64 8

/* Reduction codes (same numbers as accel_api::ReduceOp::code; no avg). */
#define ACCEL_GLOO_SUM 1
#define ACCEL_GLOO_PROD 2
#define ACCEL_GLOO_MIN 3
#define ACCEL_GLOO_MAX 4

typedef struct accel_gloo_device accel_gloo_device;
typedef struct accel_gloo_context accel_gloo_context;

/*
 * Rendezvous store callbacks, implemented in Rust. Each returns 0 on
 * success and non-zero on failure (the Rust side keeps the error). `get`
 * hands the value back by calling accel_gloo_bytes_assign(sink, ...).
 * Keys are not NUL-terminated: use the lengths.
 */
typedef struct accel_gloo_store_vtable {
  void* user;
  int (*set)(void* user, const char* key, size_t key_len, const uint8_t* value,
             size_t value_len);
  int (*get)(void* user, const char* key, size_t key_len, void* sink);
  /* timeout_ms < 0: no timeout given by Gloo (use the connect deadline). */
  int (*wait)(void* user, const char* const* keys, const size_t* key_lens,
              size_t n_keys, int64_t timeout_ms);
} accel_gloo_store_vtable;

/* Store `len` bytes at `data` into the value sink given to `get`. */
int accel_gloo_bytes_assign(void* sink, const uint8_t* data, size_t len);

/* Gloo's version as "major.minor.patch" (static string). */
const char* accel_gloo_version(void);

/*
 * A TCP device bound to `hostname` (a host name or IP address) or, when
 * `iface` is non-empty, to the first address of that network interface.
 * Both empty: Gloo's default (this machine's host name).
 */
int accel_gloo_device_new(const char* hostname, const char* iface,
                          accel_gloo_device** out, char* err, size_t err_cap);
void accel_gloo_device_free(accel_gloo_device* dev);
/* A description of the device ("listening on ..."), for logs. */
int accel_gloo_device_describe(const accel_gloo_device* dev, char* buf,
                               size_t cap);

/*
 * Build a full-mesh context of `size` ranks through the store. Blocks until
 * every rank connected or a store call / connection timed out. With 2 to
 * 128 ranks it connects a second mesh (store keys under "accel-small")
 * whose pairs run in Gloo's synchronous mode, for small all-gathers (see
 * accel_gloo_allgather).
 */
int accel_gloo_context_new(accel_gloo_device* dev, int rank, int size,
                           int64_t timeout_ms,
                           const accel_gloo_store_vtable* store,
                           accel_gloo_context** out, char* err,
                           size_t err_cap);
void accel_gloo_context_free(accel_gloo_context* ctx);

/*
 * A name `peer`'s Gloo may print for its connection to this rank in error
 * messages, as Gloo prints addresses ("[10.0.0.2]:1234"): `which` = 0 the
 * local address of this rank's socket, 1 the listening address this rank
 * advertised for that pair. Empty when unknown. Returns the length.
 */
size_t accel_gloo_context_self_name(const accel_gloo_context* ctx, int peer,
                                    int which, char* buf, size_t cap);

/* Close every connection now (after a failure, so that peers notice). */
void accel_gloo_context_close(accel_gloo_context* ctx);

/* Collectives. `tag` separates consecutive operations; `timeout_ms` > 0. */
int accel_gloo_allreduce(accel_gloo_context* ctx, void* buf, size_t count,
                         int dtype, int op, uint32_t tag, int64_t timeout_ms,
                         char* err, size_t err_cap);
int accel_gloo_reduce(accel_gloo_context* ctx, void* buf, size_t count,
                      int dtype, int op, int root, uint32_t tag,
                      int64_t timeout_ms, char* err, size_t err_cap);
/*
 * Ring reduce-scatter: `in` holds size * count elements of `dtype`, `out`
 * receives this rank's `count` (chunk `rank`) reduced over every rank.
 * Moves (size - 1) / size of the input per rank, half an all-reduce.
 */
int accel_gloo_reduce_scatter(accel_gloo_context* ctx, const void* in,
                              void* out, size_t count, int dtype, int op,
                              uint32_t tag, int64_t timeout_ms, char* err,
                              size_t err_cap);
int accel_gloo_broadcast(accel_gloo_context* ctx, void* buf, size_t nbytes,
                         int root, uint32_t tag, int64_t timeout_ms, char* err,
                         size_t err_cap);
/*
 * `out` holds size * in_bytes. Up to 240 bytes per rank (the call check's
 * exchange, a split's) it runs on the context's second mesh: one frame to
 * every peer, read by the calling thread, with the context's timeout; a
 * peer passing another byte count is an ACCEL_GLOO_E_ARG error on both
 * ranks. Larger ones run gloo::allgather (`tag`, `timeout_ms`).
 */
int accel_gloo_allgather(accel_gloo_context* ctx, const void* in,
                         size_t in_bytes, void* out, uint32_t tag,
                         int64_t timeout_ms, char* err, size_t err_cap);
/* `out` (size * in_bytes) is used on the root only and may be NULL elsewhere. */
int accel_gloo_gather(accel_gloo_context* ctx, const void* in, size_t in_bytes,
                      void* out, int root, uint32_t tag, int64_t timeout_ms,
                      char* err, size_t err_cap);
/* `in` (size * out_bytes) is used on the root only and may be NULL elsewhere. */
int accel_gloo_scatter(accel_gloo_context* ctx, const void* in, void* out,
                       size_t out_bytes, int root, uint32_t tag,
                       int64_t timeout_ms, char* err, size_t err_cap);
/* `in` and `out` both hold `nbytes`, a multiple of size. */
int accel_gloo_alltoall(accel_gloo_context* ctx, const void* in, void* out,
                        size_t nbytes, uint32_t tag, int64_t timeout_ms,
                        char* err, size_t err_cap);
int accel_gloo_barrier(accel_gloo_context* ctx, uint32_t tag,
                       int64_t timeout_ms, char* err, size_t err_cap);

/*
 * Point-to-point on Gloo's unbound buffers. `slot` must stay below 2^56 so
 * that it never meets the slots of collectives. Never to or from self.
 * Blocks until the transfer completed.
 */
int accel_gloo_send(accel_gloo_context* ctx, const void* buf, size_t nbytes,
                    int dst, uint64_t slot, int64_t timeout_ms, char* err,
                    size_t err_cap);
int accel_gloo_recv(accel_gloo_context* ctx, void* buf, size_t nbytes, int src,
                    uint64_t slot, int64_t timeout_ms, char* err,
                    size_t err_cap);

#ifdef __cplusplus
}
#endif

#endif /* ACCEL_GLOO_SHIM_H */
