// refit_checkpoint, model: config.json mapping (supported fields, refused features, unknown
// keys), weights onto the canonical key stream (both expert layouts give the same bytes,
// missing / extra / misshapen tensors refused, dtype conversion), and the HF-written
// fixtures under tests/data/models.
#include "checkpoint_files.hpp"
#include "runtime/checkpoint/convert.hpp"
#include "runtime/checkpoint/hf_config.hpp"
#include "runtime/checkpoint/index.hpp"
#include "runtime/checkpoint/weights.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

using namespace refit::checkpoint;
using namespace refit::testing;
namespace fs = std::filesystem;
namespace model = refit::model;
using json = nlohmann::json;

namespace {

// 2 layers, hidden 8, 2 heads / 1 KV head of 4, 2 experts (top-1) of 4, vocab 16.
json tiny_config(bool tied = false) {
  return json{{"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"},
              {"num_hidden_layers", 2}, {"hidden_size", 8}, {"num_attention_heads", 2},
              {"num_key_value_heads", 1}, {"head_dim", 4}, {"num_experts", 2},
              {"num_experts_per_tok", 1}, {"moe_intermediate_size", 4}, {"intermediate_size", 12},
              {"vocab_size", 16}, {"tie_word_embeddings", tied}, {"rms_norm_eps", 1e-6},
              {"rope_theta", 1000000.0}, {"rope_scaling", nullptr}, {"norm_topk_prob", true},
              {"torch_dtype", "bfloat16"}, {"hidden_act", "silu"}, {"attention_bias", false},
              {"use_sliding_window", false}, {"sliding_window", nullptr},
              {"mlp_only_layers", json::array()}, {"decoder_sparse_step", 1},
              {"max_position_embeddings", 512}, {"transformers_version", "4.51.3"},
              {"bos_token_id", 1}, {"eos_token_id", 2}, {"use_cache", true},
              {"initializer_range", 0.02}, {"output_router_logits", false},
              {"attention_dropout", 0.0}, {"router_aux_loss_coef", 0.001}};
}

// The canonical (per-expert) tensors of `cfg`, bf16, each with its own values.
std::vector<tensor_spec> per_expert_tensors(const model::model_config& cfg) {
  std::vector<tensor_spec> out;
  for (const auto& p : model::expected_key_stream(cfg))
    out.push_back({p.name, "BF16", p.shape, bf16_values(p.name, p.numel())});
  return out;
}

// The same weights with the experts of `layers` fused (transformers 5 layout).
std::vector<tensor_spec> fuse(const std::vector<tensor_spec>& in, const model::model_config& c,
                              const std::set<int>& layers) {
  std::map<std::string, std::string> bytes;
  for (const auto& t : in)
    bytes[t.name] = t.bytes;
  std::vector<tensor_spec> out;
  for (const auto& t : in) {
    bool fused_expert = false;
    for (int l : layers)
      if (t.name.rfind("model.layers." + std::to_string(l) + ".mlp.experts.", 0) == 0)
        fused_expert = true;
    if (!fused_expert)
      out.push_back(t);
    if (t.name.find(".mlp.gate.weight") == std::string::npos)
      continue;
    const std::string layer = t.name.substr(0, t.name.size() - std::string("mlp.gate.weight").size());
    if (!layers.count(std::stoi(layer.substr(std::string("model.layers.").size()))))
      continue;
    std::string gate_up, down;
    for (std::uint32_t e = 0; e < c.num_experts; ++e) {
      const std::string x = layer + "mlp.experts." + std::to_string(e) + ".";
      gate_up += bytes.at(x + "gate_proj.weight") + bytes.at(x + "up_proj.weight");
      down += bytes.at(x + "down_proj.weight");
    }
    const std::int64_t E = c.num_experts, I = c.moe_intermediate_size, H = c.hidden_size;
    out.push_back({layer + "mlp.experts.gate_up_proj", "BF16", {E, 2 * I, H}, gate_up});
    out.push_back({layer + "mlp.experts.down_proj", "BF16", {E, H, I}, down});
  }
  return out;
}

fs::path write_model(const std::string& name, const json& config,
                     const std::vector<tensor_spec>& tensors) {
  const auto dir = fresh_dir(name);
  write_file(dir / "config.json", config.dump(2));
  write_file(dir / "model.safetensors", make_safetensors(tensors, {{"format", "pt"}}));
  return dir;
}

model_weights load(const fs::path& dir, checkpoint_files& files) {
  files = checkpoint_files::open(dir.string());
  return model_weights(files, read_hf_config(dir.string()));
}

// Every canonical tensor's bytes, read through read_canonical in two pieces.
std::map<std::string, std::string> canonical_bytes(const model_weights& w) {
  std::map<std::string, std::string> out;
  for (const auto& p : w.key_stream()) {
    std::string b(p.nbytes(), '\0');
    const std::uint64_t half = p.numel() / 2;
    w.read_canonical(p, 0, half, reinterpret_cast<std::byte*>(b.data()));
    w.read_canonical(p, half, p.numel() - half,
                     reinterpret_cast<std::byte*>(b.data() + half * model::dtype_size(p.dt)));
    out[p.name] = b;
  }
  return out;
}

} // namespace

