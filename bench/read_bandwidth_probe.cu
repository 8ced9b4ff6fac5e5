// Read-bandwidth probe (issue 16; bench/results/2026-12-04-h200-generate-qwen3-30b-a3b.json): how
// fast one kernel reads ~1.2 GB (about one layer's expert weights) from HBM by load path:
// plain 16-byte loads, per-lane cp.async into a ring of shared memory (expert_mma's staging),
// and cp.async.bulk copies of 8-64 KiB completing on mbarriers, with blocks over consecutive
// regions ("churn") or one block a SM; then the same over 48 different slices in turn (a TLB
// check). The device-to-device copy bound is measured in the same run. Standalone:
//   nvcc -arch=sm_90a -std=c++17 -O3 -o readbw bench/read_bandwidth_probe.cu && ./readbw
// (An S of 6 stages ran ~20% slower in every form; not investigated.)
// `./readbw warp`: per-warp rings instead (what the resident-warp expert kernel could use):
// each warp streams its own sequence of 64 KiB items through S slots, filled by cp.async
// (16 bytes a lane, expert_stream's staging), by 1D cp.async.bulk of 2-16 KiB, or by 2D
// tensor-map copies of 16 rows x BK columns out of a [rows, 2048] bf16 matrix (a warp tile of
// 16 weight rows, BK = 64..256: 2-8 KiB a copy), lane 0 issuing, the warp's lanes waiting on
// the slot's mbarrier. `./readbw rows`: the expert kernel's own pattern, a stage = the next
// 256 or 512 B of each of a warp tile's 16 rows, by 16 1D bulk copies or per-lane cp.async
// (the configurations whose rings fit in 220 KiB of shared memory).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cstring>
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

// ---- per-warp rings -----------------------------------------------------------------------

// How many of n items warp `me` of W takes (items me, me + W, ...).
__device__ __forceinline__ long long warp_share(long long n, int me, int W) {
  return n > me ? (n - me + W - 1) / W : 0;
}

// One warp's ring: `total` stages of `chunk` bytes through S slots at `slots`, stage q copied
// by issue(q, slot) (called on every lane; lane 0 arms the barrier) and completing on
// bar[slot]; every lane reads its bytes.
template <int S, class Issue>
__device__ void warp_ring(char* slots, uint64_t* bar, long long total, int chunk, Issue issue) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) { for (int s = 0; s < S; ++s) mbar_init(&bar[s], 1); asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
  __syncwarp();
  for (long long q = 0; q < S && q < total; ++q) issue(q, (int)q);
  unsigned acc = 0;
  for (long long q = 0; q < total; ++q) {
    const int s = q % S;
    mbar_wait(&bar[s], (q / S) & 1);
    const uint4* v = reinterpret_cast<const uint4*>(slots + s * chunk);
    for (int i = lane; i < chunk / 16; i += 32) acc ^= v[i].x ^ v[i].w;
    __syncwarp();
    if (q + S < total) issue(q + S, s);
  }
  if (acc == 0x12345678u) g_sink = acc;
}

// Warp w of the grid (W in all) takes items w, w + W, ... of `item` bytes each, in chunks of
// `chunk` bytes (1D bulk copies).
template <int S>
__global__ void warp_bulk(const char* p, size_t item, size_t items, int chunk) {
  extern __shared__ uint4 sm[];
  __shared__ uint64_t bar[16][S];
  const int warp = threadIdx.x >> 5;
  const int W = gridDim.x * (blockDim.x >> 5), me = blockIdx.x * (blockDim.x >> 5) + warp;
  char* slots = reinterpret_cast<char*>(sm) + (size_t)warp * S * chunk;
  const int per_item = item / chunk;
  const long long mine = warp_share((long long)items, me, W);
  warp_ring<S>(slots, bar[warp], mine * per_item, chunk, [&](long long q, int s) {
    if ((threadIdx.x & 31) != 0) return;
    mbar_expect(&bar[warp][s], chunk);
    bulk(slots + s * chunk, p + ((size_t)(me + (q / per_item) * W) * item) + (q % per_item) * chunk, chunk, &bar[warp][s]);
  });
}

