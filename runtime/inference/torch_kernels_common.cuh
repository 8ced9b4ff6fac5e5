// Device helpers shared by the bf16 engine's kernel files (torch_kernels.cu,
// torch_kernels_moe.cu). CUDA only; included by .cu files, never by C++ code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <string>

namespace refit::inference::kernels::detail {

using bf16 = __nv_bfloat16;
using i64 = std::int64_t;

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

inline void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("bf16 engine kernel ") + what + ": "
                             + cudaGetErrorString(e));
}

__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ bf16 to_bf(float v) { return __float2bfloat16(v); }

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The warp's inclusive prefix sum in lane order (Hillis-Steele: a fixed order, the same bits
// run to run).
template <class T>
__device__ __forceinline__ T warp_inclusive(T v) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const T up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o)
      v += up;
  }
  return v;
}

// The warp's largest (value, id) pair, ties to the lower id; every lane gets it.
template <class V, class I>
__device__ __forceinline__ void warp_argmax(V& best, I& id) {
  for (int o = 16; o > 0; o >>= 1) {
    const V b = __shfl_xor_sync(0xffffffffu, best, o);
    const I other = __shfl_xor_sync(0xffffffffu, id, o);
    if (b > best || (b == best && other < id)) {
      best = b;
      id = other;
    }
  }
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), in a fixed order (warp
// trees, then each warp over the warp totals): every thread gets the same bits. `shared`
// holds blockDim.x / 32 values and is free again on return.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0)
    shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  T total = lane < warps ? shared[lane] : T(0);
  total = warp_sum(total);
  __syncthreads();
  return total;
}

// 8 bf16 of a uint4 as floats (element 2i in the low half of word i). Bit operations on the
// words, exactly __bfloat162float: read through a bf16 pointer into the uint4, the compiler split
// its 16-byte load into eight 2-byte loads.
__device__ __forceinline__ void unpack8(const uint4& v, float* out) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = __uint_as_float(w[j] << 16);
    out[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}

// Eight consecutive values as floats: one 16-byte load of bf16, two of fp32.
__device__ __forceinline__ void load8(const bf16* p, float* out) {
  unpack8(*reinterpret_cast<const uint4*>(p), out);
}
__device__ __forceinline__ void load8(const float* p, float* out) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// RMSNorm of one fp32 row already in global memory (written by this thread for the columns it
// owns: `vec` columns of 4 per thread when n % 4 == 0, else one by one) to bf16 out.
// o = bf16(row * rsqrt(mean(ss) + eps) * w); with lo, also lo = bf16(value - o): the rounding
// error, so that o + lo carries the normed row to about 16 mantissa bits (the router's input).
__device__ __forceinline__ void norm_row(const float* row, const bf16* w, bf16* o, int n,
                                         float eps, float ss, float* shared,
                                         bf16* lo = nullptr) {
  ss = block_sum(ss, shared);
  const float r = rsqrtf(ss / static_cast<float>(n) + eps);
  if ((n & 3) == 0) {
    for (int c = threadIdx.x * 4; c < n; c += blockDim.x * 4) {
      const float4 v = *reinterpret_cast<const float4*>(row + c);
      const uint2 wv = *reinterpret_cast<const uint2*>(w + c);
      const bf16* wb = reinterpret_cast<const bf16*>(&wv);
      const float f[4] = {v.x * r * to_f(wb[0]), v.y * r * to_f(wb[1]), v.z * r * to_f(wb[2]),
                          v.w * r * to_f(wb[3])};
      __align__(8) bf16 ob[4] = {to_bf(f[0]), to_bf(f[1]), to_bf(f[2]), to_bf(f[3])};
      *reinterpret_cast<uint2*>(o + c) = *reinterpret_cast<const uint2*>(ob);
      if (lo != nullptr) {
        __align__(8) bf16 lb[4] = {to_bf(f[0] - to_f(ob[0])), to_bf(f[1] - to_f(ob[1])),
                                   to_bf(f[2] - to_f(ob[2])), to_bf(f[3] - to_f(ob[3]))};
        *reinterpret_cast<uint2*>(lo + c) = *reinterpret_cast<const uint2*>(lb);
      }
    }
  } else {
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const float f = row[c] * r * to_f(w[c]);
      o[c] = to_bf(f);
      if (lo != nullptr)
        lo[c] = to_bf(f - to_f(o[c]));
    }
  }
}


