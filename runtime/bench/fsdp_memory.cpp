#include "runtime/bench/fsdp_memory.hpp"

#include <map>
#include <string>

namespace refit::bench {

namespace {

std::uint64_t row_elements(const model::param_meta& p) {
  std::uint64_t n = 1;
  for (std::size_t d = 1; d < p.shape.size(); ++d)
    n *= static_cast<std::uint64_t>(p.shape[d]);
  return n;
}

} // namespace

fsdp_memory::fsdp_memory(const model::model_config& cfg, std::uint32_t world, std::uint32_t rank,
                         const model::synthetic_weights& w, std::uint64_t step) {
  reg_ = std::make_shared<publication::registered_weights>(cfg, world, rank,
                                                           device::spec{device::kind::cpu, 0});
  const auto stream = model::expected_key_stream(cfg);
  const std::uint64_t es = model::dtype_size(cfg.torch_dtype);
  const std::uint64_t E = cfg.num_experts, I = cfg.moe_intermediate_size, H = cfg.hidden_size;
  const auto experts = publication::fsdp_chunk(E, world, rank);
  auto add = [&](std::string name, std::vector<std::int64_t> shape, publication::row_range rows,
                 std::uint64_t row_bytes) -> std::byte* {
    storage_.emplace_back(new std::byte[std::max<std::uint64_t>(1, rows.count * row_bytes)]);
    publication::tensor_registration t;
    t.name = std::move(name);
    t.data = storage_.back().get();
    t.bytes = rows.count * row_bytes;
    t.dt = cfg.torch_dtype;
    t.global_shape = std::move(shape);
    t.row_begin = rows.begin;
    t.rows = rows.count;
    bytes_ += t.bytes;
    reg_->add(t);
    return storage_.back().get();
  };
  // Fused expert parameters of each layer: filled expert by expert from the canonical tensors.
  std::map<std::string, std::pair<std::byte*, std::byte*>> fused; // layer -> (gate_up, down)
  for (const auto& p : stream) {
    const auto at = p.name.find(".mlp.experts.");
    if (at == std::string::npos) {
      const std::uint64_t n = p.shape.empty() ? 1 : static_cast<std::uint64_t>(p.shape[0]);
      const auto rows = publication::fsdp_chunk(n, world, rank);
      std::byte* out = add(p.name, p.shape, rows, row_elements(p) * es);
      model::fill_synthetic(p, w, 0, rows.begin * row_elements(p), rows.count * row_elements(p), out);
      if (step > 0)
        for (std::uint64_t s = 1; s <= step; ++s)
          model::apply_synthetic_step(p, w, s, rows.begin * row_elements(p),
                                      rows.count * row_elements(p), out);
      continue;
    }
    const std::string layer = p.name.substr(0, at);
    if (!fused.count(layer)) {
      auto* gu = add(layer + ".mlp.experts.gate_up_proj",
                     {static_cast<std::int64_t>(E), static_cast<std::int64_t>(2 * I),
                      static_cast<std::int64_t>(H)},
                     experts, 2 * I * H * es);
      auto* dn = add(layer + ".mlp.experts.down_proj",
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
    std::byte* out = nullptr;
    if (rest.find("down_proj") != std::string::npos)
      out = fused[layer].second + local * H * I * es;
    else
      out = fused[layer].first + local * 2 * I * H * es
            + (rest.find("up_proj") != std::string::npos ? I * H * es : 0);
    model::fill_synthetic(p, w, 0, 0, p.numel(), out);
    for (std::uint64_t s = 1; s <= step; ++s)
      model::apply_synthetic_step(p, w, s, 0, p.numel(), out);
  }
  reg_->seal();
}

} // namespace refit::bench
