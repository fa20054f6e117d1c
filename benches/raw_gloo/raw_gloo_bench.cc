// raw_gloo_bench: Gloo's ring all-reduce timed the way `accel bench` times
// it, with no accel in between. The baseline of scripts/bench_gloo.sh.
//
// Build (the script does this):
//   g++ -std=c++17 -O3 -o raw_gloo_bench raw_gloo_bench.cc -lgloo -pthread
//
// Run one process per rank, all with the same store directory:
//   raw_gloo_bench --rank R --size N --store DIR [--min 4K] [--max 64M]
//                  [--iters 20] [--warmup 5] [--timeout-ms 300000]
//
// Rendezvous: Gloo's own FileStore in DIR (under a PrefixStore), TCP
// transport on 127.0.0.1, as accel's cpu-gloo backend uses for a run on one
// machine. For each size (doubling from --min to --max, f32, sum): `warmup`
// untimed all-reduces, then `iters` times { barrier; t0; allreduce; t1 }.
// The time of an iteration is the largest over ranks (the per-rank times are
// all-gathered after each size); the reported time is the median of those.
// Rank 0 prints one line per size:
//   size_bytes count median_us min_us
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>

namespace {

size_t parse_size(const std::string& s) {
  size_t end = 0;
  double v = std::stod(s, &end);
  std::string unit = s.substr(end);
  double mul = 1;
  if (unit == "K" || unit == "k" || unit == "KiB") {
    mul = 1024.0;
  } else if (unit == "M" || unit == "m" || unit == "MiB") {
    mul = 1024.0 * 1024;
  } else if (unit == "G" || unit == "g" || unit == "GiB") {
    mul = 1024.0 * 1024 * 1024;
  } else if (!unit.empty() && unit != "B") {
    throw std::invalid_argument("bad size: " + s);
  }
  return static_cast<size_t>(v * mul);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  int rank = -1, size = -1, iters = 20, warmup = 5;
  int64_t timeout_ms = 300000;
  std::string store_dir, min_s = "4K", max_s = "64M";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--rank") rank = std::atoi(v.c_str());
    else if (k == "--size") size = std::atoi(v.c_str());
    else if (k == "--store") store_dir = v;
    else if (k == "--min") min_s = v;
    else if (k == "--max") max_s = v;
    else if (k == "--iters") iters = std::atoi(v.c_str());
    else if (k == "--warmup") warmup = std::atoi(v.c_str());
    else if (k == "--timeout-ms") timeout_ms = std::atoll(v.c_str());
    else {
      std::fprintf(stderr, "raw_gloo_bench: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (rank < 0 || size < 1 || rank >= size || store_dir.empty() || iters < 1) {
    std::fprintf(stderr,
                 "usage: raw_gloo_bench --rank R --size N --store DIR [--min 4K] "
                 "[--max 64M] [--iters 20] [--warmup 5] [--timeout-ms MS]\n");
    return 2;
  }
  const auto timeout = std::chrono::milliseconds(timeout_ms);
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    auto dev = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore file_store(store_dir);
    gloo::rendezvous::PrefixStore store("raw-gloo-bench", file_store);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(timeout);
    ctx->connectFullMesh(store, dev);

    uint32_t tag = 0;
    auto barrier = [&] {
      gloo::BarrierOptions opts(ctx);
      opts.setTag(tag++);
      opts.setTimeout(timeout);
      gloo::barrier(opts);
    };
    using ReduceFn = void (*)(void*, const void*, const void*, size_t);
    ReduceFn sum = &gloo::sum<float>;

    const size_t lo = parse_size(min_s), hi = parse_size(max_s);
    for (size_t bytes = lo; bytes <= hi; bytes *= 2) {
      const size_t count = bytes / sizeof(float);
      std::vector<float> buf(count, 0.0f);
      auto allreduce = [&] {
        gloo::AllreduceOptions opts(ctx);
        opts.setOutput(buf.data(), count);
        opts.setReduceFunction(sum);
        opts.setTag(tag++);
        opts.setTimeout(timeout);
        gloo::allreduce(opts);
      };
      for (int i = 0; i < warmup; i++) allreduce();
      std::vector<double> mine(iters);
      for (int i = 0; i < iters; i++) {
        barrier();
        auto t0 = std::chrono::steady_clock::now();
        allreduce();
        auto t1 = std::chrono::steady_clock::now();
        mine[i] = std::chrono::duration<double, std::micro>(t1 - t0).count();
      }
      std::vector<double> all(static_cast<size_t>(iters) * size);
      gloo::AllgatherOptions g(ctx);
      g.setInput(mine.data(), mine.size());
      g.setOutput(all.data(), all.size());
      g.setTag(tag++);
      g.setTimeout(timeout);
      gloo::allgather(g);
      if (rank == 0) {
        std::vector<double> worst(iters, 0.0);
        for (int r = 0; r < size; r++)
          for (int i = 0; i < iters; i++)
            worst[i] = std::max(worst[i], all[static_cast<size_t>(r) * iters + i]);
        double mn = *std::min_element(worst.begin(), worst.end());
        std::printf("%zu %zu %.2f %.2f\n", bytes, count, median(worst), mn);
        std::fflush(stdout);
      }
      if (bytes == 0) break;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "raw_gloo_bench rank %d: %s\n", rank, e.what());
    return 1;
  } catch (...) {
    std::fprintf(stderr, "raw_gloo_bench rank %d: unknown exception\n", rank);
    return 1;
  }
  return 0;
}