// Blocks for a grid-stride loop over `elements` with `threads` per block: 1..4096.
inline int grid_for(i64 elements, int threads) {
  const i64 blocks = (elements + threads - 1) / threads;
  return static_cast<int>(blocks < 4096 ? (blocks < 1 ? 1 : blocks) : 4096);
}

// The current device's multiprocessor count (grid sizing), read once per device.
inline int multiprocessors() {
  constexpr int cached_devices = 64;
  static std::atomic<int> cached[cached_devices] = {};
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess)
    throw std::runtime_error("bf16 engine: cannot read the current CUDA device");
  if (device >= 0 && device < cached_devices && (sms = cached[device].load()) > 0)
    return sms;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    throw std::runtime_error("bf16 engine: cannot read the device's multiprocessor count");
  if (device >= 0 && device < cached_devices)
    cached[device].store(sms);
  return sms;
}

// D += A (16 x 16, row) . B (16 x 8, col), bf16 in, fp32 accumulate. Thread (g = lane / 4,
// t = lane % 4) holds a0/a2: row g, columns 2t..2t+1 / 2t+8..2t+9, a1/a3 the same of row g+8;
// b0/b1: rows 2t..2t+1 / 2t+8..2t+9 of column g; d0, d1: row g, columns 2t, 2t+1; d2, d3: row
// g+8.
__device__ __forceinline__ void mma_bf16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- programmatic dependent launch (sm_90) --------------------------------------------------
// Every kernel of this engine starts with pdl_enter(): it waits until the kernel before it on
// the stream has completed and its memory is visible (griddepcontrol.wait; through the chain,
// every earlier kernel too), then lets the next kernel's blocks be scheduled
// (griddepcontrol.launch_dependents). Launched through launch() with the
// programmatic-stream-serialization attribute, a kernel's blocks are resident and waiting when
// its predecessor finishes, instead of being launched after it: in a CUDA graph that removes
// most of the gap between two dependent kernels. Without the attribute both are no-ops, and a
// kernel that ATen or cuBLAS launched before or after ours orders as usual.
// pdl_trigger alone (pdl_enter's second half) lets the next kernel's blocks be scheduled before
// this kernel waits for the one before it: a kernel that calls it must know that the next one
// reads, before its own wait, nothing that the kernel before this one writes.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  pdl_trigger();
}

// Whether launch() sets the attribute (set_programmatic_launch, from REFIT_PDL).
inline std::atomic<bool> programmatic_launch{true};

// `kernel` allowed `smem` bytes of dynamic shared memory: past 48 KiB its opt-in attribute is set
// (a host-side call, allowed while a graph is captured).
inline void allow_smem(const char* what, const void* kernel, int smem) {
  if (smem <= 48 * 1024)
    return;
  const cudaError_t e =
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("bf16 engine kernel ") + what + ": "
                             + std::to_string(smem) + " bytes of shared memory: "
                             + cudaGetErrorString(e));
}

// The launch configuration of an engine kernel: programmatic stream serialization when
// `programmatic`, thread-block clusters of `cluster` blocks along x when cluster > 1 (grid.x a
// multiple of it); `attrs` holds the attributes the configuration points to.
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, int smem, cudaStream_t s,
                                        bool programmatic, int cluster,
                                        cudaLaunchAttribute (&attrs)[2]) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = s;
  unsigned n = 0;
  if (programmatic) {
    attrs[n] = {};
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster > 1) {
    attrs[n] = {};
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = static_cast<unsigned>(cluster);
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  config.attrs = attrs;
  config.numAttrs = n;
  return config;
}

