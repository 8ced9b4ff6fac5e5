#include "runtime/checkpoint/weights.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include "runtime/checkpoint/convert.hpp"

#include <map>
#include <optional>
#include <set>

namespace refit::checkpoint {

namespace {

const std::string layer_prefix = "model.layers.";
const std::string experts_infix = "mlp.experts.";

// "model.layers.{i}.<rest>" -> (i, rest).
std::optional<std::pair<std::uint64_t, std::string>> split_layer(const std::string& name) {
  if (name.compare(0, layer_prefix.size(), layer_prefix) != 0)
    return std::nullopt;
  std::size_t pos = layer_prefix.size();
  std::uint64_t layer = 0;
  const std::size_t start = pos;
  while (pos < name.size() && name[pos] >= '0' && name[pos] <= '9' && pos - start < 10)
    layer = layer * 10 + static_cast<std::uint64_t>(name[pos++] - '0');
  if (pos == start || pos >= name.size() || name[pos] != '.')
    return std::nullopt;
  return std::make_pair(layer, name.substr(pos + 1));
}

bool is_fused_leaf(const std::string& rest) {
  return rest == experts_infix + "gate_up_proj" || rest == experts_infix + "down_proj";
}

bool hf_ignores(const std::string& name, bool tied) {
  static const std::string inv_freq = ".rotary_emb.inv_freq";
  if (tied && name == "lm_head.weight")
    return true;
  return name.size() >= inv_freq.size()
         && name.compare(name.size() - inv_freq.size(), inv_freq.size(), inv_freq) == 0;
}

struct expert_ref {
  std::uint64_t layer;
  std::uint64_t expert;
  std::string leaf; // gate_proj.weight, up_proj.weight, down_proj.weight
};

std::optional<expert_ref> parse_expert(const std::string& name) {
  const auto l = split_layer(name);
  if (!l || l->second.compare(0, experts_infix.size(), experts_infix) != 0)
    return std::nullopt;
  const std::string rest = l->second.substr(experts_infix.size());
  const auto dot = rest.find('.');
  if (dot == std::string::npos || dot == 0)
    return std::nullopt;
  std::uint64_t e = 0;
  for (std::size_t i = 0; i < dot; ++i) {
    if (rest[i] < '0' || rest[i] > '9')
      return std::nullopt;
    e = e * 10 + static_cast<std::uint64_t>(rest[i] - '0');
  }
  return expert_ref{l->first, e, rest.substr(dot + 1)};
}

void check_shape(const tensor_view& t, const std::vector<std::int64_t>& expected,
                 const std::string& canonical) {
  if (t.shape != expected)
    throw checkpoint_error(t.file, t.name, "shape",
                           "expected " + shape_string(expected) + " (for " + canonical
                             + "), got " + shape_string(t.shape));
}

} // namespace

model_weights::model_weights(const checkpoint_files& files, const hf_model& m)
  : cfg_(m.cfg), dir_(files.dir()) {
  if (!m.dtype_declared) {
    const tensor_view* embed = files.find("model.embed_tokens.weight");
    if (embed == nullptr)
      throw checkpoint_error(dir_, "model.embed_tokens.weight", "", "missing");
    cfg_.torch_dtype = embed->dt;
  }
  std::vector<model::param_meta> stream;
  try {
    stream = model::expected_key_stream(cfg_);
  } catch (const model::model_error& e) {
    throw checkpoint_error(dir_ + "/config.json", "", e.where, e.what());
  }

  // The expert layout of every layer, from the checkpoint's names.
  std::map<std::uint64_t, std::string> fused, per_expert; // layer -> an example name
  for (const tensor_view* t : files.tensors()) {
    const auto l = split_layer(t->name);
    if (!l || l->second.compare(0, experts_infix.size(), experts_infix) != 0)
      continue;
    (is_fused_leaf(l->second) ? fused : per_expert).emplace(l->first, t->name);
  }
  for (const auto& [layer, name] : fused)
    if (const auto it = per_expert.find(layer); it != per_expert.end())
      throw checkpoint_error(dir_, name, "layout",
                             "layer " + std::to_string(layer) + " mixes the fused expert layout ("
                               + name + ") with per-expert keys (" + it->second + ")");

  const std::int64_t E = cfg_.num_experts, I = cfg_.moe_intermediate_size, H = cfg_.hidden_size;
  std::set<std::string> used;
  const auto require = [&](const std::string& name, const std::string& canonical) {
    const tensor_view* t = files.find(name);
    if (t == nullptr)
      throw checkpoint_error(dir_, canonical, "",
                             name == canonical ? "missing from the checkpoint"
                                               : "missing from the checkpoint (needs " + name + ")");
    used.insert(name);
    return t;
  };
  sources_.reserve(stream.size());
  for (auto& p : stream) {
    canonical_source s;
    const auto ex = parse_expert(p.name);
    const tensor_view* t = nullptr;
    std::uint64_t elem_offset = 0;
    if (ex && fused.count(ex->layer)) {
      const std::string base = layer_prefix + std::to_string(ex->layer) + "." + experts_infix;
      if (ex->leaf == "down_proj.weight") {
        t = require(base + "down_proj", p.name);
        check_shape(*t, {E, H, I}, p.name);
        elem_offset = ex->expert * static_cast<std::uint64_t>(H * I);
      } else {
        t = require(base + "gate_up_proj", p.name);
        check_shape(*t, {E, 2 * I, H}, p.name);
        elem_offset = ex->expert * static_cast<std::uint64_t>(2 * I * H)
                      + (ex->leaf == "up_proj.weight" ? static_cast<std::uint64_t>(I * H) : 0);
      }
    } else {
      t = require(p.name, p.name);
      check_shape(*t, p.shape, p.name);
    }
    const std::uint64_t esize = model::dtype_size(t->dt);
    s.source_dt = t->dt;
    s.source_name = t->name;
    s.ranges.push_back(byte_range{t->data + elem_offset * esize, p.numel() * esize, t->file,
                                  t->file_offset + elem_offset * esize});
    s.meta = std::move(p);
    by_name_.emplace(s.meta.name, sources_.size());
    sources_.push_back(std::move(s));
  }

  std::vector<std::string> unexpected;
  for (const tensor_view* t : files.tensors()) {
    if (used.count(t->name))
      continue;
    if (hf_ignores(t->name, cfg_.tie_word_embeddings))
      ignored_.push_back(t->name);
    else
      unexpected.push_back(t->name);
  }
  if (!unexpected.empty()) {
    const tensor_view* t = files.find(unexpected.front());
    std::string more;
    if (unexpected.size() > 1)
      more = " (and " + std::to_string(unexpected.size() - 1) + " more unexpected tensors)";
    throw checkpoint_error(t->file, t->name, "",
                           "not part of the model the config describes" + more);
  }
}

std::vector<model::param_meta> model_weights::key_stream() const {
  std::vector<model::param_meta> out;
  out.reserve(sources_.size());
  for (const auto& s : sources_)
    out.push_back(s.meta);
  return out;
}

std::string model_weights::fingerprint() const { return model::structural_manifest(key_stream()); }

const canonical_source& model_weights::source(const std::string& name) const {
  const auto it = by_name_.find(name);
  if (it == by_name_.end())
    throw checkpoint_error(dir_, name, "", "not a canonical tensor of this model");
  return sources_[it->second];
}

namespace {

// The mapped file pages just read leave this process's resident set (they stay in the page
// cache and fault back in when read again), so reading a checkpoint tensor by tensor holds
// about one tensor of it at a time, not the whole model.
void release_pages(const std::byte* data, std::uint64_t bytes) {
  static const std::uintptr_t page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(data) / page * page;
  const auto end = (reinterpret_cast<std::uintptr_t>(data) + bytes + page - 1) / page * page;
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

} // namespace

void model_weights::read_canonical(const model::param_meta& p, std::uint64_t elem_begin,
                                   std::uint64_t count, std::byte* out) const {
  const canonical_source& s = source(p.name);
  if (!(p == s.meta))
    throw checkpoint_error(dir_, p.name, "meta",
                           "asked for " + shape_string(p.shape) + " " + model::dtype_name(p.dt)
                             + ", the model has " + shape_string(s.meta.shape) + " "
                             + model::dtype_name(s.meta.dt));
  const std::uint64_t numel = s.meta.numel();
  if (elem_begin > numel || count > numel - elem_begin)
    throw checkpoint_error(dir_, p.name, "range",
                           "elements [" + std::to_string(elem_begin) + ", +" + std::to_string(count)
                             + ") are past the end (" + std::to_string(numel) + " elements)");
  const std::uint64_t in_size = model::dtype_size(s.source_dt);
  const std::uint64_t out_size = model::dtype_size(s.meta.dt);
  std::uint64_t skip = elem_begin; // elements to skip before copying
  for (const auto& r : s.ranges) {
    if (count == 0)
      break;
    const std::uint64_t elems = r.nbytes / in_size;
    if (skip >= elems) {
      skip -= elems;
      continue;
    }
    const std::uint64_t n = std::min(elems - skip, count);
    const std::byte* src = r.data + skip * in_size;
    convert_elements(s.source_dt, src, s.meta.dt, out, n);
    release_pages(src, n * in_size);
    out += n * out_size;
    count -= n;
    skip = 0;
  }
}

} // namespace refit::checkpoint
