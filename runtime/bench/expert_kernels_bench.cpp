// refit-expert-bench (CUDA builds): the bf16 engine's routed-expert kernels alone on one GPU, per
// decode batch, against the device-copy bound measured in the same run. For each batch size:
// uniform top-k routing (seeded), the counting sort once, then gate_up + down of every layer of
// a ring of distinct layers (larger than L2) through the tensor-core kernel (expert_mma) at
// each k-split and register staging (path "mma [auto] <ksplit up>/<ksplit down> c<chunks>",
// the weights streamed with an L2 evict-first policy; "... l2-normal" without it), and the
// expert GEMV path (gemv + SiLU + gemv) where it applies. The bytes are
// the non-empty experts' weights; `ratio` = bytes / time / copy bound (read + write).
//
// With --engine-paths only the engine's default staging (auto k-split, 2 chunks, 4 cp.async
// stages, early) and its resident-warp variants ("... early persistent":
// expert_mma_args::persistent, with 4 and with 8 stages) run, each twice in turn (the spread
// shows).
//
//   refit-expert-bench [--batch 1,16,64,256] [--experts 128] [--top-k 8] [--hidden 2048]
//                      [--inter 768] [--layers 6] [--repeat 10] [--engine-paths] [--json]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/bench/device_bucket.hpp"
#include "runtime/cuda/cuda.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace {

namespace cuda = refit::cuda;
namespace kernels = refit::inference::kernels;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct options {
  std::vector<int> batches{1, 16, 64, 256};
  int experts = 128, top_k = 8, hidden = 2048, inter = 768, layers = 6, repeat = 10;
  bool json = false;
  bool engine_paths = false;
};

int whole(const std::string& flag, const char* v) {
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*v == '\0' || *end != '\0' || n < 1 || n > 1 << 20)
    throw std::invalid_argument(flag + " " + v + " is not a whole number in [1, 1048576]");
  return static_cast<int>(n);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      o.json = true;
      continue;
    }
    if (a == "--engine-paths") {
      o.engine_paths = true;
      continue;
    }
    if (i + 1 >= argc)
      throw std::invalid_argument(a + " needs a value (or is not a flag of refit-expert-bench)");
    const char* v = argv[++i];
    if (a == "--batch") {
      o.batches.clear();
      std::string list = v, item;
      for (std::size_t p = 0; p <= list.size(); ++p)
        if (p == list.size() || list[p] == ',') {
          o.batches.push_back(whole(a, item.c_str()));
          item.clear();
        } else {
          item += list[p];
        }
    } else if (a == "--experts") {
      o.experts = whole(a, v);
    } else if (a == "--top-k") {
      o.top_k = whole(a, v);
    } else if (a == "--hidden") {
      o.hidden = whole(a, v);
    } else if (a == "--inter") {
      o.inter = whole(a, v);
    } else if (a == "--layers") {
      o.layers = whole(a, v);
    } else if (a == "--repeat") {
      o.repeat = whole(a, v);
    } else {
      throw std::invalid_argument(a + " is not a flag of refit-expert-bench");
    }
  }
  if (o.top_k > o.experts)
    throw std::invalid_argument("--top-k " + std::to_string(o.top_k) + " exceeds --experts "
                                + std::to_string(o.experts));
  return o;
}

// `n` elements of T on cuda:0, every byte set to `fill`.
template <class T>
cuda::device_array<T> filled(std::size_t n, int fill) {
  cuda::device_array<T> a(0, n, "bench buffer");
  check(cudaMemset(a.p, fill, n * sizeof(T)), "cudaMemset");
  return a;
}