// The same with 2D tensor-map copies: the buffer is a [rows, k] bf16 matrix, an item 16 rows
// (a warp tile), a stage the next BK columns of them.
template <int S>
__global__ void warp_tma(const __grid_constant__ CUtensorMap map, int bands, int k, int bk) {
  extern __shared__ uint4 sm[];
  __shared__ uint64_t bar[16][S];
  const int warp = threadIdx.x >> 5;
  const int W = gridDim.x * (blockDim.x >> 5), me = blockIdx.x * (blockDim.x >> 5) + warp;
  const int chunk = 16 * bk * 2;
  char* slots = reinterpret_cast<char*>(sm) + (size_t)warp * S * chunk;
  const int per_band = k / bk;
  const long long mine = warp_share(bands, me, W);
  warp_ring<S>(slots, bar[warp], mine * per_band, chunk, [&](long long q, int s) {
    if ((threadIdx.x & 31) != 0) return;
    const int row = (me + (int)(q / per_band) * W) * 16, col = (int)(q % per_band) * bk;
    mbar_expect(&bar[warp][s], chunk);
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"((unsigned)__cvta_generic_to_shared(slots + s * chunk)), "l"(&map), "r"(col), "r"(row),
                 "r"((unsigned)__cvta_generic_to_shared(&bar[warp][s])) : "memory");
  });
}

// Row segments: the buffer is a [rows, k] bf16 matrix, a warp's item 16 rows (a warp tile), a
// stage the next `seg` bytes of each of them (16 segments, k * 2 bytes apart: the expert
// kernel's access pattern), copied by 16 1D bulk copies (lanes 0-15, one row each).
template <int S>
__global__ void warp_rows_bulk(const char* p, int bands, int k, int seg) {
  extern __shared__ uint4 sm[];
  __shared__ uint64_t bar[16][S];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int W = gridDim.x * (blockDim.x >> 5), me = blockIdx.x * (blockDim.x >> 5) + warp;
  const int chunk = 16 * seg, per_band = k * 2 / seg;
  char* slots = reinterpret_cast<char*>(sm) + (size_t)warp * S * chunk;
  const long long mine = warp_share(bands, me, W);
  warp_ring<S>(slots, bar[warp], mine * per_band, chunk, [&](long long q, int s) {
    if (lane == 0) mbar_expect(&bar[warp][s], chunk);
    __syncwarp();
    if (lane < 16) {
      const size_t row = (size_t)(me + (int)(q / per_band) * W) * 16 + lane;
      bulk(slots + s * chunk + lane * seg, p + row * k * 2 + (q % per_band) * seg, seg, &bar[warp][s]);
    }
  });
}

