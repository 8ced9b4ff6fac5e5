#include "runtime/cuda/cuda.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>
#include <nccl.h>

#include "runtime/cuda/kernels.hpp"
#include "runtime/device/device.hpp"
#include "runtime/model/digest.hpp"

namespace refit::cuda {

namespace {

std::atomic<std::uint64_t> open_ipc_handles{0};

std::string where(int ordinal) { return "cuda:" + std::to_string(ordinal); }

void check(cudaError_t status, const char* call, int ordinal, const std::string& what) {
  if (status != cudaSuccess)
    throw error(where(ordinal) + ": " + call + " failed (" + cudaGetErrorString(status) + ")"
                + (what.empty() ? "" : " for " + what));
}

#define REFIT_CUDA_CALL(expr, ordinal, what) check((expr), #expr, ordinal, what)

void use(int ordinal) { REFIT_CUDA_CALL(cudaSetDevice(ordinal), ordinal, ""); }

void check_nccl(ncclResult_t status, const char* call, const std::string& what) {
  if (status != ncclSuccess)
    throw error(std::string(call) + " failed (" + ncclGetErrorString(status) + ") for " + what);
}

std::string format_uuid(const cudaUUID_t& uuid) {
  return device::format_uuid("GPU", reinterpret_cast<const unsigned char*>(uuid.bytes));
}

const char* hex_digits = "0123456789abcdef";

std::string to_hex(const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::string out(2 * n, '0');
  for (std::size_t i = 0; i < n; ++i) {
    out[2 * i] = hex_digits[p[i] >> 4];
    out[2 * i + 1] = hex_digits[p[i] & 0xf];
  }
  return out;
}

bool from_hex(const std::string& text, void* out, std::size_t n) {
  if (text.size() != 2 * n)
    return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9')
      return c - '0';
    if (c >= 'a' && c <= 'f')
      return c - 'a' + 10;
    return -1;
  };
  auto* p = static_cast<unsigned char*>(out);
  for (std::size_t i = 0; i < n; ++i) {
    int hi = nibble(text[2 * i]), lo = nibble(text[2 * i + 1]);
    if (hi < 0 || lo < 0)
      return false;
    p[i] = static_cast<unsigned char>(hi << 4 | lo);
  }
  return true;
}

// Units of work (kernel blocks) per descriptor, as a prefix sum with n + 1 entries.
template <class Desc, class Units>
std::vector<std::uint64_t> block_prefix(const std::vector<Desc>& descs, Units units) {
  std::vector<std::uint64_t> start(descs.size() + 1, 0);
  for (std::size_t i = 0; i < descs.size(); ++i)
    start[i + 1] = start[i] + units(descs[i]);
  return start;
}

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return (a + b - 1) / b; }

} // namespace

int device_count() {
  int n = 0;
  REFIT_CUDA_CALL(cudaGetDeviceCount(&n), 0, "counting devices");
  return n;
}

std::string device_uuid(int ordinal) {
  int n = device_count();
  if (ordinal < 0 || ordinal >= n)
    throw error(where(ordinal) + ": no such device (this process sees " + std::to_string(n)
                + " CUDA devices)");
  cudaDeviceProp prop{};
  REFIT_CUDA_CALL(cudaGetDeviceProperties(&prop, ordinal), ordinal, "its UUID");
  return format_uuid(prop.uuid);
}

std::uint64_t free_bytes(int ordinal) {
  use(ordinal);
  std::size_t free = 0, total = 0;
  REFIT_CUDA_CALL(cudaMemGetInfo(&free, &total), ordinal, "free memory");
  return free;
}

std::uint64_t total_bytes(int ordinal) {
  use(ordinal);
  std::size_t free = 0, total = 0;
  REFIT_CUDA_CALL(cudaMemGetInfo(&free, &total), ordinal, "total memory");
  return total;
}

// ---- device memory --------------------------------------------------------------------

