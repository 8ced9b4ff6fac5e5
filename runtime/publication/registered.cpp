// Registered tensors mapped onto the canonical key stream (see registered.hpp).
#include "runtime/publication/registered.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "runtime/model/digest.hpp"

#if REFIT_HAVE_CUDA
#include "runtime/cuda/cuda.hpp"
#endif

namespace refit::publication {

namespace {

const std::string layers_prefix = "model.layers.";
const std::string gate_up_suffix = ".mlp.experts.gate_up_proj";
const std::string down_suffix = ".mlp.experts.down_proj";

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::uint64_t dim0_of(const std::vector<std::int64_t>& shape) {
  return shape.empty() ? 1 : static_cast<std::uint64_t>(shape.front());
}

std::uint64_t row_bytes_of(const std::vector<std::int64_t>& shape, model::dtype dt) {
  std::uint64_t row = model::dtype_size(dt);
  for (std::size_t d = 1; d < shape.size(); ++d)
    row *= static_cast<std::uint64_t>(shape[d]);
  return row;
}

enum class fused_kind { none, gate_up, down };

// "model.layers.<L>.mlp.experts.gate_up_proj" / "...down_proj" -> (kind, L).
fused_kind parse_fused(const std::string& name, std::uint32_t& layer) {
  auto ends_with = [&](const std::string& s) {
    return name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  fused_kind kind = ends_with(gate_up_suffix) ? fused_kind::gate_up
                    : ends_with(down_suffix)  ? fused_kind::down
                                              : fused_kind::none;
  if (kind == fused_kind::none || name.compare(0, layers_prefix.size(), layers_prefix) != 0)
    return fused_kind::none;
  const auto suffix = kind == fused_kind::gate_up ? gate_up_suffix.size() : down_suffix.size();
  const std::string digits =
    name.substr(layers_prefix.size(), name.size() - suffix - layers_prefix.size());
  if (digits.empty() || digits.size() > 9
      || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return fused_kind::none;
  layer = static_cast<std::uint32_t>(std::stoul(digits));
  return kind;
}

device::spec parse_tensor_device(const std::string& text, const std::string& name) {
  if (text == "cpu")
    return {device::kind::cpu, 0};
  try {
    return device::parse(text, name + ".device");
  } catch (const std::exception&) {
    throw model::model_error(name, "device '" + text + "' is not cpu, cpu:N or cuda:N");
  }
}

// The rows a rank's memory holds and its size, against FSDP2's chunking of the global shape.
void check_rows(const tensor_registration& t, std::uint32_t world_, std::uint32_t rank_) {
  const std::uint64_t n = dim0_of(t.global_shape);
  const std::uint64_t row = row_bytes_of(t.global_shape, t.dt);
  if (t.placement == tensor_placement::replicated) {
    if (t.row_begin != 0 || t.rows != n)
      throw model::model_error(t.name, "replicated, but holds rows [" + std::to_string(t.row_begin)
                                         + ", " + std::to_string(t.row_begin + t.rows)
                                         + ") of " + std::to_string(n));
  } else {
    const auto want = fsdp_chunk(n, world_, rank_);
    if (t.row_begin != want.begin || t.rows != want.count)
      throw model::model_error(t.name, "rank " + std::to_string(rank_) + " of "
                                         + std::to_string(world_) + " holds rows ["
                                         + std::to_string(t.row_begin) + ", "
                                         + std::to_string(t.row_begin + t.rows)
                                         + "), FSDP2's Shard(0) of " + std::to_string(n)
                                         + " rows gives it [" + std::to_string(want.begin) + ", "
                                         + std::to_string(want.begin + want.count) + ")");
  }
  if (t.bytes != t.rows * row)
    throw model::model_error(t.name, std::to_string(t.bytes) + " bytes registered, "
                                       + std::to_string(t.rows) + " rows of global shape "
                                       + shape_text(t.global_shape) + " " + model::dtype_name(t.dt)
                                       + " are " + std::to_string(t.rows * row) + " bytes");
}

} // namespace

row_range fsdp_chunk(std::uint64_t n, std::uint32_t world, std::uint32_t rank) {
  if (world == 0)
    throw std::invalid_argument("fsdp_chunk: world must be >= 1");
  const std::uint64_t c = (n + world - 1) / world;
  const std::uint64_t begin = std::min<std::uint64_t>(n, std::uint64_t{rank} * c);
  return {begin, std::min(n, begin + c) - begin};
}

const char* placement_name(tensor_placement p) {
  return p == tensor_placement::replicated ? "replicated" : "Shard(0)";
}

registered_weights::registered_weights(const model::model_config& cfg, std::uint32_t world,
                                       std::uint32_t rank, device::spec rank_device)
  : cfg_(cfg), world_(world), rank_(rank), device_(rank_device) {
  model::validate(cfg_, 1);
  expected_ = model::expected_key_stream(cfg_);
  for (std::size_t i = 0; i < expected_.size(); ++i)
    canonical_.emplace(expected_[i].name, i);
  if (world_ == 0 || rank_ >= world_)
    throw std::invalid_argument("registered weights: rank " + std::to_string(rank_)
                                + " is out of range for world " + std::to_string(world_));
}

const tensor_registration* registered_weights::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

void registered_weights::add(tensor_registration t) {
  if (sealed_)
    throw model::model_error(t.name, "registered after the weights were sealed (connect)");
  if (t.name.empty())
    throw model::model_error("tensor", "a registered tensor needs a name");
  if (by_name_.count(t.name))
    throw model::model_error(t.name, "registered twice");
  for (auto d : t.global_shape)
    if (d < 0)
      throw model::model_error(t.name, "global shape " + shape_text(t.global_shape)
                                         + " has a negative dimension");
  const auto dev = parse_tensor_device(t.device, t.name);
  if (dev.k != device_.k || (dev.k == device::kind::cuda && dev.index != device_.index))
    throw model::model_error(t.name, "is on " + t.device + ", this rank's device is "
                                       + device::to_string(device_));
  // Part of the model, with the model's dtype and shape; the rows of this rank.
  std::uint32_t layer = 0;
  model::param_meta want;
  const std::int64_t E = cfg_.num_experts, I = cfg_.moe_intermediate_size, H = cfg_.hidden_size;
  if (auto it = canonical_.find(t.name); it != canonical_.end()) {
    want = expected_[it->second];
  } else if (auto kind = parse_fused(t.name, layer);
             kind != fused_kind::none && layer < cfg_.num_hidden_layers) {
    want.name = t.name;
    want.dt = cfg_.torch_dtype;
    want.shape = kind == fused_kind::gate_up ? std::vector<std::int64_t>{E, 2 * I, H}
                                             : std::vector<std::int64_t>{E, H, I};
  } else {
    throw model::model_error(t.name, "extra tensor: not part of the model's key stream ("
                                       + std::to_string(expected_.size()) + " tensors, "
                                       + std::to_string(cfg_.num_hidden_layers) + " layers)");
  }
  if (t.dt != want.dt)
    throw model::model_error(t.name, std::string("dtype ") + model::dtype_name(t.dt)
                                       + ", the model expects " + model::dtype_name(want.dt));
  if (t.global_shape != want.shape)
    throw model::model_error(t.name, "global shape " + shape_text(t.global_shape)
                                       + ", the model expects " + shape_text(want.shape));
  check_rows(t, world_, rank_);
  if (t.bytes > 0 && t.data == nullptr)
    throw model::model_error(t.name, "null data pointer for " + std::to_string(t.bytes) + " bytes");
  by_name_.emplace(t.name, tensors_.size());
  tensors_.push_back(std::move(t));
}

void registered_weights::seal() {
  if (sealed_)
    return;
  auto expected = expected_;
  const std::int64_t I = cfg_.moe_intermediate_size, H = cfg_.hidden_size;

  // Every canonical tensor has exactly one source (each registration was checked by add).
  std::vector<canonical_source> sources(expected.size());
  const std::uint64_t es = model::dtype_size(cfg_.torch_dtype);
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const auto& p = expected[i];
    const auto direct = by_name_.find(p.name);
    std::size_t fused = tensors_.size();
    std::uint64_t base = 0;
    // <layer>.mlp.experts.<e>.{gate,up,down}_proj.weight inside a fused parameter.
    const std::string infix = ".mlp.experts.";
    if (auto at = p.name.find(infix); at != std::string::npos && p.name.rfind(layers_prefix, 0) == 0) {
      const std::string layer_part = p.name.substr(0, at);
      const std::string rest = p.name.substr(at + infix.size());
      const auto dot = rest.find('.');
      const std::uint64_t e = std::stoull(rest.substr(0, dot));
      const std::string which = rest.substr(dot + 1);
      const bool down = which == "down_proj.weight";
      const auto f = by_name_.find(layer_part + (down ? down_suffix : gate_up_suffix));
      if (f != by_name_.end()) {
        fused = f->second;
        const std::uint64_t expert_bytes = (down ? H * I : 2 * I * H) * es;
        base = e * expert_bytes + (which == "up_proj.weight" ? I * H * es : 0);
      }
    }
    if (direct != by_name_.end() && fused < tensors_.size())
      throw model::model_error(p.name, "registered twice: directly and through "
                                         + tensors_[fused].name);
    if (direct == by_name_.end() && fused == tensors_.size())
      throw model::model_error(p.name, "missing tensor: registered neither directly nor through a "
                                       "fused expert parameter (the first of the model's "
                                         + std::to_string(expected.size())
                                         + " canonical tensors without a source)");
    sources[i] = direct != by_name_.end() ? canonical_source{direct->second, 0}
                                          : canonical_source{fused, base};
  }

  // Pieces: rank q contributes T's global rows fsdp_chunk(N_T, W, q) inside the tensor.
  pieces_.assign(expected.size(), std::vector<gather_piece>(world_));
  sources_.assign(expected.size(), nullptr);
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const auto& t = tensors_[sources[i].tensor];
    const std::uint64_t row = row_bytes_of(t.global_shape, t.dt);
    const std::uint64_t n = dim0_of(t.global_shape);
    const std::uint64_t lo = sources[i].base, hi = lo + expected[i].nbytes();
    for (std::uint32_t q = 0; q < world_; ++q) {
      const auto chunk = fsdp_chunk(n, world_, q);
      const std::uint64_t a = std::max(lo, chunk.begin * row);
      const std::uint64_t b = std::min(hi, (chunk.begin + chunk.count) * row);
      pieces_[i][q] = b > a ? gather_piece{a - lo, b - a} : gather_piece{0, 0};
      if (q == rank_ && b > a)
        sources_[i] = t.data + (a - t.row_begin * row);
    }
  }
  params_ = std::move(expected);
  sealed_ = true;
}

gather_item registered_weights::item(std::size_t i, std::byte* out) const {
  if (!sealed_)
    throw std::logic_error("registered weights used before seal()");
  gather_item it;
  it.pieces = pieces_.at(i);
  it.shard = sources_[i];
  it.shard_bytes = it.pieces[rank_].bytes;
  it.out = out;
  if (world_ == 1)
    it.pieces.clear(); // one rank: the uniform layout (what the NCCL all-gather takes)
  return it;
}

std::uint64_t registered_weights::bytes() const {
  std::uint64_t total = 0;
  for (const auto& t : tensors_)
    total += t.bytes;
  return total;
}

std::vector<std::uint64_t> registered_weights::partial_digests(
  const model::tp_layout& layout, const std::vector<std::size_t>& indices) const {
  if (!sealed_)
    throw std::logic_error("registered weights used before seal()");
#if !REFIT_HAVE_CUDA
  if (device_.k != device::kind::cpu)
    throw std::invalid_argument(device::to_string(device_)
                                + ": registered device memory needs a build with REFIT_CUDA=ON");
#endif
  const std::size_t residents = layout.residents().size();
  std::vector<std::uint64_t> out(std::size_t{layout.tp()} * residents, 0);
#if REFIT_HAVE_CUDA
  if (device_.k == device::kind::cuda) {
    // On the device: one kernel over every placement row this rank contributed (slots are
    // t * residents + resident), no copy of the registered memory to the host.
    std::vector<cuda::placed_desc> descs;
    for (const auto i : indices) {
      const auto& p = params_.at(i);
      const auto& mine = pieces_[i][rank_];
      if (mine.bytes == 0)
        continue;
      const std::uint64_t es = model::dtype_size(p.dt);
      for (std::uint32_t t = 0; t < layout.tp(); ++t)
        for (const auto& pl : layout.place(p, t)) {
          const auto slot = static_cast<std::uint32_t>(std::size_t{t} * residents + pl.resident_index);
          const bool whole = pl.src_offset >= mine.offset
                             && pl.src_offset + (pl.rows ? (pl.rows - 1) * pl.src_stride : 0)
                                    + pl.row_bytes <= mine.offset + mine.bytes;
          for (std::uint64_t r = 0; r < pl.rows; r += whole ? pl.rows : 1) {
            const std::uint64_t row_lo = pl.src_offset + r * pl.src_stride;
            const std::uint64_t a = std::max(row_lo, mine.offset);
            const std::uint64_t b = std::min(row_lo + pl.row_bytes, mine.offset + mine.bytes);
            if (b <= a)
              continue;
            cuda::placed_desc d;
            d.src = sources_[i] + (a - mine.offset);
            d.resident = slot;
            d.element_size = static_cast<std::uint32_t>(es);
            d.src_stride = pl.src_stride / es;
            d.dst_element = (pl.dst_offset + r * pl.dst_stride + (a - row_lo)) / es;
            d.dst_stride = pl.dst_stride / es;
            d.row_elements = (b - a) / es;
            d.rows = whole ? pl.rows : 1;
            descs.push_back(d);
          }
        }
    }
    cuda::stream s(device_.index);
    return s.placed_digests(descs, out.size());
  }
#endif
  for (const auto i : indices) {
    const auto& p = params_.at(i);
    const auto& mine = pieces_[i][rank_];
    if (mine.bytes == 0)
      continue;
    const std::byte* src = sources_[i];
    const std::uint64_t es = model::dtype_size(p.dt);
    for (std::uint32_t t = 0; t < layout.tp(); ++t) {
      for (const auto& pl : layout.place(p, t)) {
        std::uint64_t sum = 0;
        for (std::uint64_t r = 0; r < pl.rows; ++r) {
          const std::uint64_t row_lo = pl.src_offset + r * pl.src_stride;
          const std::uint64_t a = std::max(row_lo, mine.offset);
          const std::uint64_t b = std::min(row_lo + pl.row_bytes, mine.offset + mine.bytes);
          if (b <= a)
            continue;
          const std::uint64_t dst = (pl.dst_offset + r * pl.dst_stride + (a - row_lo)) / es;
          const std::byte* from = src + (a - mine.offset);
          const std::uint64_t count = (b - a) / es;
          for (std::uint64_t c = 0; c < count; ++c) {
            std::uint32_t bits = 0;
            if (es == 2) {
              std::uint16_t h;
              std::memcpy(&h, from + c * 2, 2);
              bits = h;
            } else {
              std::memcpy(&bits, from + c * 4, 4);
            }
            sum += model::element_term(dst + c, bits) - model::element_term(dst + c, 0);
          }
        }
        out[std::size_t{t} * residents + pl.resident_index] += sum;
      }
    }
  }
  return out;
}

} // namespace refit::publication