// The same pattern by per-lane 16-byte cp.async (expert_stream's staging), S commit groups.
template <int S>
__global__ void warp_rows_cp(const char* p, int bands, int k, int seg) {
  extern __shared__ uint4 sm[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int W = gridDim.x * (blockDim.x >> 5), me = blockIdx.x * (blockDim.x >> 5) + warp;
  const int chunk = 16 * seg, per_band = k * 2 / seg, u4 = chunk / 16, per_row = seg / 16;
  char* slots = reinterpret_cast<char*>(sm) + (size_t)warp * S * chunk;
  const long long mine = warp_share(bands, me, W);
  const long long total = mine * per_band;
  auto copy = [&](long long q) {
    if (q < total) {
      const size_t band = me + (int)(q / per_band) * W;
      for (int j = lane; j < u4; j += 32) {
        const size_t row = band * 16 + j / per_row;
        const char* src = p + row * k * 2 + (q % per_band) * seg + (j % per_row) * 16;
        const unsigned d = (unsigned)__cvta_generic_to_shared(slots + (q % S) * chunk + j * 16);
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  unsigned acc = 0;
  for (int q = 0; q < S; ++q) copy(q);
  for (long long q = 0; q < total; ++q) {
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory");
    const uint4* v = reinterpret_cast<const uint4*>(slots + (q % S) * chunk);
    for (int j = lane; j < u4; j += 32) acc ^= v[j].x ^ v[j].w;
    __syncwarp();
    copy(q + S);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  if (acc == 0x12345678u) g_sink = acc;
}

int rows_main(int sms, uint4* buf, size_t total, cudaStream_t st, const std::function<void(const char*, double, std::function<void()>)>& timeit) {
  char name[160];
  for (int k : {2048, 768}) {
    const long long rows = total / (k * 2);
    const int bands = (int)(rows / 16);
    for (int seg : {256, 512}) for (int S : {2, 3, 4}) {
      if ((k * 2) % seg) continue;
      const int warps = 8, chunk = 16 * seg, smem = warps * S * chunk;
      if (smem > 220 * 1024) continue;
      const int per_sm = std::min(2, (220 * 1024) / smem);
      auto go = [&](const char* how, auto kern) {
        snprintf(name, sizeof name, "rows k%d %s 16x%dB (%dK) S%d x%d/SM", k, how, seg, chunk / 1024, S, per_sm);
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        timeit(name, (double)bands * 16 * k * 2, [&] { kern<<<sms * per_sm, warps * 32, smem, st>>>(reinterpret_cast<const char*>(buf), bands, k, seg); }); };
      auto both = [&](auto bulk_kern, auto cp_kern) { go("bulk", bulk_kern); go("cp  ", cp_kern); };
      if (S == 2) both(warp_rows_bulk<2>, warp_rows_cp<2>);
      else if (S == 3) both(warp_rows_bulk<3>, warp_rows_cp<3>);
      else both(warp_rows_bulk<4>, warp_rows_cp<4>);
    }
  }
  return 0;
}

int warp_main(int sms, uint4* buf, size_t total, cudaStream_t st, const std::function<void(const char*, double, std::function<void()>)>& timeit) {
  char name[160];
  const size_t item = 64 * 1024, items = total / item;
  // expert_stream's own staging, per-warp cp.async, for comparison
  CK(cudaFuncSetAttribute(read_cpasync<2, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 4 * 2 * 512));
  timeit("per-warp cp.async CH2 S4, 2 blocks a SM", items * item * 1.0, [&] {
    read_cpasync<2, 4><<<sms * 2, 256, 8 * 4 * 2 * 512, st>>>(buf, item / 16, items); });
  for (int warps : {8, 16}) for (int chunk_kb : {2, 4, 8, 16}) for (int S : {2, 3, 4}) {
    const int smem = warps * S * chunk_kb * 1024;
    if (smem > 220 * 1024) continue;
    const int per_sm = std::min(2, (220 * 1024) / smem);
    snprintf(name, sizeof name, "warp bulk %2dK S%d, %2d warps x %d blocks a SM", chunk_kb, S, warps, per_sm);
    auto go = [&](auto kern) { CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      timeit(name, items * item * 1.0, [&] { kern<<<sms * per_sm, warps * 32, smem, st>>>(reinterpret_cast<const char*>(buf), item, items, chunk_kb * 1024); }); };
    if (S == 2) go(warp_bulk<2>); else if (S == 3) go(warp_bulk<3>); else go(warp_bulk<4>);
  }
  // 2D tensor map over [rows, 2048] bf16
  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000, cudaEnableDefault, &q));
  if (!encode) { printf("no cuTensorMapEncodeTiled\n"); return 1; }
  const int k = 2048;
  const long long rows = total / (k * 2);
  const int bands = (int)(rows / 16);
  for (int bk : {64, 128, 256}) {
    CUtensorMap map;
    const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)k * 2};
    const cuuint32_t box[2] = {(cuuint32_t)bk, 16}, estr[2] = {1, 1};
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, buf, dims, strides, box, estr,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("encode bk %d: %d\n", bk, (int)r); continue; }
    for (int warps : {8, 16}) for (int S : {2, 3, 4}) {
      const int chunk = 16 * bk * 2, smem = warps * S * chunk;
      if (smem > 220 * 1024) continue;
      const int per_sm = std::min(2, (220 * 1024) / smem);
      snprintf(name, sizeof name, "warp tma2d 16x%d (%dK) S%d, %2d warps x %d blocks a SM", bk, chunk / 1024, S, warps, per_sm);
      auto go = [&](auto kern) { CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        timeit(name, (double)bands * 16 * k * 2, [&] { kern<<<sms * per_sm, warps * 32, smem, st>>>(map, bands, k, bk); }); };
      if (S == 2) go(warp_tma<2>); else if (S == 3) go(warp_tma<3>); else go(warp_tma<4>);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
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
  if (argc > 1 && std::strcmp(argv[1], "warp") == 0)
    return warp_main(sms, buf, total, st, timeit);
  if (argc > 1 && std::strcmp(argv[1], "rows") == 0)
    return rows_main(sms, buf, total, st, timeit);
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