device_allocation::device_allocation(int ordinal, std::uint64_t bytes, const std::string& what)
  : ordinal_(ordinal), bytes_(bytes) {
  use(ordinal);
  void* p = nullptr;
  REFIT_CUDA_CALL(cudaMalloc(&p, bytes), ordinal, std::to_string(bytes) + " bytes of " + what);
  data_ = static_cast<std::byte*>(p);
  if (auto status = cudaMemset(p, 0, bytes); status != cudaSuccess) {
    reset();
    check(status, "cudaMemset", ordinal, what);
  }
  REFIT_CUDA_CALL(cudaDeviceSynchronize(), ordinal, what);
}

device_allocation::~device_allocation() { reset(); }

device_allocation::device_allocation(device_allocation&& other) noexcept
  : ordinal_(other.ordinal_), data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

device_allocation& device_allocation::operator=(device_allocation&& other) noexcept {
  if (this != &other) {
    reset();
    ordinal_ = other.ordinal_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void device_allocation::reset() noexcept {
  if (data_ != nullptr) {
    cudaSetDevice(ordinal_);
    cudaFree(data_);
  }
  data_ = nullptr;
  bytes_ = 0;
}

void copy_to_host(int ordinal, std::byte* dst, const std::byte* src, std::uint64_t bytes) {
  use(ordinal);
  REFIT_CUDA_CALL(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), ordinal,
                  std::to_string(bytes) + " bytes to the host");
}

void copy_to_device(int ordinal, std::byte* dst, const std::byte* src, std::uint64_t bytes) {
  use(ordinal);
  REFIT_CUDA_CALL(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), ordinal,
                  std::to_string(bytes) + " bytes to the device");
}

// ---- streams ------------------------------------------------------------------------------

stream::stream(int ordinal) : ordinal_(ordinal) {
  use(ordinal);
  cudaStream_t s = nullptr;
  REFIT_CUDA_CALL(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), ordinal, "a stream");
  stream_ = s;
  cudaEvent_t e = nullptr;
  if (auto status = cudaEventCreateWithFlags(&e, cudaEventDisableTiming); status != cudaSuccess) {
    cudaStreamDestroy(s);
    check(status, "cudaEventCreateWithFlags", ordinal, "a stream's event");
  }
  event_ = e;
}

stream::~stream() {
  cudaSetDevice(ordinal_);
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

std::byte* stream::upload(const void* data, std::uint64_t bytes) {
  // The previous upload may still be read by a kernel in flight: wait for the stream first.
  REFIT_CUDA_CALL(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), ordinal_,
                  "uploading kernel descriptors");
  if (scratch_.size() < bytes)
    scratch_ = device_allocation(ordinal_, std::max<std::uint64_t>(bytes, 1 << 20),
                                 "kernel descriptors");
  REFIT_CUDA_CALL(cudaMemcpyAsync(scratch_.data(), data, bytes, cudaMemcpyHostToDevice,
                                  static_cast<cudaStream_t>(stream_)),
                  ordinal_, "kernel descriptors");
  return scratch_.data();
}

void stream::copy_batch(const std::vector<copy_desc>& copies) {
  if (copies.empty())
    return;
  use(ordinal_);
  auto start = block_prefix(copies, [](const copy_desc& d) {
    return ceil_div(d.row_bytes * d.rows, kernels::copy_unit_bytes);
  });
  const std::uint64_t desc_bytes = copies.size() * sizeof(copy_desc);
  staging_.resize(desc_bytes + start.size() * sizeof(std::uint64_t));
  std::memcpy(staging_.data(), copies.data(), desc_bytes);
  std::memcpy(staging_.data() + desc_bytes, start.data(), start.size() * sizeof(std::uint64_t));
  std::byte* dev = upload(staging_.data(), staging_.size());
  kernels::copy_batch(stream_, reinterpret_cast<const copy_desc*>(dev),
                      reinterpret_cast<const std::uint64_t*>(dev + desc_bytes),
                      static_cast<std::uint32_t>(copies.size()), start.back());
}

