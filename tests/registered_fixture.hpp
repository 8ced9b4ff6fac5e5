// Test helper: a trainer rank's own tensors laid out the way FSDP2 holds them (unpadded
// Shard(0) rows, optionally replicated tensors and transformers 5 fused expert parameters),
// filled with the synthetic weights at a step so that the published result is predictable.
#pragma once

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "actors/trainer_rank.hpp"
#include "runtime/config/config.hpp"
#include "runtime/model/synthetic.hpp"
#include "runtime/publication/backend.hpp"
#include "runtime/publication/collective_registry.hpp"
#include "runtime/publication/registered.hpp"
#include "runtime/publication/shard.hpp"

namespace refit::testing {

struct fsdp_layout {
  bool fused_experts = true;              // gate_up_proj / down_proj per layer
  std::set<std::string> replicated;       // names held whole by every rank
};

// One rank's memory: the registrations point into `storage`.
struct fsdp_rank_tensors {
  std::vector<std::unique_ptr<std::vector<std::byte>>> storage;
  std::vector<publication::tensor_registration> regs;
};

inline std::vector<std::byte> global_bytes(const model::model_config& cfg, const std::string& name,
                                           const model::synthetic_weights& w, std::uint64_t step,
                                           std::vector<std::int64_t>& shape) {
  const auto stream = model::expected_key_stream(cfg);
  for (const auto& p : stream)
    if (p.name == name) {
      shape = p.shape;
      return publication::full_tensor(p, w, step);
    }
  // A fused expert parameter: experts' canonical tensors stacked on dim 0.
  const bool down = name.size() > 9 && name.compare(name.size() - 9, 9, "down_proj") == 0;
  const std::string layer = name.substr(0, name.find(".mlp.experts."));
  const std::int64_t E = cfg.num_experts, I = cfg.moe_intermediate_size, H = cfg.hidden_size;
  shape = down ? std::vector<std::int64_t>{E, H, I} : std::vector<std::int64_t>{E, 2 * I, H};
  std::vector<std::byte> out;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string prefix = layer + ".mlp.experts." + std::to_string(e) + ".";
    for (const char* part : down ? std::vector<const char*>{"down_proj.weight"}
                                 : std::vector<const char*>{"gate_proj.weight", "up_proj.weight"})
      for (const auto& p : stream)
        if (p.name == prefix + part) {
          auto bytes = publication::full_tensor(p, w, step);
          out.insert(out.end(), bytes.begin(), bytes.end());
        }
  }
  return out;
}

// The trainer-side names of the model under `layout`.
inline std::vector<std::string> fsdp_names(const model::model_config& cfg, const fsdp_layout& layout) {
  std::vector<std::string> names;
  std::set<std::string> fused_done;
  for (const auto& p : model::expected_key_stream(cfg)) {
    const auto at = p.name.find(".mlp.experts.");
    if (layout.fused_experts && at != std::string::npos) {
      const std::string layer = p.name.substr(0, at);
      if (fused_done.insert(layer).second) {
        names.push_back(layer + ".mlp.experts.gate_up_proj");
        names.push_back(layer + ".mlp.experts.down_proj");
      }
      continue;
    }
    names.push_back(p.name);
  }
  return names;
}

inline void fill_rank(fsdp_rank_tensors& out, const model::model_config& cfg, std::uint32_t world,
                      std::uint32_t rank, const model::synthetic_weights& w, std::uint64_t step,
                      const fsdp_layout& layout, bool allocate) {
  const auto names = fsdp_names(cfg, layout);
  for (std::size_t k = 0; k < names.size(); ++k) {
    const auto& name = names[k];
    std::vector<std::int64_t> shape;
    auto global = global_bytes(cfg, name, w, step, shape);
    const std::uint64_t n = shape.empty() ? 1 : static_cast<std::uint64_t>(shape[0]);
    const std::uint64_t row = global.size() / n;
    const bool repl = layout.replicated.count(name) > 0;
    const auto rows = repl ? publication::row_range{0, n} : publication::fsdp_chunk(n, world, rank);
    if (allocate) {
      out.storage.push_back(std::make_unique<std::vector<std::byte>>(rows.count * row));
      publication::tensor_registration t;
      t.name = name;
      t.dt = cfg.torch_dtype;
      t.device = "cpu";
      t.global_shape = shape;
      t.placement = repl ? publication::tensor_placement::replicated
                         : publication::tensor_placement::shard0;
      t.row_begin = rows.begin;
      t.rows = rows.count;
      t.data = out.storage.back()->data();
      t.bytes = rows.count * row;
      out.regs.push_back(t);
    }
    auto& mem = *out.storage[k];
    if (!mem.empty())
      std::memcpy(mem.data(), global.data() + rows.begin * row, mem.size());
  }
}

inline std::unique_ptr<fsdp_rank_tensors> make_rank_tensors(const model::model_config& cfg,
                                                            std::uint32_t world, std::uint32_t rank,
                                                            const model::synthetic_weights& w,
                                                            std::uint64_t step,
                                                            const fsdp_layout& layout = {}) {
  auto out = std::make_unique<fsdp_rank_tensors>();
  fill_rank(*out, cfg, world, rank, w, step, layout, true);
  return out;
}

// Same memory, the weights at another step.
inline void refill_rank(fsdp_rank_tensors& t, const model::model_config& cfg, std::uint32_t world,
                        std::uint32_t rank, const model::synthetic_weights& w, std::uint64_t step,
                        const fsdp_layout& layout = {}) {
  fill_rank(t, cfg, world, rank, w, step, layout, false);
}

inline std::shared_ptr<publication::registered_weights> register_all(
  const model::model_config& cfg, std::uint32_t world, std::uint32_t rank,
  const fsdp_rank_tensors& t) {
  auto reg = std::make_shared<publication::registered_weights>(cfg, world, rank,
                                                               device::spec{device::kind::cpu, 0});
  for (const auto& r : t.regs)
    reg->add(r);
  reg->seal();
  return reg;
}

// Trainer rank r of a recipe publishing the registered tensors `reg` (its collective timeout
// 9/10 of the gate deadline, so a missing peer is the rank's error before the gate's).
inline trainer_rank_options registered_rank_options(
  const config::refit_config& cfg, std::uint32_t r, const device::spec& dev,
  std::shared_ptr<publication::registered_weights> reg,
  std::shared_ptr<publication::collective_registry> collectives, consensus_gate_actor gate) {
  trainer_rank_options o;
  o.rank = r;
  o.world = cfg.runtime.tp_size;
  o.device = cfg.runtime.devices[r];
  o.device_uuid = publication::device_uuid(dev);
  o.model = cfg.model;
  o.registered = std::move(reg);
  o.collectives = std::move(collectives);
  o.gate = std::move(gate);
  o.collective_timeout_ms = cfg.publication.gate_deadline_ms * 9 / 10;
  return o;
}

} // namespace refit::testing
