#include "runtime/bench/fsdp_memory.hpp"

#include <map>
#include <stdexcept>
#include <string>

#if REFIT_HAVE_CUDA
#include "runtime/cuda/cuda.hpp"
#endif

namespace refit::bench {

namespace {

constexpr std::uint64_t alignment = 256;

std::uint64_t row_elements(const model::param_meta& p) {
  std::uint64_t n = 1;
  for (std::size_t d = 1; d < p.shape.size(); ++d)
    n *= static_cast<std::uint64_t>(p.shape[d]);
  return n;
}

std::uint64_t aligned(std::uint64_t x) { return (x + alignment - 1) / alignment * alignment; }

// One parameter of the rank's FSDP2 state: its registration and its offset in the arena.
struct planned {
  publication::tensor_registration reg;
  std::uint64_t offset = 0;
};

} // namespace

struct fsdp_memory::arena {
  std::unique_ptr<std::byte[]> host;
#if REFIT_HAVE_CUDA
  cuda::device_allocation gpu;
#endif
  std::byte* data = nullptr;
};

fsdp_memory::~fsdp_memory() = default;

fsdp_memory::fsdp_memory(const model::model_config& cfg, std::uint32_t world, std::uint32_t rank,
                         const model::synthetic_weights& w, std::uint64_t step,
                         device::spec device)
  : device_(device) {
#if !REFIT_HAVE_CUDA
  if (device.k == device::kind::cuda)
    throw std::invalid_argument(device::to_string(device)
                                + ": registered device memory needs a build with REFIT_CUDA=ON");
#endif
  reg_ = std::make_shared<publication::registered_weights>(cfg, world, rank, device);
  const auto stream = model::expected_key_stream(cfg);
  const std::uint64_t es = model::dtype_size(cfg.torch_dtype);
  const std::uint64_t E = cfg.num_experts, I = cfg.moe_intermediate_size, H = cfg.hidden_size;
  const auto experts = publication::fsdp_chunk(E, world, rank);
  const std::string device_name = device::to_string(device);

  // 1. The layout: every parameter's rows at an aligned offset of one arena.
  std::vector<planned> plan;
  std::map<std::string, std::pair<std::size_t, std::size_t>> fused; // layer -> (gate_up, down)
  auto add = [&](std::string name, std::vector<std::int64_t> shape, publication::row_range rows,
                 std::uint64_t row_bytes) {
    planned p;
    p.reg.name = std::move(name);
    p.reg.bytes = rows.count * row_bytes;
    p.reg.dt = cfg.torch_dtype;
    p.reg.device = device_name;
    p.reg.global_shape = std::move(shape);
    p.reg.row_begin = rows.begin;
    p.reg.rows = rows.count;
    p.offset = arena_bytes_;
    arena_bytes_ += aligned(std::max<std::uint64_t>(1, p.reg.bytes));
    bytes_ += p.reg.bytes;
    plan.push_back(std::move(p));
    return plan.size() - 1;
  };
  // Where each canonical tensor's rows of this rank go: (plan index, byte offset inside it,
  // first element, element count); none for an expert another rank holds.
  struct fill {
    std::size_t param;
    std::uint64_t at;
    std::uint64_t begin;
    std::uint64_t count;
  };
  std::vector<std::pair<const model::param_meta*, fill>> fills;
  for (const auto& p : stream) {
    const auto at = p.name.find(".mlp.experts.");
    if (at == std::string::npos) {
      const std::uint64_t n = p.shape.empty() ? 1 : static_cast<std::uint64_t>(p.shape[0]);
      const auto rows = publication::fsdp_chunk(n, world, rank);
      const auto i = add(p.name, p.shape, rows, row_elements(p) * es);
      fills.push_back({&p, {i, 0, rows.begin * row_elements(p), rows.count * row_elements(p)}});
      continue;
    }
    const std::string layer = p.name.substr(0, at);
    if (!fused.count(layer)) {
      const auto gu = add(layer + ".mlp.experts.gate_up_proj",
                          {static_cast<std::int64_t>(E), static_cast<std::int64_t>(2 * I),
                           static_cast<std::int64_t>(H)},
                          experts, 2 * I * H * es);
      const auto dn = add(layer + ".mlp.experts.down_proj",
                          {static_cast<std::int64_t>(E), static_cast<std::int64_t>(H),
                           static_cast<std::int64_t>(I)},
                          experts, H * I * es);
      fused[layer] = {gu, dn};
    }
    const std::string rest = p.name.substr(at + 13);
    const std::uint64_t e = std::stoull(rest.substr(0, rest.find('.')));
    if (e < experts.begin || e >= experts.begin + experts.count)
      continue;
    const std::uint64_t local = e - experts.begin;
    if (rest.find("down_proj") != std::string::npos)
      fills.push_back({&p, {fused[layer].second, local * H * I * es, 0, p.numel()}});
    else
      fills.push_back({&p, {fused[layer].first,
                            local * 2 * I * H * es
                              + (rest.find("up_proj") != std::string::npos ? I * H * es : 0),
                            0, p.numel()}});
  }

  // 2. One allocation on the rank's device.
  arena_ = std::make_unique<arena>();
#if REFIT_HAVE_CUDA
  if (device.k == device::kind::cuda) {
    arena_->gpu = cuda::device_allocation(device.index, std::max<std::uint64_t>(1, arena_bytes_),
                                          "the bench's FSDP2 arena of rank " + std::to_string(rank));
    arena_->data = arena_->gpu.data();
  }
#endif
  if (device.k != device::kind::cuda) {
    arena_->host.reset(new std::byte[std::max<std::uint64_t>(1, arena_bytes_)]);
    arena_->data = arena_->host.get();
  }

  // 3. Fill with the synthetic weights at `step`, where the trainer's parameters would be.
  for (const auto& [param, f] : fills) {
    std::byte* out = arena_->data + plan[f.param].offset + f.at;
    if (f.count == 0)
      continue;
#if REFIT_HAVE_CUDA
    if (device.k == device::kind::cuda) {
      cuda::fill_synthetic(device.index, *param, w, 0, f.begin, f.count, out);
      for (std::uint64_t s = 1; s <= step; ++s)
        cuda::apply_synthetic_step(device.index, *param, w, s, f.begin, f.count, out);
      continue;
    }
#endif
    model::fill_synthetic(*param, w, 0, f.begin, f.count, out);
    for (std::uint64_t s = 1; s <= step; ++s)
      model::apply_synthetic_step(*param, w, s, f.begin, f.count, out);
  }

  // 4. Registered in place.
  for (auto& p : plan) {
    p.reg.data = arena_->data + p.offset;
    reg_->add(std::move(p.reg));
  }
  reg_->seal();
}

} // namespace refit::bench