copy_plan::copy_plan(int ordinal, const std::vector<std::vector<copy_desc>>& batches) {
  std::vector<std::byte> host;
  auto append = [&host](const void* data, std::uint64_t bytes) {
    const std::uint64_t at = host.size();
    host.resize(at + bytes);
    if (bytes != 0)
      std::memcpy(host.data() + at, data, bytes);
    return at;
  };
  for (const auto& copies : batches) {
    batch b;
    b.block_start = block_prefix(copies, [](const copy_desc& d) {
      return ceil_div(d.row_bytes * d.rows, kernels::copy_unit_bytes);
    });
    b.desc_offset = append(copies.data(), copies.size() * sizeof(copy_desc));
    b.start_offset = append(b.block_start.data(), b.block_start.size() * sizeof(std::uint64_t));
    batches_.push_back(std::move(b));
  }
  if (host.empty())
    return;
  memory_ = device_allocation(ordinal, host.size(), "planned copy descriptors");
  copy_to_device(ordinal, memory_.data(), host.data(), host.size());
}

void stream::copy_batch(const copy_plan& plan, std::size_t batch, std::size_t limit) {
  const auto& b = plan.batches_.at(batch);
  limit = std::min(limit, b.block_start.size() - 1);
  if (limit == 0)
    return;
  if (plan.memory_.ordinal() != ordinal_)
    throw error(where(ordinal_) + ": a copy plan of " + where(plan.memory_.ordinal())
                + " launched on this device's stream");
  use(ordinal_);
  kernels::copy_batch(stream_,
                      reinterpret_cast<const copy_desc*>(plan.memory_.data() + b.desc_offset),
                      reinterpret_cast<const std::uint64_t*>(plan.memory_.data() + b.start_offset),
                      static_cast<std::uint32_t>(limit), b.block_start[limit]);
}

void stream::synchronize() {
  use(ordinal_);
  auto s = static_cast<cudaStream_t>(stream_);
  auto e = static_cast<cudaEvent_t>(event_);
  REFIT_CUDA_CALL(cudaEventRecord(e, s), ordinal_, "ordering copies");
  REFIT_CUDA_CALL(cudaEventSynchronize(e), ordinal_, "waiting for copies");
}

void stream::record() {
  use(ordinal_);
  REFIT_CUDA_CALL(cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream_)),
                  ordinal_, "ordering work");
}

bool stream::done() {
  auto status = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (status == cudaErrorNotReady)
    return false;
  check(status, "cudaEventQuery", ordinal_, "waiting for work");
  return true;
}

std::vector<std::uint64_t> stream::digests(const std::vector<digest_desc>& tensors) {
  std::vector<std::uint64_t> out(tensors.size(), 0);
  if (tensors.empty())
    return out;
  use(ordinal_);
  auto start = block_prefix(tensors, [](const digest_desc& d) {
    return ceil_div(d.elements, kernels::digest_unit_elements);
  });
  const std::uint64_t desc_bytes = tensors.size() * sizeof(digest_desc);
  const std::uint64_t start_bytes = start.size() * sizeof(std::uint64_t);
  const std::uint64_t out_bytes = out.size() * sizeof(std::uint64_t);
  staging_.assign(desc_bytes + start_bytes + out_bytes, std::byte{0});
  std::memcpy(staging_.data(), tensors.data(), desc_bytes);
  std::memcpy(staging_.data() + desc_bytes, start.data(), start_bytes);
  std::byte* dev = upload(staging_.data(), staging_.size());
  auto* sums = reinterpret_cast<std::uint64_t*>(dev + desc_bytes + start_bytes);
  kernels::digests(stream_, reinterpret_cast<const digest_desc*>(dev),
                   reinterpret_cast<const std::uint64_t*>(dev + desc_bytes),
                   static_cast<std::uint32_t>(tensors.size()), start.back(), sums);
  REFIT_CUDA_CALL(cudaMemcpyAsync(out.data(), sums, out_bytes, cudaMemcpyDeviceToHost,
                                  static_cast<cudaStream_t>(stream_)),
                  ordinal_, "digests");
  REFIT_CUDA_CALL(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), ordinal_,
                  "digests");
  return out;
}

