#include "runtime/inference/forward.hpp"

#include <algorithm>
#include <cstdlib>
#include <dlfcn.h>
#include <limits.h>
#include <mutex>
#include <stdexcept>
#include <sys/stat.h>
#include <unistd.h>

namespace refit::inference {

kv_geometry kv_geometry::of(const model::model_config& cfg, std::uint32_t tp,
                            std::uint32_t block_size, std::uint32_t element_bytes) {
  model::validate(cfg, tp);
  if (block_size == 0)
    throw std::invalid_argument("kv_geometry: block_size must be >= 1");
  if (element_bytes != 2 && element_bytes != 4)
    throw std::invalid_argument("kv_geometry: element_bytes must be 2 or 4");
  kv_geometry g;
  g.layers = cfg.num_hidden_layers;
  g.kv_heads = std::max<std::uint32_t>(1, cfg.num_key_value_heads / tp);
  g.head_dim = cfg.head_dim;
  g.block_size = block_size;
  g.element_bytes = element_bytes;
  return g;
}

namespace {

// Every draw reads a row of the step (`call` names the entry point in the error).
void check_draw_rows(const char* call, const std::vector<forward_item>& items,
                     const std::vector<sample_draw>& draws) {
  for (const sample_draw& d : draws)
    if (d.row >= items.size())
      throw std::out_of_range(std::string(call) + ": draw row " + std::to_string(d.row) + " >= "
                              + std::to_string(items.size()) + " items");
}

// The counter-based uniform of each draw (sampling_uniform), for a device that samples.
std::vector<double> draw_uniforms(const sampling_config& params,
                                  const std::vector<sample_draw>& draws) {
  std::vector<double> uniforms;
  uniforms.reserve(draws.size());
  for (const sample_draw& d : draws)
    uniforms.push_back(sampling_uniform(params.seed, d.prompt, d.sample, d.step));
  return uniforms;
}

} // namespace

std::vector<sampled_token> rank_forward::forward_sample(const std::vector<forward_item>& items,
                                                        std::byte* kv_base,
                                                        const sampling_config& params,
                                                        const std::vector<sample_draw>& draws) {
  check_draw_rows("forward_sample", items, draws);
  if (samples_on_device())
    return forward_sample_device(items, kv_base, params, draws, draw_uniforms(params, draws));
  const std::vector<float> logits = forward(items, kv_base, logits_rows::last_token);
  const std::size_t vocab = items.empty() ? 0 : logits.size() / items.size();
  std::vector<sampled_token> out;
  out.reserve(draws.size());
  for (const sample_draw& d : draws)
    out.push_back(sample_token(logits.data() + std::size_t{d.row} * vocab, vocab, params,
                               d.prompt, d.sample, d.step));
  return out;
}

void rank_forward::begin_sample(const std::vector<forward_item>& items, std::byte* kv_base,
                                const sampling_config& params,
                                const std::vector<sample_draw>& draws,
                                const std::vector<std::int64_t>& feed) {
  if (!pipelines_samples())
    throw std::logic_error("begin_sample: this backend does not pipeline decode steps");
  check_draw_rows("begin_sample", items, draws);
  if (!feed.empty() && feed.size() != items.size())
    throw std::invalid_argument("begin_sample: " + std::to_string(feed.size())
                                + " feed entries for " + std::to_string(items.size()) + " items");
  for (std::size_t i = 0; i < feed.size(); ++i)
    if (feed[i] < -1 || (feed[i] >= 0 && items[i].count != 1))
      throw std::invalid_argument("begin_sample: feed[" + std::to_string(i) + "] = "
                                  + std::to_string(feed[i]) + " for an item of "
                                  + std::to_string(items[i].count)
                                  + " tokens (a draw index feeds one token; -1: none)");
  begin_sample_device(items, kv_base, params, draws, draw_uniforms(params, draws), feed);
}

rank_weights bind_weights(const model::model_config& cfg, const model::tp_layout& layout,
                          const std::vector<const std::byte*>& residents) {
  const auto& specs = layout.residents();
  if (residents.size() != specs.size())
    throw model::model_error("residents", "got " + std::to_string(residents.size())
                                            + " resident pointers, the tp="
                                            + std::to_string(layout.tp()) + " layout has "
                                            + std::to_string(specs.size()));
  for (std::size_t i = 0; i < residents.size(); ++i)
    if (residents[i] == nullptr)
      throw model::model_error(specs[i].name, "resident pointer is null");
  const auto at = [&](const std::string& name) { return residents[layout.resident_index(name)]; };
  rank_weights w;
  w.dt = cfg.torch_dtype;
  w.embed = at("model.embed_tokens.weight");
  w.final_norm = at("model.norm.weight");
  w.lm_head = cfg.tie_word_embeddings ? w.embed : at("lm_head.weight");
  for (std::uint32_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    layer_weights lw;
    lw.qkv = at(p + "self_attn.qkv_proj.weight");
    lw.o = at(p + "self_attn.o_proj.weight");
    lw.q_norm = at(p + "self_attn.q_norm.weight");
    lw.k_norm = at(p + "self_attn.k_norm.weight");
    lw.router = at(p + "mlp.gate.weight");
    lw.w13 = at(p + "mlp.experts.w13_weight");
    lw.w2 = at(p + "mlp.experts.w2_weight");
    lw.input_norm = at(p + "input_layernorm.weight");
    lw.post_attention_norm = at(p + "post_attention_layernorm.weight");
    w.layers.push_back(lw);
  }
  return w;
}

namespace {

constexpr const char* module_file = "librefit_torch_forward.so";

std::mutex backend_mutex;
const backend_entry* backend = nullptr;
std::string backend_path;

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string executable_dir() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0)
    return {};
  std::string path(buf, static_cast<std::size_t>(n));
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash);
}

