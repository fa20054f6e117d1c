/*
 * A stand-in for libhccl.so, for accel's npu-hccl glue tests only.
 *
 * Collectives work for one rank and copy (the identity of every collective
 * over one rank) on host memory posing as device memory. Send/receive work
 * between the ranks of one process (threads) through in-memory queues.
 * Calls complete synchronously. It records the arguments of the last call
 * so that tests can check the codes the backend passes. Prototypes follow
 * the public HCCL documentation. Passing tests against it say nothing
 * about real HCCL.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define ROOT_BYTES 4108
#define E_PARA 1
#define E_PTR 2
#define E_NOT_SUPPORT 5
#define E_TIMEOUT 9
#define MAX_RANKS 4

struct comm {
    uint32_t rank, ranks;
};

struct msg {
    struct msg *next;
    size_t len;
    unsigned char data[];
};

static atomic_int fail_next;
static atomic_int async_error;
static atomic_long calls;
static atomic_long last_count, last_dtype, last_op, last_root;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct msg *queue[MAX_RANKS][MAX_RANKS];

int stub_hccl_set(const char *what, int value) {
    if (strcmp(what, "fail_next") == 0) return atomic_exchange(&fail_next, value);
    if (strcmp(what, "async_error") == 0) return atomic_exchange(&async_error, value);
    return -1;
}

long stub_hccl_calls(void) { return atomic_load(&calls); }

long stub_hccl_last(const char *what) {
    if (strcmp(what, "count") == 0) return atomic_load(&last_count);
    if (strcmp(what, "dtype") == 0) return atomic_load(&last_dtype);
    if (strcmp(what, "op") == 0) return atomic_load(&last_op);
    if (strcmp(what, "root") == 0) return atomic_load(&last_root);
    return -1;
}

static size_t size_of(int dtype) {
    switch (dtype) {
    case 0: case 7: return 1;
    case 1: case 3: case 8: case 11: return 2;
    case 2: case 4: case 9: return 4;
    case 5: case 6: case 10: return 8;
    default: return 0;
    }
}

/* Count the call, record its arguments, and fail it when asked to. */
static int enter(uint64_t count, int dtype, int op, long root) {
    atomic_fetch_add(&calls, 1);
    atomic_store(&last_count, (long)count);
    atomic_store(&last_dtype, dtype);
    atomic_store(&last_op, op);
    atomic_store(&last_root, root);
    int rc = atomic_exchange(&fail_next, 0);
    if (rc) return rc;
    if (size_of(dtype) == 0) return E_PARA;
    return 0;
}

static int one_rank(void *comm) {
    struct comm *c = comm;
    if (c == NULL) return E_PTR;
    return c->ranks == 1 ? 0 : E_NOT_SUPPORT;
}

/*
 * A collective over one rank: count, record and check the call (`op` when
 * `reduces`, `root` unless it is -1), then `recv` holds a copy of `send`.
 */
static int one_rank_copy(const void *send, void *recv, uint64_t count, int dtype, int op, int reduces,
                         long root, void *comm) {
    int rc = enter(count, dtype, op, root);
    if (rc || (rc = one_rank(comm))) return rc;
    if (reduces && (op < 0 || op > 3)) return E_PARA;
    if (root != -1 && root != 0) return E_PARA;
    memmove(recv, send, count * size_of(dtype));
    return 0;
}

const char *HcclGetErrorString(int code) {
    switch (code) {
    case 0: return "no error";
    case E_PARA: return "stub: parameter error";
    case 4: return "stub: internal error";
    case E_NOT_SUPPORT: return "stub: not supported";
    case E_TIMEOUT: return "stub: timeout";
    case 13: return "stub: tcp transfer failed";
    default: return "stub: error";
    }
}

int HcclGetRootInfo(void *info) {
    if (info == NULL) return E_PTR;
    memset(info, 0x5A, ROOT_BYTES);
    memcpy(info, "accel-stub-root", 15);
    return 0;
}

int HcclCommInitRootInfo(uint32_t ranks, const void *info, uint32_t rank, void **comm) {
    if (info == NULL || comm == NULL) return E_PTR;
    if (ranks == 0 || ranks > MAX_RANKS || rank >= ranks) return E_PARA;
    if (memcmp(info, "accel-stub-root", 15) != 0) return E_PARA;
    struct comm *c = malloc(sizeof *c);
    if (c == NULL) return 3;
    c->rank = rank;
    c->ranks = ranks;
    *comm = c;
    return 0;
}

