// Kernels of the GPU data plane: batched strided copies (a chunk's placements in one launch),
// element digests, synthetic weights and the expected digests of the verifier. Host-side
// launchers are declared in kernels.hpp; see cuda.hpp for what each computes.
#include "runtime/cuda/kernels.hpp"

#include <cuda_runtime.h>

#include "runtime/model/digest.hpp"

namespace refit::cuda::kernels {

namespace {

using model::element_term;
using model::golden_gamma;
using model::mix64;

constexpr int threads = 256;
constexpr int copy_threads = 512;

// The descriptor a block works on: block_start is the prefix sum of blocks per descriptor
// (n + 1 entries), so descriptor d owns blocks [block_start[d], block_start[d + 1]).
__device__ std::uint32_t find_desc(const std::uint64_t* block_start, std::uint32_t n,
                                   std::uint64_t block) {
  std::uint32_t lo = 0, hi = n; // block_start[lo] <= block < block_start[hi]
  while (hi - lo > 1) {
    std::uint32_t mid = (lo + hi) / 2;
    if (block_start[mid] <= block)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

template <class T>
__device__ void copy_range(const copy_desc& d, std::uint64_t begin, std::uint64_t end) {
  const std::uint64_t row_units = d.row_bytes / sizeof(T);
  for (std::uint64_t u = begin + threadIdx.x; u < end; u += blockDim.x) {
    const std::uint64_t row = u / row_units;
    const std::uint64_t col = u - row * row_units;
    const T* src = reinterpret_cast<const T*>(d.src + row * d.src_stride) + col;
    T* dst = reinterpret_cast<T*>(d.dst + row * d.dst_stride) + col;
    *dst = *src;
  }
}

__device__ bool aligned(std::uint64_t x, std::uint64_t a) { return x % a == 0; }

// A contiguous range of 16-byte units: no per-unit row arithmetic, eight loads in flight per
// thread before their stores. Measured on an H200 (.device-side microbenchmark, 1,300 placements
// of 3 MiB, IPC-mapped destination): 512 threads x 8 loads over 64 KiB units reach 0.96 of one
// cudaMemcpyAsync of the same bytes; 256 threads x 4 loads over 256 KiB units reached 0.91.
constexpr int copy_depth = 8;
__device__ void copy_flat16(const std::byte* src, std::byte* dst, std::uint64_t b0,
                            std::uint64_t b1) {
  const uint4* s = reinterpret_cast<const uint4*>(src + b0);
  uint4* t = reinterpret_cast<uint4*>(dst + b0);
  const std::uint64_t n = (b1 - b0) / 16;
  const std::uint64_t step = blockDim.x;
  std::uint64_t i = threadIdx.x;
  for (; i + (copy_depth - 1) * step < n; i += copy_depth * step) {
    uint4 x[copy_depth];
#pragma unroll
    for (int k = 0; k < copy_depth; ++k)
      x[k] = s[i + k * step];
#pragma unroll
    for (int k = 0; k < copy_depth; ++k)
      t[i + k * step] = x[k];
  }
  for (; i < n; i += step)
    t[i] = s[i];
}

__global__ void copy_batch_kernel(const copy_desc* descs, const std::uint64_t* block_start,
                                  std::uint32_t n) {
  const std::uint64_t block = blockIdx.x + std::uint64_t{gridDim.x} * blockIdx.y;
  const std::uint32_t di = find_desc(block_start, n, block);
  const copy_desc d = descs[di];
  const std::uint64_t unit_in_desc = block - block_start[di];
  const std::uint64_t total = d.row_bytes * d.rows;
  const std::uint64_t b0 = unit_in_desc * copy_unit_bytes;
  const std::uint64_t b1 = b0 + copy_unit_bytes < total ? b0 + copy_unit_bytes : total;
  const auto s = reinterpret_cast<std::uint64_t>(d.src);
  const auto t = reinterpret_cast<std::uint64_t>(d.dst);
  const bool contiguous = d.rows == 1 || (d.src_stride == d.row_bytes && d.dst_stride == d.row_bytes);
  if (contiguous && aligned(s, 16) && aligned(t, 16) && aligned(b0, 16) && aligned(b1, 16)) {
    copy_flat16(d.src, d.dst, b0, b1);
    return;
  }
  for (std::uint64_t a : {std::uint64_t{16}, std::uint64_t{4}, std::uint64_t{2}}) {
    if (aligned(s, a) && aligned(t, a) && aligned(d.src_stride, a) && aligned(d.dst_stride, a)
        && aligned(d.row_bytes, a) && aligned(b0, a) && aligned(b1, a)) {
      if (a == 16)
        copy_range<uint4>(d, b0 / 16, b1 / 16);
      else if (a == 4)
        copy_range<std::uint32_t>(d, b0 / 4, b1 / 4);
      else
        copy_range<std::uint16_t>(d, b0 / 2, b1 / 2);
      return;
    }
  }
  copy_range<std::uint8_t>(d, b0, b1);
}

// Sum of `v` over the block, added to *out by thread 0.
__device__ void block_sum_into(std::uint64_t v, unsigned long long* out) {
  __shared__ std::uint64_t partial[threads / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    v += __shfl_down_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0)
    partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    std::uint64_t sum = 0;
    for (int i = 0; i < threads / 32; ++i)
      sum += partial[i];
    atomicAdd(out, static_cast<unsigned long long>(sum));
  }
}

__global__ void digest_kernel(const digest_desc* descs, const std::uint64_t* block_start,
                              std::uint32_t n, unsigned long long* out) {
  const std::uint64_t block = blockIdx.x + std::uint64_t{gridDim.x} * blockIdx.y;
  const std::uint32_t di = find_desc(block_start, n, block);
  const digest_desc d = descs[di];
  const std::uint64_t e0 = (block - block_start[di]) * digest_unit_elements;
  const std::uint64_t e1 = e0 + digest_unit_elements < d.elements ? e0 + digest_unit_elements
                                                                  : d.elements;
  std::uint64_t acc = 0;
  for (std::uint64_t i = e0 + threadIdx.x; i < e1; i += blockDim.x) {
    std::uint32_t bits = 0;
    if (d.data != nullptr)
      bits = d.element_size == 2 ? reinterpret_cast<const std::uint16_t*>(d.data)[i]
                                 : reinterpret_cast<const std::uint32_t*>(d.data)[i];
    acc += element_term(i, bits);
  }
  block_sum_into(acc, out + di);
}

// ---- synthetic weights (twins of runtime/model/qwen3_moe.cpp) ---------------------------

__device__ float uniform(std::uint64_t base, std::uint64_t index) {
  const std::uint64_t bits = mix64(base + (index + 1) * golden_gamma) >> 40;
  return static_cast<float>(bits) * (1.0f / 8388608.0f) - 1.0f;
}

__device__ std::uint32_t bf16_bits(float f) {
  const std::uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return ((x >> 16) | 0x0040u) & 0xffffu;
  const std::uint32_t round_bias = 0x7fffu + ((x >> 16) & 1u);
  return ((x + round_bias) >> 16) & 0xffffu;
}

__device__ float decode(std::uint32_t bits, std::uint32_t element_size) {
  return element_size == 2 ? __uint_as_float(bits << 16) : __uint_as_float(bits);
}

__device__ std::uint32_t encode(float f, std::uint32_t element_size) {
  return element_size == 2 ? bf16_bits(f) : __float_as_uint(f);
}

// The value bits of element `index` after bases[0..nbases): init, then nbases - 1 steps.
__device__ std::uint32_t synthetic_bits(const std::uint64_t* bases, std::uint32_t nbases,
                                        bool is_norm, float init_scale, float lr,
                                        std::uint32_t element_size, std::uint64_t index) {
  const double scaled = static_cast<double>(init_scale) * static_cast<double>(uniform(bases[0], index));
  std::uint32_t bits = encode(static_cast<float>(is_norm ? 1.0 + scaled : scaled), element_size);
  for (std::uint32_t s = 1; s < nbases; ++s) {
    const double next = static_cast<double>(decode(bits, element_size))
                        + static_cast<double>(lr) * static_cast<double>(uniform(bases[s], index));
    bits = encode(static_cast<float>(next), element_size);
  }
  return bits;
}

__device__ void store(std::byte* out, std::uint64_t i, std::uint32_t bits,
                      std::uint32_t element_size) {
  if (element_size == 2)
    reinterpret_cast<std::uint16_t*>(out)[i] = static_cast<std::uint16_t>(bits);
  else
    reinterpret_cast<std::uint32_t*>(out)[i] = bits;
}

__global__ void fill_kernel(std::byte* out, std::uint64_t begin, std::uint64_t count,
                            const std::uint64_t* bases, std::uint32_t nbases, bool is_norm,
                            float init_scale, float lr, std::uint32_t element_size) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < count;
       i += std::uint64_t{gridDim.x} * blockDim.x)
    store(out, i, synthetic_bits(bases, nbases, is_norm, init_scale, lr, element_size, begin + i),
          element_size);
}

__global__ void step_kernel(std::byte* inout, std::uint64_t begin, std::uint64_t count,
                            std::uint64_t base, float lr, std::uint32_t element_size) {
  for (std::uint64_t i = blockIdx.x * std::uint64_t{blockDim.x} + threadIdx.x; i < count;
       i += std::uint64_t{gridDim.x} * blockDim.x) {
    const std::uint32_t old = element_size == 2
                                ? reinterpret_cast<const std::uint16_t*>(inout)[i]
                                : reinterpret_cast<const std::uint32_t*>(inout)[i];
    const double next = static_cast<double>(decode(old, element_size))
                        + static_cast<double>(lr) * static_cast<double>(uniform(base, begin + i));
    store(inout, i, encode(static_cast<float>(next), element_size), element_size);
  }
}

__global__ void expected_kernel(const expect_desc* descs, const std::uint64_t* block_start,
                                std::uint32_t n, const std::uint64_t* bases, float init_scale,
                                float lr, unsigned long long* out) {
  const std::uint64_t block = blockIdx.x + std::uint64_t{gridDim.x} * blockIdx.y;
  const std::uint32_t di = find_desc(block_start, n, block);
  const expect_desc d = descs[di];
  const std::uint64_t total = d.row_elements * d.rows;
  const std::uint64_t e0 = (block - block_start[di]) * digest_unit_elements;
  const std::uint64_t e1 = e0 + digest_unit_elements < total ? e0 + digest_unit_elements : total;
  std::uint64_t acc = 0;
  for (std::uint64_t u = e0 + threadIdx.x; u < e1; u += blockDim.x) {
    const std::uint64_t row = u / d.row_elements;
    const std::uint64_t col = u - row * d.row_elements;
    const std::uint64_t src = d.src_element + row * d.src_stride + col;
    const std::uint64_t dst = d.dst_element + row * d.dst_stride + col;
    const std::uint32_t bits = synthetic_bits(bases + d.bases_offset, d.nbases, d.is_norm != 0,
                                              init_scale, lr, d.element_size, src);
    acc += element_term(dst, bits) - element_term(dst, 0);
  }
  block_sum_into(acc, out + d.resident);
}

__global__ void placed_kernel(const placed_desc* descs, const std::uint64_t* block_start,
                              std::uint32_t n, unsigned long long* out) {
  const std::uint64_t block = blockIdx.x + std::uint64_t{gridDim.x} * blockIdx.y;
  const std::uint32_t di = find_desc(block_start, n, block);
  const placed_desc d = descs[di];
  const std::uint64_t total = d.row_elements * d.rows;
  const std::uint64_t e0 = (block - block_start[di]) * digest_unit_elements;
  const std::uint64_t e1 = e0 + digest_unit_elements < total ? e0 + digest_unit_elements : total;
  std::uint64_t acc = 0;
  for (std::uint64_t u = e0 + threadIdx.x; u < e1; u += blockDim.x) {
    const std::uint64_t row = u / d.row_elements;
    const std::uint64_t col = u - row * d.row_elements;
    const std::uint64_t src = row * d.src_stride + col;
    const std::uint64_t dst = d.dst_element + row * d.dst_stride + col;
    const std::uint32_t bits = d.element_size == 2
                                 ? reinterpret_cast<const std::uint16_t*>(d.src)[src]
                                 : reinterpret_cast<const std::uint32_t*>(d.src)[src];
    acc += element_term(dst, bits) - element_term(dst, 0);
  }
  block_sum_into(acc, out + d.resident);
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw launch_error(std::string(what) + ": " + cudaGetErrorString(status));
}

dim3 grid_of(std::uint64_t blocks) {
  // x up to 65535 * 1024 keeps y within its limit for any realistic size.
  const std::uint64_t x = blocks < 65536 ? blocks : 65536;
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>((blocks + x - 1) / x));
}

} // namespace

