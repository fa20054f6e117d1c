/*
 * A stand-in for libascendcl.so, for accel's npu-hccl glue tests only.
 *
 * "Device" memory is host memory, streams finish at once (unless a test
 * says otherwise), and one process sees STUB_DEVICES NPUs. It implements
 * only the calls the backend resolves, with the prototypes of the public
 * AscendCL documentation. Passing tests against it say nothing about real
 * AscendCL.
 *
 * Build variants (-D): STUB_DEVICES=n, STUB_INIT_RC=code (what the first
 * aclInit returns), STUB_NO_STREAM_QUERY (leave aclrtStreamQuery out).
 */
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef STUB_DEVICES
#define STUB_DEVICES 2
#endif
#ifndef STUB_INIT_RC
#define STUB_INIT_RC 0
#endif

#define STUB_INVALID_PARAM 100000
#define STUB_REPEAT_INIT 100002
#define STUB_BAD_DEVICE 107001
#define STUB_NO_MEMORY 207001

static atomic_int initialised;
static atomic_int stream_busy;
static atomic_int fail_malloc;
static atomic_long live_allocs;
static atomic_long set_device_calls;
static const char *last_message = "";

/* Test control: set a knob, return its previous value. */
int stub_acl_set(const char *what, int value) {
    if (strcmp(what, "stream_busy") == 0) return atomic_exchange(&stream_busy, value);
    if (strcmp(what, "fail_malloc") == 0) return atomic_exchange(&fail_malloc, value);
    return -1;
}

long stub_acl_live_allocs(void) { return atomic_load(&live_allocs); }
long stub_acl_set_device_calls(void) { return atomic_load(&set_device_calls); }

int aclInit(const char *config) {
    (void)config;
    if (atomic_exchange(&initialised, 1)) return STUB_REPEAT_INIT;
    if (STUB_INIT_RC != 0) last_message = "stub: aclInit was built to fail";
    return STUB_INIT_RC;
}

const char *aclGetRecentErrMsg(void) { return last_message; }

int aclrtSetDevice(int32_t id) {
    atomic_fetch_add(&set_device_calls, 1);
    if (id < 0 || id >= STUB_DEVICES) {
        last_message = "stub: no such device";
        return STUB_BAD_DEVICE;
    }
    return 0;
}

int aclrtGetDeviceCount(uint32_t *count) {
    if (count == NULL) return STUB_INVALID_PARAM;
    *count = STUB_DEVICES;
    return 0;
}

int aclrtGetVersion(int32_t *major, int32_t *minor, int32_t *patch) {
    if (!major || !minor || !patch) return STUB_INVALID_PARAM;
    *major = 1;
    *minor = 0;
    *patch = 0;
    return 0;
}

int aclrtCreateStream(void **stream) {
    if (stream == NULL) return STUB_INVALID_PARAM;
    *stream = malloc(8);
    return *stream ? 0 : STUB_NO_MEMORY;
}

int aclrtDestroyStream(void *stream) {
    free(stream);
    return 0;
}

#ifndef STUB_NO_STREAM_QUERY
int aclrtStreamQuery(void *stream, int *status) {
    if (status == NULL) return STUB_INVALID_PARAM;
    (void)stream;
    *status = atomic_load(&stream_busy) ? 1 : 0;
    return 0;
}
#endif

int aclrtMalloc(void **ptr, size_t size, int policy) {
    (void)policy;
    if (ptr == NULL || size == 0) return STUB_INVALID_PARAM;
    if (atomic_load(&fail_malloc)) {
        last_message = "stub: out of device memory";
        return STUB_NO_MEMORY;
    }
    *ptr = aligned_alloc(64, (size + 63) / 64 * 64);
    if (*ptr == NULL) return STUB_NO_MEMORY;
    memset(*ptr, 0xEE, size);
    atomic_fetch_add(&live_allocs, 1);
    return 0;
}

int aclrtFree(void *ptr) {
    if (ptr == NULL) return STUB_INVALID_PARAM;
    free(ptr);
    atomic_fetch_sub(&live_allocs, 1);
    return 0;
}

int aclrtMemcpy(void *dst, size_t dst_max, const void *src, size_t count, int kind) {
    if (dst == NULL || src == NULL || count > dst_max || kind < 0 || kind > 4) {
        last_message = "stub: bad aclrtMemcpy arguments";
        return STUB_INVALID_PARAM;
    }
    memmove(dst, src, count);
    return 0;
}
