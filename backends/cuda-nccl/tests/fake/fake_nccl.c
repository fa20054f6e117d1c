/* A fake NCCL for accel's glue tests: one rank only (a group of size 1),
 * every reduction of one contribution is a copy, sends to self are matched
 * with receives in order at ncclGroupEnd. FAKE_NCCL_HANG=1 makes every
 * collective stay "in progress" forever (the engine must time out and
 * abort); FAKE_NCCL_REMOTE=1 makes it fail with ncclRemoteError. Aborts are
 * counted in the file named by FAKE_NCCL_ABORT_LOG. It proves nothing about
 * NCCL. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
struct fake_comm { int state; int rank; int n; int hung; };
typedef struct fake_comm *ncclComm_t;

enum { ok = 0, invalid_argument = 4, remote_error = 6, in_progress = 7 };

static size_t dt_size(int t) {
  switch (t) {
    case 0: case 1: return 1;        /* int8 uint8 */
    case 2: case 3: return 4;        /* int32 uint32 */
    case 4: case 5: return 8;        /* int64 uint64 */
    case 6: case 9: return 2;        /* f16 bf16 */
    case 7: return 4;                /* f32 */
    case 8: return 8;                /* f64 */
    default: return 0;
  }
}

static int after_call(ncclComm_t c) {
  if (getenv("FAKE_NCCL_HANG")) { c->hung = 1; return in_progress; }
  if (getenv("FAKE_NCCL_REMOTE")) { c->state = remote_error; return ok; }
  return ok;
}

int ncclGetVersion(int *v) { *v = 22803; return ok; }
int ncclGetUniqueId(ncclUniqueId *id) { memset(id, 7, sizeof *id); return ok; }
const char *ncclGetErrorString(int r) {
  return r == remote_error ? "remote process exited or there was a network error" : "fake error";
}
const char *ncclGetLastError(ncclComm_t c) { (void)c; return "fake last error"; }

int ncclCommInitRankConfig(ncclComm_t *c, int n, ncclUniqueId id, int rank, void *cfg) {
  (void)id; (void)cfg;
  if (n != 1 || rank != 0) return invalid_argument;
  *c = calloc(1, sizeof **c);
  (*c)->n = 1;
  (*c)->state = in_progress; /* non-blocking: ready at the first poll */
  return in_progress;
}
int ncclCommGetAsyncError(ncclComm_t c, int *st) {
  if (c->hung) { *st = in_progress; return ok; }
  *st = c->state;
  if (c->state == in_progress) c->state = ok;
  return ok;
}
int ncclCommAbort(ncclComm_t c) {
  const char *log = getenv("FAKE_NCCL_ABORT_LOG");
  if (log) { FILE *f = fopen(log, "a"); if (f) { fputs("abort\n", f); fclose(f); } }
  free(c);
  return ok;
}
int ncclCommFinalize(ncclComm_t c) { (void)c; return ok; }
int ncclCommDestroy(ncclComm_t c) { free(c); return ok; }
int ncclCommSplit(ncclComm_t c, int color, int key, ncclComm_t *out, void *cfg) {
  (void)c; (void)key; (void)cfg;
  if (color < 0) { *out = NULL; return ok; }
  *out = calloc(1, sizeof **out);
  (*out)->n = 1;
  return ok;
}
int ncclCommCount(ncclComm_t c, int *n) { *n = c->n; return ok; }
int ncclCommUserRank(ncclComm_t c, int *r) { *r = c->rank; return ok; }

static void copy(const void *s, void *d, size_t bytes) { if (s != d && bytes) memmove(d, s, bytes); }

int ncclAllReduce(const void *s, void *d, size_t n, int t, int op, ncclComm_t c, void *st) {
  (void)op; (void)st; copy(s, d, n * dt_size(t)); return after_call(c);
}
int ncclReduce(const void *s, void *d, size_t n, int t, int op, int root, ncclComm_t c, void *st) {
  (void)op; (void)st; if (root != 0) return invalid_argument; copy(s, d, n * dt_size(t)); return after_call(c);
}
int ncclBroadcast(const void *s, void *d, size_t n, int t, int root, ncclComm_t c, void *st) {
  (void)st; if (root != 0) return invalid_argument; copy(s, d, n * dt_size(t)); return after_call(c);
}
int ncclAllGather(const void *s, void *d, size_t n, int t, ncclComm_t c, void *st) {
  (void)st; copy(s, d, n * dt_size(t)); return after_call(c);
}
int ncclReduceScatter(const void *s, void *d, size_t n, int t, int op, ncclComm_t c, void *st) {
  (void)op; (void)st; copy(s, d, n * dt_size(t)); return after_call(c);
}

/* Point-to-point to self: queued, matched in order at ncclGroupEnd. */
#define MAXQ 4096
static struct { const void *p; size_t bytes; } sends[MAXQ];
static struct { void *p; size_t bytes; } recvs[MAXQ];
static int nsend, nrecv, depth;
static ncclComm_t last_comm;

static int match(void) {
  int r = ok;
  if (nsend != nrecv) r = invalid_argument; /* a real NCCL would hang */
  for (int i = 0; i < nsend && i < nrecv; i++) {
    if (sends[i].bytes != recvs[i].bytes) { r = invalid_argument; continue; }
    copy(sends[i].p, recvs[i].p, sends[i].bytes);
  }
  nsend = nrecv = 0;
  return r;
}
int ncclSend(const void *s, size_t n, int t, int peer, ncclComm_t c, void *st) {
  (void)st; if (peer != 0 || nsend >= MAXQ) return invalid_argument;
  sends[nsend].p = s; sends[nsend++].bytes = n * dt_size(t); last_comm = c;
  return depth ? ok : match();
}
int ncclRecv(void *d, size_t n, int t, int peer, ncclComm_t c, void *st) {
  (void)st; if (peer != 0 || nrecv >= MAXQ) return invalid_argument;
  recvs[nrecv].p = d; recvs[nrecv++].bytes = n * dt_size(t); last_comm = c;
  return depth ? ok : match();
}
int ncclGroupStart(void) { depth++; return ok; }
int ncclGroupEnd(void) {
  if (--depth > 0) return ok;
  int r = match();
  if (r == ok && last_comm) r = after_call(last_comm);
  return r;
}