const backend_entry* load_backend() {
  std::lock_guard<std::mutex> lock(backend_mutex);
  if (backend)
    return backend;
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("REFIT_TORCH_FORWARD"); env && *env)
    candidates.emplace_back(env);
  if (const std::string dir = executable_dir(); !dir.empty())
    candidates.push_back(dir + "/" + module_file);
#ifdef REFIT_TORCH_FORWARD_PATH
  candidates.emplace_back(REFIT_TORCH_FORWARD_PATH);
#endif
  std::string tried;
  for (const auto& path : candidates) {
    tried += (tried.empty() ? "" : "; ") + path;
    if (!is_file(path)) {
      tried += " (missing)";
      continue;
    }
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* err = ::dlerror();
      tried += std::string(" (") + (err ? err : "dlopen failed") + ")";
      continue;
    }
    using entry_fn = const backend_entry* (*)();
    auto fn = reinterpret_cast<entry_fn>(::dlsym(handle, "refit_torch_forward_entry"));
    const backend_entry* entry = fn ? fn() : nullptr;
    if (!entry || entry->abi_version != backend_abi_version
        || entry->options_size != sizeof(rank_forward_options)) {
      tried += " (incompatible backend)";
      ::dlclose(handle);
      continue;
    }
    backend = entry; // never unloaded: LibTorch does not support dlclose
    backend_path = path;
    return backend;
  }
  throw std::runtime_error(std::string("cannot load the LibTorch forward backend ") + module_file
                           + "; tried: " + tried);
}

} // namespace

std::unique_ptr<rank_forward> make_rank_forward(const rank_forward_options& options) {
  if (!options.comm)
    throw std::invalid_argument("make_rank_forward: no tp_comm");
  if (options.comm->world_size() != options.tp)
    throw std::invalid_argument("make_rank_forward: tp_comm world size "
                                + std::to_string(options.comm->world_size()) + " != tp "
                                + std::to_string(options.tp));
  if (options.rank >= options.tp)
    throw std::invalid_argument("make_rank_forward: rank " + std::to_string(options.rank)
                                + " >= tp " + std::to_string(options.tp));
  if (options.weights.layers.size() != options.model.num_hidden_layers)
    throw std::invalid_argument("make_rank_forward: weights are not bound (bind_weights)");
  if (options.compute_dtype == model::dtype::float16)
    throw std::invalid_argument("make_rank_forward: compute dtype float16 is not supported "
                                "(float32 or bfloat16)");
  if (options.compute_dtype == model::dtype::bfloat16
      && options.weights.dt != model::dtype::bfloat16)
    throw std::invalid_argument("make_rank_forward: the bf16 engine needs bfloat16 weights (the "
                                "model's torch_dtype is not bfloat16); use compute dtype float32");
  const std::uint32_t kv_elem = options.compute_dtype == model::dtype::bfloat16 ? 2 : 4;
  if (options.kv.element_bytes != kv_elem)
    throw std::invalid_argument("make_rank_forward: KV element size "
                                + std::to_string(options.kv.element_bytes)
                                + " does not match the compute dtype (" + std::to_string(kv_elem)
                                + " bytes)");
  return std::unique_ptr<rank_forward>(load_backend()->create(options));
}

std::string loaded_backend_path() {
  std::lock_guard<std::mutex> lock(backend_mutex);
  return backend_path;
}

} // namespace refit::inference