TEST(HfConfig, MapsQwen3Moe) {
  auto j = tiny_config();
  j["some_new_knob"] = 3;
  const auto m = parse_hf_config(j, "config.json");
  EXPECT_EQ(m.model_type, "qwen3_moe");
  EXPECT_EQ(m.cfg.num_hidden_layers, 2u);
  EXPECT_EQ(m.cfg.hidden_size, 8u);
  EXPECT_EQ(m.cfg.num_key_value_heads, 1u);
  EXPECT_EQ(m.cfg.head_dim, 4u);
  EXPECT_EQ(m.cfg.num_experts, 2u);
  EXPECT_EQ(m.cfg.moe_intermediate_size, 4u);
  EXPECT_EQ(m.cfg.vocab_size, 16u);
  EXPECT_DOUBLE_EQ(m.cfg.rope_theta, 1e6);
  EXPECT_TRUE(m.cfg.norm_topk_prob);
  EXPECT_EQ(m.cfg.torch_dtype, model::dtype::bfloat16);
  EXPECT_EQ(m.max_position_embeddings, 512u);
  ASSERT_EQ(m.warnings.size(), 1u);
  EXPECT_NE(m.warnings[0].find("some_new_knob"), std::string::npos);

  // Defaults and the transformers 5 spellings.
  j = tiny_config();
  j.erase("num_key_value_heads");
  j.erase("head_dim");
  j.erase("torch_dtype");
  j.erase("rope_theta");
  j["dtype"] = "float32";
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e5}};
  const auto d = parse_hf_config(j, "config.json");
  EXPECT_EQ(d.cfg.num_key_value_heads, 2u);
  EXPECT_EQ(d.cfg.head_dim, 4u);
  EXPECT_EQ(d.cfg.torch_dtype, model::dtype::float32);
  EXPECT_DOUBLE_EQ(d.cfg.rope_theta, 5e5);
  EXPECT_TRUE(d.warnings.empty());
}