std::vector<std::uint64_t> stream::placed_digests(const std::vector<placed_desc>& placements,
                                                  std::size_t slots) {
  std::vector<std::uint64_t> out(slots, 0);
  if (placements.empty() || slots == 0)
    return out;
  use(ordinal_);
  auto start = block_prefix(placements, [](const placed_desc& d) {
    return ceil_div(d.row_elements * d.rows, kernels::digest_unit_elements);
  });
  const std::uint64_t desc_bytes = placements.size() * sizeof(placed_desc);
  const std::uint64_t start_bytes = start.size() * sizeof(std::uint64_t);
  const std::uint64_t out_bytes = out.size() * sizeof(std::uint64_t);
  staging_.assign(desc_bytes + start_bytes + out_bytes, std::byte{0});
  std::memcpy(staging_.data(), placements.data(), desc_bytes);
  std::memcpy(staging_.data() + desc_bytes, start.data(), start_bytes);
  std::byte* dev = upload(staging_.data(), staging_.size());
  auto* sums = reinterpret_cast<std::uint64_t*>(dev + desc_bytes + start_bytes);
  kernels::placed(stream_, reinterpret_cast<const placed_desc*>(dev),
                  reinterpret_cast<const std::uint64_t*>(dev + desc_bytes),
                  static_cast<std::uint32_t>(placements.size()), start.back(), sums);
  REFIT_CUDA_CALL(cudaMemcpyAsync(out.data(), sums, out_bytes, cudaMemcpyDeviceToHost,
                                  static_cast<cudaStream_t>(stream_)),
                  ordinal_, "placed digests");
  REFIT_CUDA_CALL(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), ordinal_,
                  "placed digests");
  return out;
}

// ---- IPC ------------------------------------------------------------------------------------

bool is_ipc_handle(const std::string& handle) { return handle.rfind("cudaipc:", 0) == 0; }

std::string export_ipc_handle(const device_allocation& allocation) {
  use(allocation.ordinal());
  cudaIpcMemHandle_t h{};
  REFIT_CUDA_CALL(cudaIpcGetMemHandle(&h, allocation.data()), allocation.ordinal(),
                  "exporting a packed buffer");
  return "cudaipc:" + device_uuid(allocation.ordinal()) + ":" + std::to_string(allocation.size())
         + ":" + to_hex(&h, sizeof(h));
}

ipc_view::ipc_view(const std::string& handle, std::uint64_t size, int ordinal)
  : ordinal_(ordinal), size_(size) {
  auto bad = [&](const std::string& why) {
    return error("CUDA IPC handle '" + handle.substr(0, 64) + (handle.size() > 64 ? "..." : "")
                 + "': " + why);
  };
  // cudaipc:<uuid>:<bytes>:<hex>
  if (!is_ipc_handle(handle))
    throw bad("not a cudaipc: handle");
  const auto p1 = handle.find(':', 8);
  const auto p2 = p1 == std::string::npos ? p1 : handle.find(':', p1 + 1);
  if (p2 == std::string::npos)
    throw bad("expected cudaipc:<GPU uuid>:<bytes>:<hex>");
  const std::string uuid = handle.substr(8, p1 - 8);
  const std::string bytes_text = handle.substr(p1 + 1, p2 - p1 - 1);
  cudaIpcMemHandle_t h{};
  if (!from_hex(handle.substr(p2 + 1), &h, sizeof(h)))
    throw bad("the handle is not " + std::to_string(2 * sizeof(h)) + " lowercase hex digits");
  if (bytes_text.empty() || bytes_text.size() > 19
      || bytes_text.find_first_not_of("0123456789") != std::string::npos)
    throw bad("buffer size '" + bytes_text + "' is not a number");
  const std::uint64_t bytes = std::stoull(bytes_text);
  const std::string own = device_uuid(ordinal);
  if (uuid != own)
    throw bad("it is keyed by " + uuid + ", this worker's device " + where(ordinal) + " is "
              + own);
  if (bytes < size)
    throw bad("the buffer has " + bytes_text + " bytes, " + std::to_string(size) + " are needed");
  use(ordinal);
  void* p = nullptr;
  REFIT_CUDA_CALL(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), ordinal,
                  "opening " + handle.substr(0, 48) + "...");
  data_ = static_cast<std::byte*>(p);
  ++open_ipc_handles;
}

ipc_view::~ipc_view() {
  if (data_ != nullptr) {
    cudaSetDevice(ordinal_);
    cudaIpcCloseMemHandle(data_);
    --open_ipc_handles;
  }
}

