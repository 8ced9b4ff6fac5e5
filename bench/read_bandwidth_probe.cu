// Read-bandwidth probe (issue 16; bench/results/2026-12-04-h200-generate-qwen3-30b-a3b.json): how
// fast one kernel reads ~1.2 GB (about one layer's expert weights) from HBM by load path:
// plain 16-byte loads, per-lane cp.async into a ring of shared memory (expert_mma's staging),
// and cp.async.bulk copies of 8-64 KiB completing on mbarriers, with blocks over consecutive
// regions ("churn") or one block a SM; then the same over 48 different slices in turn (a TLB
// check). The device-to-device copy bound is measured in the same run. Standalone:
//   nvcc -arch=sm_90a -std=c++17 -O3 -o readbw bench/read_bandwidth_probe.cu && ./readbw
// (An S of 6 stages ran ~20% slower in every form; not investigated.)
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <functional>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1);} } while (0)

__device__ unsigned g_sink;

__device__ __forceinline__ uint4 ldnc(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// block b reads regions b, b + gridDim.x, ... of `region` uint4s each.
template <int U>
__global__ void read_ld(const uint4* p, size_t region, size_t regions) {
  unsigned acc = 0;
  for (size_t r = blockIdx.x; r < regions; r += gridDim.x) {
    const uint4* q = p + r * region;
    for (size_t i = threadIdx.x; i < region; i += blockDim.x * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = ldnc(q + i + u * blockDim.x);
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].w;
    }
  }
  if (acc == 0x12345678u) g_sink = acc;
}

// per-warp cp.async ring of S stages of CH uint4 per lane (a warp's slice of each region).
template <int CH, int S>
__global__ void read_cpasync(const uint4* p, size_t region, size_t regions) {
  extern __shared__ uint4 sm[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  uint4* ring = sm + warp * S * CH * 32 + lane;
  unsigned acc = 0;
  for (size_t r = blockIdx.x; r < regions; r += gridDim.x) {
    const size_t slice = region / warps;
    const uint4* q = p + r * region + warp * slice + lane;
    const int iters = slice / (CH * 32);
    auto copy = [&](int it) {
      for (int c = 0; c < CH; ++c) {
        unsigned d = (unsigned)__cvta_generic_to_shared(ring + ((it % S) * CH + c) * 32);
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(q + (size_t)it * CH * 32 + c * 32) : "memory");
      }
    };
    for (int s = 0; s < S; ++s) { if (s < iters) copy(s); asm volatile("cp.async.commit_group;" ::: "memory"); }
    for (int it = 0; it < iters; ++it) {
      asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory");
      for (int c = 0; c < CH; ++c) { uint4 v = ring[((it % S) * CH + c) * 32]; acc ^= v.x ^ v.w; }
      if (it + S < iters) copy(it + S);
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
  }
  if (acc == 0x12345678u) g_sink = acc;
}

__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"((unsigned)__cvta_generic_to_shared(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk(void* dst, const void* src, unsigned bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes), "r"((unsigned)__cvta_generic_to_shared(b)) : "memory");
}

