/* A fake NCCL whose ranks are threads of one process, for accel's glue
 * tests of what needs two ranks: the bootstrap through the store, the
 * point-to-point header protocol, grouped send/recv offsets. Collectives
 * rendezvous in process memory; only what the test uses is implemented:
 * f32 and i32 sums, broadcast, all_gather, buffered send/recv. It proves
 * nothing about NCCL. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
enum { ok = 0, invalid_argument = 4, in_progress = 7 };
#define MAXR 8

struct msg { struct msg *next; size_t bytes; char data[]; };
struct world {
  char id[128]; int n, joined;
  pthread_mutex_t mu; pthread_cond_t cv;
  /* collective rendezvous */
  int arrived, generation;
  const void *in[MAXR]; void *out[MAXR];
  struct msg *q[MAXR][MAXR]; /* q[src][dst] */
};
struct fake_comm { struct world *w; int rank; int state; };
typedef struct fake_comm *ncclComm_t;

static pthread_mutex_t reg = PTHREAD_MUTEX_INITIALIZER;
static struct world *worlds[16];
static int nworlds;
static unsigned counter;

static size_t dt_size(int t) {
  switch (t) { case 0: case 1: return 1; case 2: case 3: case 7: return 4;
               case 4: case 5: case 8: return 8; case 6: case 9: return 2; default: return 0; }
}

int ncclGetVersion(int *v) { *v = 22803; return ok; }
int ncclGetUniqueId(ncclUniqueId *id) {
  memset(id, 0, sizeof *id);
  pthread_mutex_lock(&reg); unsigned c = ++counter; pthread_mutex_unlock(&reg);
  memcpy(id->internal, &c, sizeof c);
  return ok;
}
const char *ncclGetErrorString(int r) { (void)r; return "fake error"; }
const char *ncclGetLastError(ncclComm_t c) { (void)c; return "fake last error"; }

int ncclCommInitRankConfig(ncclComm_t *c, int n, ncclUniqueId id, int rank, void *cfg) {
  (void)cfg;
  if (n < 1 || n > MAXR || rank < 0 || rank >= n) return invalid_argument;
  pthread_mutex_lock(&reg);
  struct world *w = NULL;
  for (int i = 0; i < nworlds; i++) if (!memcmp(worlds[i]->id, id.internal, 128)) w = worlds[i];
  if (!w) {
    w = calloc(1, sizeof *w);
    memcpy(w->id, id.internal, 128); w->n = n;
    pthread_mutex_init(&w->mu, NULL); pthread_cond_init(&w->cv, NULL);
    worlds[nworlds++] = w;
  }
  w->joined++;
  pthread_mutex_unlock(&reg);
  *c = calloc(1, sizeof **c);
  (*c)->w = w; (*c)->rank = rank; (*c)->state = in_progress;
  return in_progress;
}
int ncclCommGetAsyncError(ncclComm_t c, int *st) {
  *st = c->state;
  if (c->state == in_progress) {
    pthread_mutex_lock(&c->w->mu);
    if (c->w->joined == c->w->n) c->state = ok;
    pthread_mutex_unlock(&c->w->mu);
  }
  return ok;
}
int ncclCommAbort(ncclComm_t c) { free(c); return ok; }
int ncclCommFinalize(ncclComm_t c) { (void)c; return ok; }
int ncclCommDestroy(ncclComm_t c) { free(c); return ok; }
int ncclCommSplit(ncclComm_t c, int color, int key, ncclComm_t *out, void *cfg) {
  (void)c; (void)color; (void)key; (void)out; (void)cfg; return invalid_argument;
}
int ncclCommCount(ncclComm_t c, int *n) { *n = c->w->n; return ok; }
int ncclCommUserRank(ncclComm_t c, int *r) { *r = c->rank; return ok; }

/* Every rank posts its buffers; once all have, each computes its result
 * into a scratch buffer (buffers may be in place, so nobody writes before
 * everyone has read), and after a second rendezvous copies it out. */