std::uint64_t ipc_view::open_count() { return open_ipc_handles.load(); }

// ---- synthetic weights ------------------------------------------------------------------------

namespace {

std::uint32_t device_element_size(const model::param_meta& p) {
  switch (p.dt) {
    case model::dtype::bfloat16: return 2;
    case model::dtype::float32: return 4;
    default:
      throw error(p.name + ": synthetic weights of dtype " + model::dtype_name(p.dt)
                  + " are not implemented on CUDA devices (bfloat16 and float32 are)");
  }
}

// Page-locked host memory for staged uploads.
class pinned_host {
public:
  pinned_host(std::uint64_t bytes, int ordinal) : bytes_(std::max<std::uint64_t>(bytes, 1)) {
    void* p = nullptr;
    REFIT_CUDA_CALL(cudaHostAlloc(&p, bytes_, cudaHostAllocDefault), ordinal,
                    std::to_string(bytes_) + " bytes of pinned staging");
    data_ = static_cast<std::byte*>(p);
  }
  ~pinned_host() { cudaFreeHost(data_); }
  pinned_host(const pinned_host&) = delete;
  pinned_host& operator=(const pinned_host&) = delete;
  std::byte* data() const { return data_; }
  std::uint64_t size() const { return bytes_; }

private:
  std::uint64_t bytes_;
  std::byte* data_ = nullptr;
};

void check_range(const model::param_meta& p, std::uint64_t begin, std::uint64_t count) {
  if (begin > p.numel() || count > p.numel() - begin)
    throw error(p.name + ": elements [" + std::to_string(begin) + ", "
                + std::to_string(begin + count) + ") are out of range of "
                + std::to_string(p.numel()) + " elements");
}

} // namespace

void fill_synthetic(int ordinal, const model::param_meta& p, const model::synthetic_weights& w,
                    std::uint64_t step, std::uint64_t begin, std::uint64_t count,
                    std::byte* out) {
  check_range(p, begin, count);
  const std::uint32_t es = device_element_size(p);
  if (w.initial) {
    // Step 0 is the checkpoint's value: read through a bounded pinned staging buffer, then the
    // same device steps as apply_synthetic_step.
    use(ordinal);
    const std::uint64_t bytes = count * es;
    pinned_host staging(std::min<std::uint64_t>(bytes, std::uint64_t{64} << 20), ordinal);
    for (std::uint64_t off = 0; off < bytes; off += staging.size()) {
      const std::uint64_t n = std::min<std::uint64_t>(staging.size(), bytes - off);
      w.initial->read(p, begin * es + off, n, staging.data());
      copy_to_device(ordinal, out + off, staging.data(), n);
    }
    for (std::uint64_t s = 1; s <= step; ++s)
      apply_synthetic_step(ordinal, p, w, s, begin, count, out);
    return;
  }
  auto bases = model::synthetic_bases(p.name, w.seed, step);
  use(ordinal);
  device_allocation dev_bases(ordinal, bases.size() * sizeof(std::uint64_t), "synthetic bases");
  copy_to_device(ordinal, dev_bases.data(), reinterpret_cast<const std::byte*>(bases.data()),
                 dev_bases.size());
  kernels::fill(nullptr, out, begin, count, reinterpret_cast<const std::uint64_t*>(dev_bases.data()),
                static_cast<std::uint32_t>(bases.size()), model::synthetic_is_norm(p.name),
                w.init_scale, w.lr, es);
  REFIT_CUDA_CALL(cudaDeviceSynchronize(), ordinal, "synthetic weights of " + p.name);
}

void apply_synthetic_step(int ordinal, const model::param_meta& p,
                          const model::synthetic_weights& w, std::uint64_t step,
                          std::uint64_t begin, std::uint64_t count, std::byte* inout) {
  if (step == 0)
    throw error(p.name + ": synthetic step must be >= 1");
  check_range(p, begin, count);
  const std::uint32_t es = device_element_size(p);
  auto bases = model::synthetic_bases(p.name, w.seed, step);
  use(ordinal);
  kernels::step(nullptr, inout, begin, count, bases.back(), w.lr, es);
  REFIT_CUDA_CALL(cudaDeviceSynchronize(), ordinal, "synthetic step of " + p.name);
}