// Blocks beyond the last real one (grid rounding) find the last descriptor and an empty range.

void copy_batch(void* stream, const copy_desc* descs, const std::uint64_t* block_start,
                std::uint32_t n, std::uint64_t blocks) {
  if (blocks == 0)
    return;
  copy_batch_kernel<<<grid_of(blocks), copy_threads, 0, static_cast<cudaStream_t>(stream)>>>(
    descs, block_start, n);
  check(cudaGetLastError(), "copy_batch kernel launch");
}

void digests(void* stream, const digest_desc* descs, const std::uint64_t* block_start,
             std::uint32_t n, std::uint64_t blocks, std::uint64_t* out) {
  if (blocks == 0)
    return;
  digest_kernel<<<grid_of(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(
    descs, block_start, n, reinterpret_cast<unsigned long long*>(out));
  check(cudaGetLastError(), "digest kernel launch");
}

void placed(void* stream, const placed_desc* descs, const std::uint64_t* block_start,
            std::uint32_t n, std::uint64_t blocks, std::uint64_t* out) {
  if (blocks == 0)
    return;
  placed_kernel<<<grid_of(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(
    descs, block_start, n, reinterpret_cast<unsigned long long*>(out));
  check(cudaGetLastError(), "placed-digest kernel launch");
}

void fill(void* stream, std::byte* out, std::uint64_t begin, std::uint64_t count,
          const std::uint64_t* bases, std::uint32_t nbases, bool is_norm, float init_scale,
          float lr, std::uint32_t element_size) {
  if (count == 0)
    return;
  const std::uint64_t blocks = (count + threads - 1) / threads;
  fill_kernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), threads, 0,
                static_cast<cudaStream_t>(stream)>>>(out, begin, count, bases, nbases, is_norm,
                                                     init_scale, lr, element_size);
  check(cudaGetLastError(), "synthetic fill kernel launch");
}

void step(void* stream, std::byte* inout, std::uint64_t begin, std::uint64_t count,
          std::uint64_t base, float lr, std::uint32_t element_size) {
  if (count == 0)
    return;
  const std::uint64_t blocks = (count + threads - 1) / threads;
  step_kernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), threads, 0,
                static_cast<cudaStream_t>(stream)>>>(inout, begin, count, base, lr, element_size);
  check(cudaGetLastError(), "synthetic step kernel launch");
}

void expected(void* stream, const expect_desc* descs, const std::uint64_t* block_start,
              std::uint32_t n, std::uint64_t blocks, const std::uint64_t* bases, float init_scale,
              float lr, std::uint64_t* out) {
  if (blocks == 0)
    return;
  expected_kernel<<<grid_of(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(
    descs, block_start, n, bases, init_scale, lr, reinterpret_cast<unsigned long long*>(out));
  check(cudaGetLastError(), "expected-digest kernel launch");
}

} // namespace refit::cuda::kernels