// launch_cluster: with `smem` bytes of dynamic shared memory, in clusters of `cluster` blocks
// (1: none), programmatic as set_programmatic_launch says; launch_smem: no clusters.
template <class... Params, class... Args>
void launch_cluster(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, int smem,
                    int cluster, cudaStream_t s, Args... args) {
  allow_smem(what, reinterpret_cast<const void*>(kernel), smem);
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t config =
    launch_config(grid, block, smem, s, programmatic_launch.load(std::memory_order_relaxed),
                  cluster, attrs);
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("bf16 engine kernel ") + what + ": "
                             + cudaGetErrorString(e));
  check(what);
}

template <class... Params, class... Args>
void launch_smem(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, int smem,
                 cudaStream_t s, Args... args) {
  launch_cluster(what, kernel, grid, block, smem, 1, s, args...);
}

template <class... Params, class... Args>
void launch(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t s,
            Args... args) {
  launch_smem(what, kernel, grid, block, 0, s, args...);
}

// ---- GEMV of a few rows -----------------------------------------------------------------------

constexpr int gemv_max_chunks = 16;              // 16-byte chunks per lane: k <= 4096
constexpr int gemv_max_k = gemv_max_chunks * 256;
constexpr int gemv_rows_per_block = 8;           // one warp per output row

// One warp: y[q * n + row] = W-row . x-row(q) for q in [first, first + count), x-row(q) =
// x[x_rows[q]] (x_rows set) or x[q], fp32 sums. Each lane first loads its KC 16-byte chunks of
// the weight row (columns lane * 8 + j * 256) into registers, all in flight at once, then dots
// them with each x row in turn (from L1/L2). (Streaming the row once per pass of copies, one
// load in flight per lane, reached ~25% of DRAM bandwidth at batch 1 under Nsight Compute.)
template <int KC>
__device__ __forceinline__ void gemv_row(const bf16* __restrict__ wr, const bf16* __restrict__ x,
                                         const i64* __restrict__ x_rows, i64 first, int count,
                                         bf16* __restrict__ y, int n, int row, int k) {
  const int lane = threadIdx.x & 31;
  uint4 wv[KC];
#pragma unroll
  for (int j = 0; j < KC; ++j) {
    const int k0 = lane * 8 + j * 256;
    if (k0 < k)
      wv[j] = __ldg(reinterpret_cast<const uint4*>(wr + k0));
  }
  for (int c = 0; c < count; ++c) {
    const i64 q = first + c;
    const bf16* xr = x + (x_rows != nullptr ? x_rows[q] : q) * k;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < KC; ++j) {
      const int k0 = lane * 8 + j * 256;
      if (k0 < k) {
        float wf[8], xf[8];
        unpack8(wv[j], wf);
        unpack8(*reinterpret_cast<const uint4*>(xr + k0), xf);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          acc += wf[i] * xf[i];
      }
    }
    const float sum = warp_sum(acc);
    if (lane == 0)
      y[q * n + row] = to_bf(sum);
  }
}

// f(std::integral_constant<int, KC>) for KC = ceil(k / 256) in 1..gemv_max_chunks.
template <class F>
void with_chunks(int k, const char* what, F&& f) {
  switch ((k + 255) / 256) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 9: return f(std::integral_constant<int, 9>{});
    case 10: return f(std::integral_constant<int, 10>{});
    case 11: return f(std::integral_constant<int, 11>{});
    case 12: return f(std::integral_constant<int, 12>{});
    case 13: return f(std::integral_constant<int, 13>{});
    case 14: return f(std::integral_constant<int, 14>{});
    case 15: return f(std::integral_constant<int, 15>{});
    case 16: return f(std::integral_constant<int, 16>{});
  }
  throw std::invalid_argument(std::string(what) + ": k " + std::to_string(k)
                              + " is outside 1.." + std::to_string(gemv_max_k));
}

} // namespace refit::inference::kernels::detail
