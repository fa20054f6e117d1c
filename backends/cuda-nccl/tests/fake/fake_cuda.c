/* A fake CUDA driver for accel's glue tests: "device memory" is host memory,
 * streams and events do nothing, copies are memcpy. It only has to satisfy
 * what accel-backend-cuda-nccl calls through cudarc; it proves nothing about
 * a GPU. */
#include <stdlib.h>
#include <string.h>

typedef unsigned long long dptr;
static int ctx_token, stream_token, event_token;

int cuInit(unsigned f) { (void)f; return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
static int count(void) { const char *v = getenv("FAKE_CUDA_DEVICES"); return v ? atoi(v) : 1; }
int cuDeviceGetCount(int *n) { *n = count(); return 0; }
int cuDeviceGet(int *d, int ord) { *d = ord; return ord < count() ? 0 : 101; }
int cuDeviceGetAttribute(int *v, int attr, int dev) { (void)attr; (void)dev; *v = 0; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int dev) { (void)dev; *c = &ctx_token; return 0; }
int cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return 0; }
static __thread void *current;
int cuCtxSetCurrent(void *c) { current = c; return 0; }
int cuCtxGetCurrent(void **c) { *c = current; return 0; }
int cuCtxSynchronize(void) { return 0; }
int cuStreamCreate(void **s, unsigned f) { (void)f; *s = &stream_token; return 0; }
int cuStreamDestroy_v2(void *s) { (void)s; return 0; }
int cuStreamQuery(void *s) { (void)s; return 0; }
int cuStreamWaitEvent(void *s, void *e, unsigned f) { (void)s; (void)e; (void)f; return 0; }
int cuEventCreate(void **e, unsigned f) { (void)f; *e = &event_token; return 0; }
int cuEventRecord(void *e, void *s) { (void)e; (void)s; return 0; }
int cuEventDestroy_v2(void *e) { (void)e; return 0; }
int cuMemAlloc_v2(dptr *p, size_t n) { void *m = malloc(n); if (!m) return 2; *p = (dptr)(size_t)m; return 0; }
int cuMemFree_v2(dptr p) { free((void *)(size_t)p); return 0; }
int cuMemcpyHtoDAsync_v2(dptr d, const void *s, size_t n, void *st) { (void)st; memcpy((void *)(size_t)d, s, n); return 0; }
int cuMemcpyDtoHAsync_v2(void *d, dptr s, size_t n, void *st) { (void)st; memcpy(d, (void *)(size_t)s, n); return 0; }
int cuMemcpyDtoDAsync_v2(dptr d, dptr s, size_t n, void *st) { (void)st; memmove((void *)(size_t)d, (void *)(size_t)s, n); return 0; }
/* What cudarc's own slices call (alloc, memset, sync). */
int cuMemsetD8Async(dptr d, unsigned char v, size_t n, void *st) { (void)st; memset((void *)(size_t)d, v, n); return 0; }
int cuStreamSynchronize(void *s) { (void)s; return 0; }
int cuEventQuery(void *e) { (void)e; return 0; }
int cuEventSynchronize(void *e) { (void)e; return 0; }