static void rendezvous(struct world *w) {
  int gen = w->generation;
  if (++w->arrived == w->n) { w->arrived = 0; w->generation++; pthread_cond_broadcast(&w->cv); }
  else while (gen == w->generation) pthread_cond_wait(&w->cv, &w->mu);
}
typedef void (*compute_fn)(struct world *, void *tmp, size_t n, int t, int root);
static int collective(ncclComm_t c, const void *in, void *out, size_t n, int t, int root,
                      size_t out_bytes, compute_fn f) {
  struct world *w = c->w;
  void *tmp = malloc(out_bytes ? out_bytes : 1);
  pthread_mutex_lock(&w->mu);
  w->in[c->rank] = in; w->out[c->rank] = out;
  rendezvous(w);
  if (f) f(w, tmp, n, t, root); else memcpy(tmp, out, out_bytes);
  rendezvous(w);
  memcpy(out, tmp, out_bytes);
  pthread_mutex_unlock(&w->mu);
  free(tmp);
  return ok;
}
static void sum(struct world *w, void *tmp, size_t n, int t, int root) {
  (void)root;
  if (t == 7) { float *o = tmp; for (size_t i = 0; i < n; i++) { o[i] = 0; for (int k = 0; k < w->n; k++) o[i] += ((const float *)w->in[k])[i]; } }
  else if (t == 2) { int *o = tmp; for (size_t i = 0; i < n; i++) { o[i] = 0; for (int k = 0; k < w->n; k++) o[i] += ((const int *)w->in[k])[i]; } }
}
static void bcast(struct world *w, void *tmp, size_t n, int t, int root) {
  memcpy(tmp, w->in[root], n * dt_size(t));
}
static void gather_all(struct world *w, void *tmp, size_t n, int t, int root) {
  (void)root; size_t b = n * dt_size(t);
  for (int k = 0; k < w->n; k++) memcpy((char *)tmp + k * b, w->in[k], b);
}
int ncclAllReduce(const void *s, void *d, size_t n, int t, int op, ncclComm_t c, void *st) {
  (void)op; (void)st; return collective(c, s, d, n, t, 0, n * dt_size(t), sum);
}
int ncclBroadcast(const void *s, void *d, size_t n, int t, int root, ncclComm_t c, void *st) {
  (void)st; return collective(c, s, d, n, t, root, n * dt_size(t), bcast);
}
int ncclAllGather(const void *s, void *d, size_t n, int t, ncclComm_t c, void *st) {
  (void)st; return collective(c, s, d, n, t, 0, n * dt_size(t) * c->w->n, gather_all);
}
int ncclReduce(const void *s, void *d, size_t n, int t, int op, int root, ncclComm_t c, void *st) {
  (void)s; (void)d; (void)n; (void)t; (void)op; (void)root; (void)c; (void)st; return invalid_argument;
}
int ncclReduceScatter(const void *s, void *d, size_t n, int t, int op, ncclComm_t c, void *st) {
  (void)s; (void)d; (void)n; (void)t; (void)op; (void)c; (void)st; return invalid_argument;
}

/* Buffered point-to-point: a send copies into the queue at once; a receive
 * waits for the next message from its peer (in order) at ncclGroupEnd or
 * at once outside a group. */
struct pending { void *p; size_t bytes; int peer; };
static __thread struct pending recvs[64];
static __thread int nrecv, depth;
static __thread ncclComm_t last;
static int do_recv(ncclComm_t c, void *d, size_t bytes, int peer) {
  struct world *w = c->w;
  pthread_mutex_lock(&w->mu);
  while (!w->q[peer][c->rank]) pthread_cond_wait(&w->cv, &w->mu);
  struct msg *m = w->q[peer][c->rank];
  w->q[peer][c->rank] = m->next;
  pthread_mutex_unlock(&w->mu);
  int r = m->bytes == bytes ? ok : invalid_argument;
  if (r == ok) memcpy(d, m->data, bytes);
  free(m);
  return r;
}
int ncclSend(const void *s, size_t n, int t, int peer, ncclComm_t c, void *st) {
  (void)st; size_t b = n * dt_size(t);
  struct world *w = c->w;
  struct msg *m = malloc(sizeof *m + b); m->next = NULL; m->bytes = b; memcpy(m->data, s, b);
  pthread_mutex_lock(&w->mu);
  struct msg **tail = &w->q[c->rank][peer];
  while (*tail) tail = &(*tail)->next;
  *tail = m;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  last = c;
  return ok;
}
int ncclRecv(void *d, size_t n, int t, int peer, ncclComm_t c, void *st) {
  (void)st; last = c;
  if (depth) { recvs[nrecv].p = d; recvs[nrecv].bytes = n * dt_size(t); recvs[nrecv++].peer = peer; return ok; }
  return do_recv(c, d, n * dt_size(t), peer);
}
int ncclGroupStart(void) { depth++; return ok; }
int ncclGroupEnd(void) {
  if (--depth > 0) return ok;
  int r = ok;
  for (int i = 0; i < nrecv; i++) { int x = do_recv(last, recvs[i].p, recvs[i].bytes, recvs[i].peer); if (x) r = x; }
  nrecv = 0;
  return r;
}