// block-level ring of S stages of C bytes, thread 0 issues 1D bulk copies.
template <int S>
__global__ void read_bulk(const uint4* p, size_t region, size_t regions, int chunk_u4) {
  extern __shared__ uint4 sm[];
  __shared__ uint64_t bar[S];
  if (threadIdx.x == 0) { for (int s = 0; s < S; ++s) mbar_init(&bar[s], 1); asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
  __syncthreads();
  unsigned acc = 0;
  unsigned phase = 0;
  for (size_t r = blockIdx.x; r < regions; r += gridDim.x) {
    const uint4* q = p + r * region;
    const int iters = region / chunk_u4;
    if (threadIdx.x == 0)
      for (int s = 0; s < S && s < iters; ++s) { mbar_expect(&bar[s], chunk_u4 * 16); bulk(sm + s * chunk_u4, q + (size_t)s * chunk_u4, chunk_u4 * 16, &bar[s]); }
    for (int it = 0; it < iters; ++it) {
      const int s = it % S;
      mbar_wait(&bar[s], (phase >> s) & 1);
      phase ^= 1u << s;
      for (int i = threadIdx.x; i < chunk_u4; i += blockDim.x) { uint4 v = sm[s * chunk_u4 + i]; acc ^= v.x ^ v.w; }
      __syncthreads();
      if (threadIdx.x == 0 && it + S < iters) { mbar_expect(&bar[s], chunk_u4 * 16); bulk(sm + s * chunk_u4, q + (size_t)(it + S) * chunk_u4, chunk_u4 * 16, &bar[s]); }
    }
  }
  if (acc == 0x12345678u) g_sink = acc;
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t total = size_t(1200) << 20; // 1.2 GB, ~ one layer's experts
  uint4* buf; CK(cudaMalloc(&buf, total + (size_t(512) << 20)));
  char* dst = reinterpret_cast<char*>(buf) + total;
  CK(cudaMemset(buf, 1, total));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  auto timeit = [&](const char* name, double bytes, std::function<void()> f) {
    std::vector<float> ms;
    for (int i = 0; i < 3; ++i) f();
    for (int i = 0; i < 15; ++i) { CK(cudaEventRecord(a, st)); f(); CK(cudaEventRecord(b, st)); CK(cudaEventSynchronize(b)); float t; CK(cudaEventElapsedTime(&t, a, b)); ms.push_back(t); }
    CK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    printf("%-44s %8.1f us  %7.0f GB/s\n", name, ms[ms.size() / 2] * 1e3, bytes / (ms[ms.size() / 2] * 1e-3) / 1e9);
  };
  const size_t cb = size_t(256) << 20;
  timeit("memcpy d2d 256MiB (r+w)", 2.0 * cb, [&] { CK(cudaMemcpyAsync(dst, buf, cb, cudaMemcpyDeviceToDevice, st)); });
  const size_t tu4 = total / 16;
  char name[160];
  // layer-cycling buffer: 48 slices of 1.2 GB (58 GB), a different slice each launch
  const int L = 48;
  uint4* big; CK(cudaMalloc(&big, total * L));
  CK(cudaMemset(big, 1, total * L));
  int layer = 0;
  for (int cyc : {0, 1}) {
    auto P = [&]() -> const uint4* { if (!cyc) return buf; layer = (layer + 1) % L; return big + (size_t)layer * tu4; };
    for (size_t rkb : {192, 512}) {
      const size_t region = rkb * 1024 / 16, regions = tu4 / region;
      snprintf(name, sizeof name, "%s ld U8 256t churn %zuK", cyc ? "CYC" : "one", rkb);
      timeit(name, regions * region * 16.0, [&] { read_ld<8><<<(int)regions, 256, 0, st>>>(P(), region, regions); });
      CK(cudaFuncSetAttribute(read_cpasync<2, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 4 * 2 * 512));
      snprintf(name, sizeof name, "%s cp.async CH2 S4 8w churn %zuK", cyc ? "CYC" : "one", rkb);
      timeit(name, regions * region * 16.0, [&] { read_cpasync<2, 4><<<(int)regions, 256, 8 * 4 * 2 * 512, st>>>(P(), region, regions); });
      for (int chunk_kb : {16, 32, 48, 64}) for (int S : {3, 4, 6}) {
        const int chunk = chunk_kb * 1024 / 16; const int smem = S * chunk * 16;
        if (smem > 220 * 1024 || (rkb * 1024) % (chunk_kb * 1024)) continue;
        snprintf(name, sizeof name, "%s bulk %dK S%d churn %zuK (%d KB smem)", cyc ? "CYC" : "one", chunk_kb, S, rkb, smem / 1024);
        auto go = [&](auto kern) { CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
          timeit(name, regions * region * 16.0, [&] { kern<<<(int)regions, 256, smem, st>>>(P(), region, regions, chunk); }); };
        if (S == 3) go(read_bulk<3>); else if (S == 4) go(read_bulk<4>); else go(read_bulk<6>);
      }
    }
    // persistent: one block per SM, contiguous equal ranges (regions of 64 KB handed round-robin)
    for (int chunk_kb : {32, 64}) for (int S : {3, 4, 6}) {
      const int chunk = chunk_kb * 1024 / 16; const int smem = S * chunk * 16;
      if (smem > 220 * 1024) continue;
      const size_t region = 64 * 1024 / 16 * (chunk_kb / 32 + 1), regions = tu4 / region;
      snprintf(name, sizeof name, "%s bulk %dK S%d persist 1/SM", cyc ? "CYC" : "one", chunk_kb, S);
      auto go = [&](auto kern) { CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        timeit(name, regions * region * 16.0, [&] { kern<<<sms, 256, smem, st>>>(P(), region, regions, chunk); }); };
      if (S == 3) go(read_bulk<3>); else if (S == 4) go(read_bulk<4>); else go(read_bulk<6>);
    }
  }
  return 0;
}