struct timer {
  cudaStream_t s;
  cudaEvent_t a, b;
  explicit timer(cudaStream_t stream) : s(stream) {
    check(cudaEventCreate(&a), "cudaEventCreate");
    check(cudaEventCreate(&b), "cudaEventCreate");
  }
  ~timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  template <class F>
  double seconds(F&& f) {
    check(cudaEventRecord(a, s), "cudaEventRecord");
    f();
    check(cudaEventRecord(b, s), "cudaEventRecord");
    check(cudaEventSynchronize(b), "cudaEventSynchronize");
    check(cudaGetLastError(), "a kernel");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    return ms * 1e-3;
  }
};

} // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  using bf16_bits = unsigned short;
  const int e = o.experts, h = o.hidden, in = o.inter;
  const std::size_t w13_n = std::size_t(e) * 2 * in * h, w2_n = std::size_t(e) * h * in;
  std::vector<cuda::device_array<bf16_bits>> w13, w2;
  for (int l = 0; l < o.layers; ++l) { // 0x3c3c: bf16 0.0115, finite through SiLU
    w13.push_back(filled<bf16_bits>(w13_n, 0x3c));
    w2.push_back(filled<bf16_bits>(w2_n, 0x3c));
  }
  const int max_batch = *std::max_element(o.batches.begin(), o.batches.end());
  const std::size_t max_copies = std::size_t(max_batch) * o.top_k;
  const auto x = filled<bf16_bits>(std::size_t(max_batch) * h, 0x3c);
  const cuda::device_array<bf16_bits> act(0, max_copies * in, "bench buffer"),
    ys(0, max_copies * h, "bench buffer"), gate_up(0, max_copies * 2 * in, "bench buffer");
  cudaStream_t s = nullptr;
  check(cudaStreamCreate(&s), "cudaStreamCreate");
  timer t(s);

  const std::size_t bound_bytes = std::size_t{256} << 20;
  const cuda::device_array<char> c0(0, bound_bytes, "copy bound"), c1(0, bound_bytes, "copy bound");
  std::vector<double> copies_s;
  for (int r = 0; r < 10; ++r)
    copies_s.push_back(t.seconds([&] {
      check(cudaMemcpyAsync(c1.p, c0.p, bound_bytes, cudaMemcpyDeviceToDevice, s), "copy");
    }));
  std::sort(copies_s.begin(), copies_s.end());
  const double bound_gbps = 2.0 * bound_bytes / copies_s[copies_s.size() / 2] / 1e9;

  nlohmann::json out = {{"bench", "expert_kernels"},
                        {"copy_bound_gbps", bound_gbps},
                        {"bound_method", "cudaMemcpyAsync device-to-device of 256 MiB, median of "
                                         "10, bytes read + written"},
                        {"experts", e},
                        {"top_k", o.top_k},
                        {"hidden", h},
                        {"inter", in},
                        {"layers", o.layers},
                        {"repeat", o.repeat},
                        {"rows", nlohmann::json::array()}};
  if (!o.json)
    std::printf("copy bound %.0f GB/s (read + write)\n", bound_gbps);
  for (const int batch : o.batches) {
    std::mt19937 rng(static_cast<unsigned>(batch));
    std::vector<std::int64_t> ids;
    std::vector<int> pool(static_cast<std::size_t>(e));
    for (int token = 0; token < batch; ++token) {
      std::iota(pool.begin(), pool.end(), 0);
      std::shuffle(pool.begin(), pool.end(), rng);
      ids.insert(ids.end(), pool.begin(), pool.begin() + o.top_k);
    }
    const std::set<std::int64_t> used(ids.begin(), ids.end());
    const int copies = batch * o.top_k;
    const cuda::device_array<std::int64_t> d_ids(0, ids, "routed ids");
    const refit::bench::device_bucket d(0, copies, e, {0});
    kernels::bucket(d_ids.p, copies, o.top_k, e, d.out(), s);
    const double bytes = double(used.size()) * 3.0 * h * in * 2.0;
    const auto measure = [&](const std::string& path, auto&& step) {
      step(0); // warm-up
      const double sec = t.seconds([&] {
        for (int r = 0; r < o.repeat; ++r)
          for (int l = 0; l < o.layers; ++l)
            step(l);
      }) / (double(o.repeat) * o.layers);
      const double gbps = bytes / sec / 1e9;
      if (!o.json)
        std::printf("batch %4d  experts %3zu  %-14s %9.1f us  %6.0f GB/s  ratio %.3f\n", batch,
                    used.size(), path.c_str(), sec * 1e6, gbps, gbps / bound_gbps);
      out["rows"].push_back({{"batch", batch},
                             {"experts_used", used.size()},
                             {"path", path},
                             {"layer_us", sec * 1e6},
                             {"gbps", gbps},
                             {"ratio", gbps / bound_gbps}});
    };
    struct variant {
      int chunks, wanted; // wanted k-split; 0: chosen
      bool evict_first;   // the weight stream's L2 policy
      int stages;         // expert_mma_args::stages
      bool early;         // expert_mma_args::early
      bool persistent;    // expert_mma_args::persistent (at k-split 1)
    };
    std::vector<variant> variants;
    if (o.engine_paths) {
      for (int round = 0; round < 2; ++round) {
        variants.push_back({2, 0, true, 4, true, false});
        variants.push_back({2, 0, true, 4, true, true});
        variants.push_back({2, 0, true, 8, true, true});
      }
    } else {
      for (const int stages : {0, 4, 8})
        for (const int chunks : {4, 2, 1})
          for (const int wanted : {0, 1, 2, 4})
            if (stages < 8 || chunks < 4)
              variants.push_back({chunks, wanted, true, stages, false, false});
      for (const int chunks : {2, 1}) {
        variants.push_back({chunks, 0, false, 4, false, false});
        variants.push_back({chunks, 0, true, 4, true, false});
        variants.push_back({chunks, 0, true, 4, true, true});
      }
    }
    for (const auto& [chunks, wanted, evict_first, stages, early, persistent] : variants) {
      kernels::expert_mma_args up, down;
      up.max_chunks = down.max_chunks = chunks;
      up.evict_first = down.evict_first = evict_first;
      up.stages = down.stages = stages;
      up.early = down.early = early;
      up.x = x.p;
      up.x_rows = d.src_token.p;
      up.rows = 2 * in;
      up.k = h;
      up.glu = true;
      up.y = act.p;
      down.x = act.p;
      down.rows = h;
      down.k = in;
      down.y = ys.p;
      for (kernels::expert_mma_args* a : {&up, &down}) {
        a->active = d.active.p;
        a->active_count = d.active.p + e;
        a->counts = d.counts.p;
        a->offsets = d.offsets.p;
      }
      if (!kernels::expert_mma_supported(up) || !kernels::expert_mma_supported(down))
        break;
      const int ks_up = kernels::expert_mma_ksplit(up, copies, e, wanted);
      const int ks_down = kernels::expert_mma_ksplit(down, copies, e, wanted);
      if (ks_up == 0 || ks_down == 0)
        continue;
      up.persistent = persistent && ks_up == 1;
      down.persistent = persistent && ks_down == 1;
      if (persistent && !up.persistent && !down.persistent)
        continue; // no projection at k-split 1: the block-per-expert row already ran
      measure(std::string(wanted == 0 ? "mma auto " : "mma ") + std::to_string(ks_up) + "/"
                + std::to_string(ks_down) + " c" + std::to_string(chunks) + " s"
                + std::to_string(stages) + (evict_first ? "" : " l2-normal")
                + (early ? " early" : "") + (persistent ? " persistent" : ""),
              [&](int l) {
                up.w = w13[static_cast<std::size_t>(l)].p;
                down.w = w2[static_cast<std::size_t>(l)].p;
                kernels::expert_mma(up, copies, e, ks_up, s);
                kernels::expert_mma(down, copies, e, ks_down, s);
              });
    }
    if (kernels::expert_gemv_supported(copies, h, 64) && kernels::expert_gemv_supported(copies, in, 64))
      measure("gemv", [&](int l) {
        kernels::gemv_args g;
        g.x = x.p;
        g.x_rows = d.src_token.p;
        g.w = w13[static_cast<std::size_t>(l)].p;
        g.ids = d_ids.p;
        g.order = d.order.p;
        g.counts = d.counts.p;
        g.offsets = d.offsets.p;
        g.y = gate_up.p;
        g.copies = copies;
        g.n = 2 * in;
        g.k = h;
        kernels::expert_gemv(g, s);
        kernels::silu_mul(gate_up.p, act.p, copies, in, s);
        g.x = act.p;
        g.x_rows = nullptr;
        g.w = w2[static_cast<std::size_t>(l)].p;
        g.y = ys.p;
        g.n = h;
        g.k = in;
        kernels::expert_gemv(g, s);
      });
  }
  if (o.json)
    std::printf("%s\n", out.dump(1).c_str());
  cudaStreamDestroy(s);
  return 0;
} catch (const std::exception& ex) {
  std::fprintf(stderr, "refit-expert-bench: %s\n", ex.what());
  return 1;
}