std::vector<std::vector<std::uint64_t>> expected_resident_digests(
  int ordinal, const model::model_config& cfg, std::uint32_t tp,
  const model::synthetic_weights& w, std::uint64_t step) {
  if (w.initial)
    throw error("the device verifier generates the seeded weights; weights that start from the "
                "checkpoint " + w.initial->source() + " are verified on the host");
  model::tp_layout layout(cfg, tp);
  const auto& residents = layout.residents();
  const auto params = model::expected_key_stream(cfg);
  std::vector<std::uint64_t> bases;
  std::vector<std::uint64_t> bases_offset;
  for (const auto& p : params) {
    device_element_size(p);
    bases_offset.push_back(bases.size());
    auto b = model::synthetic_bases(p.name, w.seed, step);
    bases.insert(bases.end(), b.begin(), b.end());
  }
  use(ordinal);
  stream s(ordinal);
  device_allocation dev_bases(ordinal, bases.size() * sizeof(std::uint64_t), "verifier bases");
  copy_to_device(ordinal, dev_bases.data(), reinterpret_cast<const std::byte*>(bases.data()),
                 dev_bases.size());
  std::vector<std::vector<std::uint64_t>> out(tp);
  for (std::uint32_t r = 0; r < tp; ++r) {
    std::vector<kernels::expect_desc> descs;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      const std::uint64_t es = model::dtype_size(p.dt);
      for (const auto& pl : layout.place(p, r)) {
        kernels::expect_desc d;
        d.resident = static_cast<std::uint32_t>(pl.resident_index);
        d.element_size = static_cast<std::uint32_t>(es);
        d.is_norm = model::synthetic_is_norm(p.name) ? 1 : 0;
        d.nbases = static_cast<std::uint32_t>(step + 1);
        d.bases_offset = bases_offset[i];
        d.src_element = pl.src_offset / es;
        d.src_stride = pl.src_stride / es;
        d.dst_element = pl.dst_offset / es;
        d.dst_stride = pl.dst_stride / es;
        d.row_elements = pl.row_bytes / es;
        d.rows = pl.rows;
        descs.push_back(d);
      }
    }
    auto start = block_prefix(descs, [](const kernels::expect_desc& d) {
      return ceil_div(d.row_elements * d.rows, kernels::digest_unit_elements);
    });
    const std::uint64_t desc_bytes = descs.size() * sizeof(kernels::expect_desc);
    const std::uint64_t start_bytes = start.size() * sizeof(std::uint64_t);
    const std::uint64_t sum_bytes = residents.size() * sizeof(std::uint64_t);
    std::vector<std::byte> host(desc_bytes + start_bytes + sum_bytes, std::byte{0});
    std::memcpy(host.data(), descs.data(), desc_bytes);
    std::memcpy(host.data() + desc_bytes, start.data(), start_bytes);
    device_allocation dev(ordinal, host.size(), "verifier descriptors");
    copy_to_device(ordinal, dev.data(), host.data(), host.size());
    auto* sums = reinterpret_cast<std::uint64_t*>(dev.data() + desc_bytes + start_bytes);
    kernels::expected(s.native(), reinterpret_cast<const kernels::expect_desc*>(dev.data()),
                      reinterpret_cast<const std::uint64_t*>(dev.data() + desc_bytes),
                      static_cast<std::uint32_t>(descs.size()), start.back(),
                      reinterpret_cast<const std::uint64_t*>(dev_bases.data()), w.init_scale,
                      w.lr, sums);
    s.synchronize();
    std::vector<std::uint64_t> placed(residents.size());
    copy_to_host(ordinal, reinterpret_cast<std::byte*>(placed.data()),
                 reinterpret_cast<const std::byte*>(sums), sum_bytes);
    // Plus the digest of all-zero resident tensors (elements no placement writes stay zero).
    std::vector<digest_desc> zeros;
    for (const auto& spec : residents)
      zeros.push_back({nullptr, spec.nbytes / model::dtype_size(spec.dt),
                       static_cast<std::uint32_t>(model::dtype_size(spec.dt))});
    auto base = s.digests(zeros);
    out[r].resize(residents.size());
    for (std::size_t i = 0; i < residents.size(); ++i)
      out[r][i] = base[i] + placed[i];
  }
  return out;
}

