// refit_checkpoint on the real HF-written fixtures (tests/data/models, transformers 5.17):
// config mapping, every tensor as layout.json (written by the fixture script) describes it,
// the canonical key stream, and byte-identical canonical tensors across expert layouts.
#include "checkpoint_files.hpp"
#include "runtime/checkpoint/hf_config.hpp"
#include "runtime/checkpoint/index.hpp"
#include "runtime/checkpoint/json_strict.hpp"
#include "runtime/checkpoint/weights.hpp"

#include <gtest/gtest.h>

#include <map>
#include <set>

using namespace refit::checkpoint;
using namespace refit::testing;
namespace model = refit::model;

namespace {

std::string models_dir() { return std::string(REFIT_SOURCE_DIR) + "/tests/data/models"; }
std::string fixture(const std::string& name) { return models_dir() + "/" + name; }

std::string view_bytes(const tensor_view& t) {
  return std::string(reinterpret_cast<const char*>(t.data), t.nbytes);
}

std::map<std::string, std::string> canonical_bytes(const model_weights& w) {
  std::map<std::string, std::string> out;
  for (const auto& p : w.key_stream()) {
    std::string b(p.nbytes(), '\0');
    w.read_canonical(p, 0, p.numel(), reinterpret_cast<std::byte*>(b.data()));
    out[p.name] = std::move(b);
  }
  return out;
}

// Every tensor of `name` matches layout.json (file, dtype, shape) and nothing is extra.
void expect_matches_layout(const std::string& name, const checkpoint_files& files) {
  const auto layout = read_json_file(models_dir() + "/layout.json", 8).at(name);
  EXPECT_EQ(files.tensors().size(), layout.size());
  for (const auto& item : layout.items()) {
    const tensor_view* t = files.find(item.key());
    ASSERT_NE(t, nullptr) << item.key();
    EXPECT_EQ(t->file, fixture(name) + "/" + item.value().at("file").get<std::string>());
    EXPECT_EQ(t->shape, item.value().at("shape").get<std::vector<std::int64_t>>()) << item.key();
    const std::string dt = item.value().at("dtype").get<std::string>();
    EXPECT_EQ(t->dt, dt == "BF16" ? model::dtype::bfloat16
                     : dt == "F16" ? model::dtype::float16 : model::dtype::float32);
  }
}

void expect_tiny_moe_config(const hf_model& m, model::dtype dt, bool norm_topk) {
  EXPECT_EQ(m.model_type, "qwen3_moe");
  EXPECT_EQ(m.cfg.num_hidden_layers, 3u);
  EXPECT_EQ(m.cfg.hidden_size, 64u);
  EXPECT_EQ(m.cfg.num_attention_heads, 8u);
  EXPECT_EQ(m.cfg.num_key_value_heads, 4u);
  EXPECT_EQ(m.cfg.head_dim, 16u);
  EXPECT_EQ(m.cfg.num_experts, 8u); // num_local_experts in transformers 5
  EXPECT_EQ(m.cfg.num_experts_per_tok, 2u);
  EXPECT_EQ(m.cfg.moe_intermediate_size, 32u);
  EXPECT_EQ(m.cfg.vocab_size, 2112u);
  EXPECT_FALSE(m.cfg.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(m.cfg.rope_theta, 1e6); // from rope_parameters
  EXPECT_DOUBLE_EQ(m.cfg.rms_norm_eps, 1e-6);
  EXPECT_EQ(m.cfg.norm_topk_prob, norm_topk);
  EXPECT_EQ(m.cfg.torch_dtype, dt);
  EXPECT_EQ(m.max_position_embeddings, 4096u);
  EXPECT_TRUE(m.dtype_declared);
  EXPECT_TRUE(m.warnings.empty()) << m.warnings.front();
  EXPECT_NO_THROW(model::validate(m.cfg, 2));
}

} // namespace

TEST(HfFixtures, TinyQwen3MoeLoadsOntoTheCanonicalKeyStream) {
  for (const std::string name : {"tiny-qwen3-moe", "tiny-qwen3-moe-per-expert"}) {
    SCOPED_TRACE(name);
    const auto m = read_hf_config(fixture(name));
    expect_tiny_moe_config(m, model::dtype::bfloat16, false);
    const auto files = checkpoint_files::open(fixture(name));
    expect_matches_layout(name, files);
    const model_weights w(files, m);
    EXPECT_EQ(w.key_stream(), model::expected_key_stream(m.cfg));
    EXPECT_EQ(w.fingerprint(), model::structural_manifest(model::expected_key_stream(m.cfg)));
    EXPECT_TRUE(w.ignored().empty());
    // transformers 5.17 saves per-expert keys: every canonical tensor is its own file tensor.
    for (const auto& [tname, bytes] : canonical_bytes(w))
      EXPECT_EQ(bytes, view_bytes(*files.find(tname))) << tname;
  }
}

TEST(HfFixtures, TinyQwen3MoeLayoutsGiveByteIdenticalCanonicalTensors) {
  const auto m = read_hf_config(fixture("tiny-qwen3-moe"));
  const auto fa = checkpoint_files::open(fixture("tiny-qwen3-moe"));
  const auto fb = checkpoint_files::open(fixture("tiny-qwen3-moe-per-expert"));
  const auto a = canonical_bytes(model_weights(fa, m));
  EXPECT_EQ(a, canonical_bytes(model_weights(fb, read_hf_config(fixture("tiny-qwen3-moe-per-expert")))));

  // Both fixtures hold per-expert keys, so fuse the real weights here (the transformers 5
  // in-memory layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]) and compare again.
  const std::int64_t E = 8, I = 32, H = 64;
  std::vector<tensor_spec> fused;
  for (const tensor_view* t : fa.tensors())
    if (t->name.find(".mlp.experts.") == std::string::npos)
      fused.push_back({t->name, "BF16", t->shape, view_bytes(*t)});
  for (int layer = 0; layer < 3; ++layer) {
    const std::string base = "model.layers." + std::to_string(layer) + ".mlp.experts.";
    std::string gate_up, down;
    for (int e = 0; e < E; ++e) {
      const std::string x = base + std::to_string(e) + ".";
      gate_up += view_bytes(*fa.find(x + "gate_proj.weight")) + view_bytes(*fa.find(x + "up_proj.weight"));
      down += view_bytes(*fa.find(x + "down_proj.weight"));
    }
    fused.push_back({base + "gate_up_proj", "BF16", {E, 2 * I, H}, gate_up});
    fused.push_back({base + "down_proj", "BF16", {E, H, I}, down});
  }
  const auto dir = fresh_dir("fixture-fused");
  write_file(dir / "model.safetensors", make_safetensors(fused));
  const auto ff = checkpoint_files::open(dir.string());
  const model_weights wf(ff, m);
  EXPECT_EQ(wf.source("model.layers.2.mlp.experts.7.up_proj.weight").source_name,
            "model.layers.2.mlp.experts.gate_up_proj");
  EXPECT_EQ(canonical_bytes(wf), a);
}

TEST(HfFixtures, TinyQwen3MoeTopkShardedF32) {
  const std::string name = "tiny-qwen3-moe-topk";
  const auto m = read_hf_config(fixture(name));
  expect_tiny_moe_config(m, model::dtype::float32, true);
  const auto files = checkpoint_files::open(fixture(name));
  EXPECT_EQ(files.files().size(), 3u);
  EXPECT_EQ(files.index_path(), fixture(name) + "/model.safetensors.index.json");
  expect_matches_layout(name, files);
  const model_weights w(files, m);
  EXPECT_EQ(w.key_stream(), model::expected_key_stream(m.cfg));
  for (const auto& [tname, bytes] : canonical_bytes(w))
    EXPECT_EQ(bytes, view_bytes(*files.find(tname))) << tname;
  // Read as bf16 (a config override), every element is the rounded f32 value.
  hf_model as_bf16 = m;
  as_bf16.cfg.torch_dtype = model::dtype::bfloat16;
  const model_weights wb(files, as_bf16);
  const auto& p = wb.source("model.embed_tokens.weight").meta;
  std::vector<std::uint16_t> out(p.numel());
  wb.read_canonical(p, 0, p.numel(), reinterpret_cast<std::byte*>(out.data()));
  const tensor_view* src = files.find("model.embed_tokens.weight");
  for (std::uint64_t i = 0; i < p.numel(); i += 97) {
    float f;
    std::memcpy(&f, src->data + 4 * i, 4);
    EXPECT_EQ(out[i], model::float_to_bf16(f)) << i;
  }
}

TEST(HfFixtures, TinyQwen3DenseMapsOntoTheDenseKeyStream) {
  const std::string name = "tiny-qwen3";
  const auto m = read_hf_config(fixture(name));
  EXPECT_TRUE(m.dense());
  EXPECT_EQ(m.intermediate_size, 128u);
  EXPECT_EQ(m.cfg.num_hidden_layers, 2u);
  EXPECT_EQ(m.cfg.hidden_size, 64u);
  EXPECT_EQ(m.cfg.num_attention_heads, 8u);
  EXPECT_EQ(m.cfg.num_key_value_heads, 4u);
  EXPECT_EQ(m.cfg.head_dim, 16u);
  EXPECT_EQ(m.cfg.vocab_size, 2112u);
  EXPECT_TRUE(m.cfg.tie_word_embeddings);
  EXPECT_EQ(m.cfg.torch_dtype, model::dtype::bfloat16);
  EXPECT_TRUE(m.warnings.empty()) << m.warnings.front();
  const auto files = checkpoint_files::open(fixture(name));
  expect_matches_layout(name, files);
  EXPECT_EQ(files.find("lm_head.weight"), nullptr); // tied: HF saves the embedding only
  // Held as one always-chosen expert of width intermediate_size.
  EXPECT_EQ(m.cfg.num_experts, 1u);
  EXPECT_EQ(m.cfg.moe_intermediate_size, 128u);
  const model_weights w(files, m);
  const auto& gate = w.source("model.layers.1.mlp.gate_proj.weight");
  EXPECT_EQ(gate.source_name, "model.layers.1.mlp.gate_proj.weight");
  EXPECT_EQ(gate.meta.shape, (std::vector<std::int64_t>{128, 64}));
  EXPECT_EQ(w.tensors().size(), model::expected_key_stream(m.cfg).size());
  EXPECT_THROW(w.source("model.layers.0.mlp.gate.weight"), checkpoint_error); // no router
}