TEST(HfConfig, MapsDenseQwen3IntoHfModel) {
  auto j = tiny_config(true);
  for (const char* k : {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step"})
    j.erase(k);
  j["model_type"] = "qwen3";
  const auto m = parse_hf_config(j, "config.json");
  EXPECT_TRUE(m.dense());
  EXPECT_EQ(m.intermediate_size, 12u);
  EXPECT_TRUE(m.cfg.tie_word_embeddings);
  // Held as one always-chosen expert of width intermediate_size (model::normalize_dense).
  EXPECT_EQ(m.cfg.num_experts, 1u);
  EXPECT_EQ(m.cfg.num_experts_per_tok, 1u);
  EXPECT_EQ(m.cfg.moe_intermediate_size, 12u);
  j.erase("intermediate_size");
  expect_refused([&] { parse_hf_config(j, "dense/config.json"); },
                 {"dense/config.json", "intermediate_size", "missing"});
}

TEST(HfConfig, RefusesUnsupportedFeaturesByFieldAndValue) {
  const std::vector<std::pair<json, std::vector<std::string>>> cases = {
    {{{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}}}, {"rope_scaling", "yarn"}},
    {{{"rope_parameters", {{"rope_type", "llama3"}, {"rope_theta", 1e6}}}}, {"rope_parameters.rope_type", "llama3"}},
    {{{"use_sliding_window", true}, {"sliding_window", 4096}}, {"use_sliding_window", "4096"}},
    {{{"attention_bias", true}}, {"attention_bias", "true"}},
    {{{"quantization_config", {{"quant_method", "fp8"}}}}, {"quantization_config", "fp8"}},
    {{{"mlp_only_layers", {0}}}, {"mlp_only_layers", "[0]"}},
    {{{"decoder_sparse_step", 2}}, {"decoder_sparse_step", "2"}},
    {{{"hidden_act", "gelu"}}, {"hidden_act", "gelu"}},
    {{{"model_type", "llama"}}, {"model_type", "llama"}},
    {{{"torch_dtype", "float8_e4m3fn"}}, {"torch_dtype", "float8_e4m3fn"}},
    {{{"dtype", "float16"}}, {"dtype", "float16", "bfloat16"}},
    {{{"layer_types", {"full_attention", "sliding_attention"}}}, {"layer_types[1]", "sliding_attention"}},
    {{{"num_experts", "8"}}, {"num_experts", "\"8\""}},
    {{{"hidden_size", 0}}, {"hidden_size", "> 0"}},
  };
  for (const auto& [patch, parts] : cases) {
    auto j = tiny_config();
    j.update(patch);
    SCOPED_TRACE(patch.dump());
    auto with_file = parts;
    with_file.push_back("m/config.json");
    expect_refused([&] { parse_hf_config(j, "m/config.json"); }, with_file);
  }
  auto j = tiny_config();
  j.erase("vocab_size");
  expect_refused([&] { parse_hf_config(j, "config.json"); }, {"vocab_size", "missing"});
  // The sliding window size is irrelevant while use_sliding_window is false.
  j = tiny_config();
  j["sliding_window"] = 4096;
  EXPECT_NO_THROW(parse_hf_config(j, "config.json"));
}

TEST(Weights, FusedAndPerExpertLayoutsGiveIdenticalCanonicalBytes) {
  const auto cfg = parse_hf_config(tiny_config(), "config.json").cfg;
  const auto tensors = per_expert_tensors(cfg);
  const auto per = write_model("per", tiny_config(), tensors);
  const auto fused = write_model("fused", tiny_config(), fuse(tensors, cfg, {0, 1}));
  const auto mixed = write_model("mixed", tiny_config(), fuse(tensors, cfg, {1}));
  checkpoint_files fp, ff, fm;
  const auto wp = load(per, fp);
  const auto wf = load(fused, ff);
  const auto wm = load(mixed, fm); // layers may differ in layout
  EXPECT_EQ(wp.fingerprint(), model::structural_manifest(model::expected_key_stream(cfg)));
  EXPECT_EQ(wf.fingerprint(), wp.fingerprint());
  const auto bp = canonical_bytes(wp);
  EXPECT_EQ(bp.size(), model::expected_key_stream(cfg).size());
  for (const auto& t : tensors)
    EXPECT_EQ(bp.at(t.name), t.bytes) << t.name;
  EXPECT_EQ(canonical_bytes(wf), bp);
  EXPECT_EQ(canonical_bytes(wm), bp);
  // Zero-copy: the fused up_proj of expert 1 points into gate_up_proj, rows [I, 2I) of [1].
  const auto& src = wf.source("model.layers.0.mlp.experts.1.up_proj.weight");
  EXPECT_EQ(src.source_name, "model.layers.0.mlp.experts.gate_up_proj");
  const tensor_view* gu = ff.find("model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_EQ(src.ranges.size(), 1u);
  EXPECT_EQ(src.ranges[0].data, gu->data + (2 * 4 * 8 + 4 * 8) * 2);
  EXPECT_EQ(src.ranges[0].file_offset, gu->file_offset + (2 * 4 * 8 + 4 * 8) * 2);
  // A piece in the middle.
  const auto p = wf.source("model.layers.1.mlp.experts.0.down_proj.weight").meta;
  std::string mid(5 * 2, '\0');
  wf.read_canonical(p, 7, 5, reinterpret_cast<std::byte*>(mid.data()));
  EXPECT_EQ(mid, bp.at(p.name).substr(14, 10));
  expect_refused([&] { wf.read_canonical(p, 30, 3, reinterpret_cast<std::byte*>(mid.data())); },
                 {p.name, "past the end"});
}

TEST(Weights, RefusesMissingExtraMisshapenAndMixedTensors) {
  const auto cfg = parse_hf_config(tiny_config(), "config.json").cfg;
  const auto tensors = per_expert_tensors(cfg);
  checkpoint_files f;
  const auto drop = [&](const std::string& name) {
    std::vector<tensor_spec> out;
    for (const auto& t : tensors)
      if (t.name != name)
        out.push_back(t);
    return out;
  };
  expect_refused([&] { load(write_model("noexp", tiny_config(), drop("model.layers.1.mlp.experts.1.up_proj.weight")), f); },
                 {"model.layers.1.mlp.experts.1.up_proj.weight", "missing"});
  auto fused = fuse(tensors, cfg, {0});
  fused.erase(std::remove_if(fused.begin(), fused.end(), [](const tensor_spec& t) {
    return t.name == "model.layers.0.mlp.experts.down_proj"; }), fused.end());
  expect_refused([&] { load(write_model("nofused", tiny_config(), fused), f); },
                 {"model.layers.0.mlp.experts.0.down_proj.weight", "needs model.layers.0.mlp.experts.down_proj"});

  auto extra = tensors;
  extra.push_back({"model.layers.0.mlp.shared_expert.weight", "BF16", {2}, bf16_values("x", 2)});
  expect_refused([&] { load(write_model("extra", tiny_config(), extra), f); },
                 {"model.safetensors", "model.layers.0.mlp.shared_expert.weight", "not part of the model"});

  auto bad = tensors;
  for (auto& t : bad)
    if (t.name == "model.layers.0.self_attn.k_proj.weight") {
      t.shape = {8, 4};
    }
  expect_refused([&] { load(write_model("shape", tiny_config(), bad), f); },
                 {"model.layers.0.self_attn.k_proj.weight", "expected [4, 8]", "got [8, 4]"});

  auto mixed = fuse(tensors, cfg, {0});
  mixed.push_back({"model.layers.0.mlp.experts.0.gate_proj.weight", "BF16", {4, 8}, bf16_values("g", 32)});
  expect_refused([&] { load(write_model("mixlayer", tiny_config(), mixed), f); },
                 {"layer 0 mixes the fused expert layout"});

  auto j = tiny_config();
  j["num_experts"] = 3; // the checkpoint has only 2
  expect_refused([&] { load(write_model("fewer", j, tensors), f); },
                 {"model.layers.0.mlp.gate.weight", "expected [3, 8]", "got [2, 8]"});
}

TEST(Weights, TiedHeadAndInvFreqAreIgnoredLikeHf) {
  const auto j = tiny_config(true);
  const auto cfg = parse_hf_config(j, "config.json").cfg;
  auto tensors = per_expert_tensors(cfg);
  tensors.push_back({"lm_head.weight", "BF16", {16, 8}, bf16_values("lm_head.weight", 128)});
  tensors.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", "F32", {2}, std::string(8, '\0')});
  checkpoint_files f;
  const auto w = load(write_model("tied", j, tensors), f);
  EXPECT_EQ(w.ignored(), (std::vector<std::string>{"lm_head.weight",
                                                   "model.layers.0.self_attn.rotary_emb.inv_freq"}));
  EXPECT_THROW(w.source("lm_head.weight"), checkpoint_error);
  // Untied, lm_head.weight is needed.
  auto untied = tiny_config(false);
  expect_refused([&] { load(write_model("untied", untied, per_expert_tensors(cfg)), f); },
                 {"lm_head.weight", "missing"});
}

TEST(Weights, ConvertsCheckpointDtypeToTheConfigDtype) {
  const auto cfg = parse_hf_config(tiny_config(), "config.json").cfg;
  const auto tensors = per_expert_tensors(cfg);
  // The same values stored as F32 (bf16 -> f32 is exact) must read back as the bf16 bytes.
  std::vector<tensor_spec> wide;
  for (const auto& t : tensors) {
    std::string f32(t.bytes.size() * 2, '\0');
    for (std::size_t i = 0; i < t.bytes.size() / 2; ++i) {
      std::uint16_t b;
      std::memcpy(&b, &t.bytes[2 * i], 2);
      const float v = model::bf16_to_float(b);
      std::memcpy(&f32[4 * i], &v, 4);
    }
    wide.push_back({t.name, "F32", t.shape, f32});
  }
  checkpoint_files f;
  const auto w = load(write_model("wide", tiny_config(), wide), f);
  EXPECT_EQ(w.tensors().front().source_dt, model::dtype::float32);
  EXPECT_EQ(w.tensors().front().meta.dt, model::dtype::bfloat16);
  const auto b = canonical_bytes(w);
  for (const auto& t : tensors)
    EXPECT_EQ(b.at(t.name), t.bytes) << t.name;
  // And an f32 config over the bf16 checkpoint widens exactly.
  auto j = tiny_config();
  j["torch_dtype"] = "float32";
  const auto w32 = load(write_model("widen", j, tensors), f);
  const auto b32 = canonical_bytes(w32);
  for (const auto& t : wide)
    EXPECT_EQ(b32.at(t.name), t.bytes) << t.name;
}

TEST(HfConfig, NumLocalExpertsIsNumExperts) {
  auto j = tiny_config();
  j.erase("num_experts");
  j["num_local_experts"] = 2;
  EXPECT_EQ(parse_hf_config(j, "config.json").cfg.num_experts, 2u);
  j["num_experts"] = 4;
  expect_refused([&] { parse_hf_config(j, "c/config.json"); },
                 {"c/config.json", "num_experts", "disagrees with num_local_experts 2"});
}

TEST(Convert, HalfEncodingsRoundToNearestEven) {
  const std::vector<std::pair<float, std::uint16_t>> cases = {
    {1.0f, 0x3c00}, {-2.0f, 0xc000}, {0.1f, 0x2e66}, {65504.0f, 0x7bff}, {65520.0f, 0x7c00},
    {std::ldexp(1.0f, -24), 0x0001}, {std::ldexp(1.0f, -25), 0x0000}, // tie to even (0)
    {std::ldexp(3.0f, -25), 0x0002}, {std::ldexp(1.0f, -14), 0x0400}, {0.0f, 0x0000},
    {1.0f + std::ldexp(1.0f, -11), 0x3c00}, // halfway between 1 and next: even (1.0)
    {1.0f + std::ldexp(3.0f, -11), 0x3c02}, {2047.5f, 0x6800}, // 2047.5 ties to 2048
  };
  for (const auto& [f, h] : cases) {
    std::uint16_t out = 0xffff;
    convert_elements(model::dtype::float32, reinterpret_cast<const std::byte*>(&f),
                     model::dtype::float16, reinterpret_cast<std::byte*>(&out), 1);
    EXPECT_EQ(out, h) << f;
  }
  // half -> float against the definition: (-1)^s * (1 + m/1024) * 2^(e-15), subnormals m * 2^-24.
  const auto decode = [](std::uint16_t h) {
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
    return (h & 0x8000) ? -v : v;
  };
  // Every finite half survives f16 -> f32 -> f16 and f16 -> bf16 -> ... -> f32 agrees.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00u) == 0x7c00u)
      continue; // inf / NaN
    const auto in = static_cast<std::uint16_t>(h);
    float f = 0;
    std::uint16_t again = 0;
    convert_elements(model::dtype::float16, reinterpret_cast<const std::byte*>(&in),
                     model::dtype::float32, reinterpret_cast<std::byte*>(&f), 1);
    convert_elements(model::dtype::float32, reinterpret_cast<const std::byte*>(&f),
                     model::dtype::float16, reinterpret_cast<std::byte*>(&again), 1);
    ASSERT_EQ(again, in) << std::hex << h;
    ASSERT_EQ(static_cast<double>(f), decode(in)) << std::hex << h;
  }
}