int HcclCommDestroy(void *comm) {
    free(comm);
    return 0;
}

int HcclGetCommAsyncError(void *comm, int *error) {
    if (comm == NULL || error == NULL) return E_PTR;
    *error = atomic_load(&async_error);
    return 0;
}

int HcclAllReduce(void *send, void *recv, uint64_t count, int dtype, int op, void *comm, void *stream) {
    (void)stream;
    return one_rank_copy(send, recv, count, dtype, op, 1, -1, comm);
}

int HcclReduce(void *send, void *recv, uint64_t count, int dtype, int op, uint32_t root, void *comm, void *stream) {
    (void)stream;
    return one_rank_copy(send, recv, count, dtype, op, 1, root, comm);
}

int HcclBroadcast(void *buf, uint64_t count, int dtype, uint32_t root, void *comm, void *stream) {
    (void)stream;
    (void)buf;
    int rc = enter(count, dtype, -1, root);
    if (rc || (rc = one_rank(comm))) return rc;
    return root == 0 ? 0 : E_PARA;
}

int HcclAllGather(void *send, void *recv, uint64_t count, int dtype, void *comm, void *stream) {
    (void)stream;
    return one_rank_copy(send, recv, count, dtype, -1, 0, -1, comm);
}

int HcclReduceScatter(void *send, void *recv, uint64_t count, int dtype, int op, void *comm, void *stream) {
    (void)stream;
    return one_rank_copy(send, recv, count, dtype, op, 1, -1, comm);
}

int HcclScatter(void *send, void *recv, uint64_t count, int dtype, uint32_t root, void *comm, void *stream) {
    (void)stream;
    return one_rank_copy(send, recv, count, dtype, -1, 0, root, comm);
}

int HcclAlltoAll(const void *send, uint64_t send_count, int send_type, const void *recv, uint64_t recv_count,
                 int recv_type, void *comm, void *stream) {
    (void)stream;
    int rc = enter(send_count, send_type, -1, -1);
    if (rc || (rc = one_rank(comm))) return rc;
    if (send_count != recv_count || send_type != recv_type) return E_PARA;
    memmove((void *)recv, send, send_count * size_of(send_type));
    return 0;
}

int HcclBarrier(void *comm, void *stream) {
    (void)stream;
    int rc = enter(0, 0, -1, -1);
    if (rc) return rc;
    return comm ? 0 : E_PTR;
}

/* Count, record and check a send to or receive from `peer` (another rank):
 * the message's size in bytes, or minus the error code. */
static long enter_p2p(uint64_t count, int dtype, uint32_t peer, const struct comm *c) {
    int rc = enter(count, dtype, -1, peer);
    if (rc) return -rc;
    if (c == NULL) return -E_PTR;
    if (peer >= c->ranks || peer == c->rank) return -E_PARA;
    return (long)(count * size_of(dtype));
}

/* The communicator is HCCL's opaque `HcclComm` (a pointer): here, ours. */
int HcclSend(void *buf, uint64_t count, int dtype, uint32_t dst, struct comm *c, void *stream) {
    (void)stream;
    long len = enter_p2p(count, dtype, dst, c);
    if (len < 0) return (int)-len;
    struct msg *m = malloc(sizeof *m + len);
    if (m == NULL) return 3;
    m->next = NULL;
    m->len = len;
    memcpy(m->data, buf, len);
    pthread_mutex_lock(&lock);
    struct msg **tail = &queue[c->rank][dst];
    while (*tail) tail = &(*tail)->next;
    *tail = m;
    pthread_mutex_unlock(&lock);
    return 0;
}

/* Waits up to 5 s for the peer's send (the stub is synchronous). */
int HcclRecv(void *buf, uint64_t count, int dtype, uint32_t src, struct comm *c, void *stream) {
    (void)stream;
    long len = enter_p2p(count, dtype, src, c);
    if (len < 0) return (int)-len;
    for (int i = 0; i < 5000; i++) {
        pthread_mutex_lock(&lock);
        struct msg *m = queue[src][c->rank];
        if (m != NULL) {
            if (m->len != (size_t)len) {
                pthread_mutex_unlock(&lock);
                return E_PARA;
            }
            queue[src][c->rank] = m->next;
            pthread_mutex_unlock(&lock);
            memcpy(buf, m->data, len);
            free(m);
            return 0;
        }
        pthread_mutex_unlock(&lock);
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    return E_TIMEOUT;
}
