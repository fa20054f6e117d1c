/* raw_mpi_bench: MPI's all-reduce timed the way `accel bench` times it,
 * with no accel in between. The raw-MPI baseline of
 * scripts/bench_collectives.sh.
 *
 * Build (the script does this):
 *   mpicc -O2 -o raw_mpi_bench raw_mpi_bench.c
 *
 * Run under the MPI launcher, one process per rank:
 *   mpirun -n 2 raw_mpi_bench [--min 4K] [--max 64M] [--iters 20]
 *                             [--warmup 5] [--mode blocking]
 *
 * For each size (doubling from --min to --max, f32, sum, zero-filled
 * buffer, in place): `warmup` untimed all-reduces, then `iters` times
 * { barrier; t0; all-reduce; t1 }. The time of an iteration is the
 * largest over ranks (MPI_Allreduce with MPI_MAX over the per-iteration
 * times, after the size); the reported time is the median of those. Rank 0
 * prints one line per size:
 *   size_bytes count median_us min_us
 *
 * --mode picks the all-reduce:
 *   blocking  MPI_Allreduce(MPI_IN_PLACE, ...)        (default: plain MPI)
 *   test      MPI_Iallreduce(MPI_IN_PLACE, ...), then MPI_Test in a loop
 *             until done, and the barrier likewise (MPI_Ibarrier + MPI_Test):
 *             how accel's mpi backend calls MPI, without accel
 *   wait      MPI_Iallreduce(MPI_IN_PLACE, ...), then MPI_Wait (blocking
 *             MPI_Barrier)
 *
 * RAW_MPI_THREAD=multiple initializes MPI at MPI_THREAD_MULTIPLE (what
 * accel's mpi backend asks for) instead of plain MPI_Init.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum mode { BLOCKING, TEST, WAIT };

static size_t parse_size(const char *s) {
  char *end = NULL;
  double v = strtod(s, &end);
  double mul = 1;
  if (!strcmp(end, "K") || !strcmp(end, "k") || !strcmp(end, "KiB")) {
    mul = 1024.0;
  } else if (!strcmp(end, "M") || !strcmp(end, "m") || !strcmp(end, "MiB")) {
    mul = 1024.0 * 1024;
  } else if (!strcmp(end, "G") || !strcmp(end, "g") || !strcmp(end, "GiB")) {
    mul = 1024.0 * 1024 * 1024;
  } else if (*end && strcmp(end, "B")) {
    fprintf(stderr, "raw_mpi_bench: bad size: %s\n", s);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return (size_t)(v * mul);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static void finish(MPI_Request *req, enum mode m) {
  if (m == WAIT) {
    MPI_Wait(req, MPI_STATUS_IGNORE);
    return;
  }
  int done = 0;
  while (!done) MPI_Test(req, &done, MPI_STATUS_IGNORE);
}

static void allreduce(float *buf, int count, enum mode m) {
  if (m == BLOCKING) {
    MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    return;
  }
  MPI_Request req;
  MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
  finish(&req, m);
}

static void barrier(enum mode m) {
  if (m != TEST) {
    MPI_Barrier(MPI_COMM_WORLD);
    return;
  }
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  finish(&req, m);
}

int main(int argc, char **argv) {
  /* RAW_MPI_THREAD=multiple: MPI_Init_thread(MPI_THREAD_MULTIPLE), the
   * level accel's mpi backend asks for (so that its cost can be told apart
   * from accel's own). */
  const char *thread = getenv("RAW_MPI_THREAD");
  if (thread && !strcmp(thread, "multiple")) {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    if (provided != MPI_THREAD_MULTIPLE) {
      fprintf(stderr, "raw_mpi_bench: MPI_THREAD_MULTIPLE not granted (%d)\n", provided);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  } else {
    MPI_Init(&argc, &argv);
  }
  int rank, size;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const char *min_s = "4K", *max_s = "64M";
  int iters = 20, warmup = 5;
  enum mode m = BLOCKING;
  for (int i = 1; i + 1 < argc; i += 2) {
    const char *k = argv[i], *v = argv[i + 1];
    if (!strcmp(k, "--min")) min_s = v;
    else if (!strcmp(k, "--max")) max_s = v;
    else if (!strcmp(k, "--iters")) iters = atoi(v);
    else if (!strcmp(k, "--warmup")) warmup = atoi(v);
    else if (!strcmp(k, "--mode") && !strcmp(v, "blocking")) m = BLOCKING;
    else if (!strcmp(k, "--mode") && !strcmp(v, "test")) m = TEST;
    else if (!strcmp(k, "--mode") && !strcmp(v, "wait")) m = WAIT;
    else {
      if (rank == 0) fprintf(stderr, "raw_mpi_bench: bad flag %s %s\n", k, v);
      MPI_Finalize();
      return 2;
    }
  }
  if (iters < 1 || (argc - 1) % 2) {
    if (rank == 0)
      fprintf(stderr,
              "usage: raw_mpi_bench [--min 4K] [--max 64M] [--iters 20] [--warmup 5] "
              "[--mode blocking|test|wait]\n");
    MPI_Finalize();
    return 2;
  }
  const size_t lo = parse_size(min_s), hi = parse_size(max_s);
  double *mine = malloc(sizeof(double) * (size_t)iters);
  double *worst = malloc(sizeof(double) * (size_t)iters);
  for (size_t bytes = lo; bytes <= hi; bytes *= 2) {
    const size_t count = bytes / sizeof(float);
    float *buf = calloc(count ? count : 1, sizeof(float));
    if (!buf || !mine || !worst) {
      fprintf(stderr, "raw_mpi_bench: out of memory\n");
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int i = 0; i < warmup; i++) allreduce(buf, (int)count, m);
    for (int i = 0; i < iters; i++) {
      barrier(m);
      double t0 = now_us();
      allreduce(buf, (int)count, m);
      mine[i] = now_us() - t0;
    }
    MPI_Allreduce(mine, worst, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (rank == 0) {
      double mn = worst[0];
      for (int i = 1; i < iters; i++)
        if (worst[i] < mn) mn = worst[i];
      qsort(worst, (size_t)iters, sizeof(double), cmp_double);
      double med = iters % 2 ? worst[iters / 2] : (worst[iters / 2 - 1] + worst[iters / 2]) / 2;
      printf("%zu %zu %.2f %.2f\n", bytes, count, med, mn);
      fflush(stdout);
    }
    free(buf);
    if (bytes == 0) break;
  }
  free(mine);
  free(worst);
  MPI_Finalize();
  return 0;
}