// ---- all-gather bound -------------------------------------------------------------------------

double allgather_seconds(const std::vector<int>& ordinals, std::uint64_t total_out_bytes,
                         std::uint32_t calls) {
  const int n = static_cast<int>(ordinals.size());
  if (n == 0 || calls == 0)
    throw error("allgather_seconds: needs devices and at least one call");
  const std::uint64_t per_call = total_out_bytes / calls / n * n;
  const std::uint64_t send = per_call / n;
  std::vector<ncclComm_t> comms(n);
  check_nccl(ncclCommInitAll(comms.data(), n, ordinals.data()), "ncclCommInitAll",
             "the all-gather bound");
  std::vector<device_allocation> out;
  std::vector<std::unique_ptr<stream>> streams;
  for (int i = 0; i < n; ++i) {
    out.emplace_back(ordinals[i], per_call, "the all-gather bound's buffer");
    streams.push_back(std::make_unique<stream>(ordinals[i]));
  }
  auto round = [&] {
    check_nccl(ncclGroupStart(), "ncclGroupStart", "the all-gather bound");
    for (int i = 0; i < n; ++i)
      check_nccl(ncclAllGather(out[i].data() + i * send, out[i].data(), send, ncclUint8, comms[i],
                               static_cast<cudaStream_t>(streams[i]->native())),
                 "ncclAllGather", "the all-gather bound");
    check_nccl(ncclGroupEnd(), "ncclGroupEnd", "the all-gather bound");
  };
  round();
  for (auto& s : streams)
    s->synchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (std::uint32_t c = 0; c < calls; ++c)
    round();
  for (auto& s : streams)
    s->synchronize();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  streams.clear();
  out.clear();
  for (auto c : comms)
    ncclCommDestroy(c);
  // Scale to exactly total_out_bytes in case the split rounded down.
  return seconds * static_cast<double>(total_out_bytes)
         / static_cast<double>(per_call * std::uint64_t{calls});
}

std::vector<double> device_copy_seconds(int ordinal, std::uint64_t bytes, unsigned reps) {
  if (bytes == 0 || reps == 0)
    throw error("device_copy_seconds: needs bytes and at least one repetition");
  device_allocation src(ordinal, bytes, "the copy bound's source");
  device_allocation dst(ordinal, bytes, "the copy bound's destination");
  stream s(ordinal);
  auto copy = [&] {
    REFIT_CUDA_CALL(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice,
                                    static_cast<cudaStream_t>(s.native())),
                    ordinal, "the copy bound");
  };
  copy(); // warm-up
  s.synchronize();
  std::vector<double> out;
  for (unsigned r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    copy();
    s.synchronize();
    out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return out;
}

// ---- copy bound -------------------------------------------------------------------------------

double copy_seconds(int ordinal, std::uint64_t total_bytes, std::uint64_t piece_bytes) {
  if (total_bytes == 0 || piece_bytes == 0)
    throw error("copy_seconds: needs bytes to copy");
  const std::uint64_t piece = std::min(total_bytes, piece_bytes);
  device_allocation src(ordinal, piece, "the copy bound's source");
  device_allocation dst(ordinal, piece, "the copy bound's destination");
  stream s(ordinal);
  auto st = static_cast<cudaStream_t>(s.native());
  use(ordinal);
  REFIT_CUDA_CALL(cudaMemcpyAsync(dst.data(), src.data(), piece, cudaMemcpyDeviceToDevice, st),
                  ordinal, "the copy bound (warm-up)");
  s.synchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (std::uint64_t done = 0; done < total_bytes; done += piece) {
    const std::uint64_t n = std::min(piece, total_bytes - done);
    REFIT_CUDA_CALL(cudaMemcpyAsync(dst.data(), src.data(), n, cudaMemcpyDeviceToDevice, st),
                    ordinal, "the copy bound");
  }
  s.synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

} // namespace refit::cuda
