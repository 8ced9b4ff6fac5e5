// Tests of the Qwen3-MoE schema: dtypes, validation, key stream, manifest, TP layout and
// synthetic weights. Layout tests compare every resident element against an independent,
// straightforward index computation (reference_source below).
#include "model_configs.hpp"
#include "runtime/model/manifest.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

using namespace refit::model;

namespace {

model_config tiny_config() {
  return refit::testing::tiny_model();
}

using refit::testing::qwen3_30b_a3b;

// Runs `f`, expecting a model_error; returns it (an empty error after a recorded failure).
template <class F>
model_error catch_model_error(F&& f) {
  try {
    f();
  } catch (const model_error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a model_error";
  return model_error("", "");
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::uint64_t total_bytes(const std::vector<param_meta>& params) {
  std::uint64_t sum = 0;
  for (const auto& p : params)
    sum += p.nbytes();
  return sum;
}

std::vector<std::byte> fill_full(const param_meta& p, const synthetic_weights& w,
                                 std::uint64_t step) {
  std::vector<std::byte> bytes(p.nbytes());
  fill_synthetic(p, w, step, 0, p.numel(), bytes.data());
  return bytes;
}

// Raw bits of element `i` (2- or 4-byte dtypes).
std::uint32_t element_bits(const std::byte* data, dtype dt, std::uint64_t i) {
  if (dtype_size(dt) == 2) {
    std::uint16_t v;
    std::memcpy(&v, data + 2 * i, 2);
    return v;
  }
  std::uint32_t v;
  std::memcpy(&v, data + 4 * i, 4);
  return v;
}

// Straightforward binary16 decoder (independent of the library's).
double half_value(std::uint16_t h) {
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0)
    return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

float element_value(const std::byte* data, dtype dt, std::uint64_t i) {
  const std::uint32_t bits = element_bits(data, dt, i);
  switch (dt) {
    case dtype::bfloat16: return bf16_to_float(static_cast<std::uint16_t>(bits));
    case dtype::float16: return static_cast<float>(half_value(static_cast<std::uint16_t>(bits)));
    case dtype::float32: {
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
  }
  return 0;
}

// Where element `i` of resident `res` on `rank` comes from: canonical tensor name and its
// row-major element index; nullopt for a padding element (must be zero).
struct source {
  std::string name;
  std::uint64_t index;
};

std::optional<source> reference_source(const model_config& c, std::uint32_t tp,
                                        std::uint32_t rank, const std::string& res,
                                        std::uint64_t i) {
  const std::uint64_t H = c.hidden_size, D = c.head_dim, I = c.moe_intermediate_size;
  const std::uint64_t q_rows = c.num_attention_heads / tp * D;
  const std::uint64_t kv_per_rank = std::max<std::uint64_t>(1, c.num_key_value_heads / tp);
  const std::uint64_t kv_rows = kv_per_rank * D;
  const std::uint64_t kv_head0 = tp <= c.num_key_value_heads
                                   ? rank * kv_per_rank
                                   : std::uint64_t{rank} * c.num_key_value_heads / tp;
  const std::uint64_t I_rank = I / tp;

  if (res == "model.embed_tokens.weight" || res == "lm_head.weight") {
    const std::uint64_t per_rank = (c.vocab_size + tp - 1) / tp;
    const std::uint64_t vocab_row = rank * per_rank + i / H;
    if (vocab_row >= c.vocab_size)
      return std::nullopt;
    return source{res, vocab_row * H + i % H};
  }
  if (res == "model.norm.weight")
    return source{res, i};

  const std::string prefix = "model.layers.";
  const auto dot = res.find('.', prefix.size());
  const std::string layer = res.substr(0, dot + 1); // "model.layers.{l}."
  const std::string suffix = res.substr(dot + 1);
  if (suffix == "self_attn.qkv_proj.weight") {
    const std::uint64_t row = i / H, col = i % H;
    if (row < q_rows)
      return source{layer + "self_attn.q_proj.weight", (rank * q_rows + row) * H + col};
    if (row < q_rows + kv_rows)
      return source{layer + "self_attn.k_proj.weight", (kv_head0 * D + row - q_rows) * H + col};
    return source{layer + "self_attn.v_proj.weight",
                  (kv_head0 * D + row - q_rows - kv_rows) * H + col};
  }
  if (suffix == "self_attn.o_proj.weight") {
    const std::uint64_t h = i / q_rows, col = i % q_rows;
    return source{res, h * (c.num_attention_heads * D) + rank * q_rows + col};
  }
  if (suffix == "mlp.experts.w13_weight") {
    const std::uint64_t e = i / (2 * I_rank * H), row = i / H % (2 * I_rank), col = i % H;
    const std::string expert = layer + "mlp.experts." + std::to_string(e) + ".";
    if (row < I_rank)
      return source{expert + "gate_proj.weight", (rank * I_rank + row) * H + col};
    return source{expert + "up_proj.weight", (rank * I_rank + row - I_rank) * H + col};
  }
  if (suffix == "mlp.experts.w2_weight") {
    const std::uint64_t e = i / (H * I_rank), h = i / I_rank % H, col = i % I_rank;
    return source{layer + "mlp.experts." + std::to_string(e) + ".down_proj.weight",
                  h * I + rank * I_rank + col};
  }
  return source{res, i}; // replicated: q/k norms, router, layer norms
}

// Canonical tensors of a config (synthetic), and every rank's residents after scattering.
struct scattered_model {
  std::map<std::string, std::vector<std::byte>> canonical;
  std::vector<std::vector<std::vector<std::byte>>> residents; // [rank][resident]
};

scattered_model scatter_all(const model_config& c, const tp_layout& layout,
                            const synthetic_weights& w, std::uint64_t step) {
  scattered_model m;
  m.residents.resize(layout.tp());
  for (auto& rank_residents : m.residents)
    for (const auto& spec : layout.residents())
      rank_residents.emplace_back(spec.nbytes, std::byte{0}); // runtime allocates zeroed
  for (const auto& p : expected_key_stream(c)) {
    auto bytes = fill_full(p, w, step);
    for (std::uint32_t rank = 0; rank < layout.tp(); ++rank) {
      std::vector<std::byte*> ptrs;
      for (auto& r : m.residents[rank])
        ptrs.push_back(r.data());
      layout.scatter(p, bytes.data(), rank, ptrs);
    }
    m.canonical.emplace(p.name, std::move(bytes));
  }
  return m;
}

// --------------------------------------------------------------------------------------
// dtypes and bf16
// --------------------------------------------------------------------------------------

TEST(Dtype, SizesNamesAndParsing) {
  EXPECT_EQ(dtype_size(dtype::bfloat16), 2u);
  EXPECT_EQ(dtype_size(dtype::float16), 2u);
  EXPECT_EQ(dtype_size(dtype::float32), 4u);
  EXPECT_STREQ(dtype_name(dtype::bfloat16), "bfloat16");
  EXPECT_STREQ(dtype_name(dtype::float16), "float16");
  EXPECT_STREQ(dtype_name(dtype::float32), "float32");
  for (auto text : {"bfloat16", "bf16"})
    EXPECT_EQ(parse_dtype(text, "x"), dtype::bfloat16) << text;
  for (auto text : {"float16", "fp16", "half"})
    EXPECT_EQ(parse_dtype(text, "x"), dtype::float16) << text;
  for (auto text : {"float32", "fp32", "float"})
    EXPECT_EQ(parse_dtype(text, "x"), dtype::float32) << text;
}

TEST(Dtype, ParseRejectsUnknownNamingWhere) {
  auto e = catch_model_error([] { parse_dtype("int8", "model.torch_dtype"); });
  EXPECT_EQ(e.where, "model.torch_dtype");
  EXPECT_TRUE(contains(e.what(), "model.torch_dtype: "));
  EXPECT_TRUE(contains(e.what(), "'int8'"));
  EXPECT_THROW(parse_dtype("BF16", "x"), model_error); // case-sensitive
  EXPECT_THROW(parse_dtype("", "x"), model_error);
}

TEST(Bf16, EveryNonNanBf16RoundTripsExactly) {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const float f = bf16_to_float(bits);
    if (std::isnan(f))
      EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f)))) << b;
    else
      ASSERT_EQ(float_to_bf16(f), bits) << b;
  }
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(bf16_to_float(0x3fc0), 1.5f);
}

TEST(Bf16, RoundsToNearestEven) {
  // bf16 has 7 mantissa bits: spacing at 1.0 is 2^-7.
  const float ulp = std::ldexp(1.0f, -7);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + ulp / 2)), 1.0f);            // tie -> even (down)
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 3 * ulp / 2)), 1.0f + 2 * ulp); // tie -> even (up)
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + ulp / 2 + std::ldexp(1.0f, -20))), 1.0f + ulp);
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + ulp / 2 - std::ldexp(1.0f, -20))), 1.0f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(-(1.0f + 3 * ulp / 2))), -(1.0f + 2 * ulp));
  // Mantissa carry into the exponent, and overflow of the largest finite float to inf.
  EXPECT_EQ(float_to_bf16(std::nextafter(2.0f, 0.0f)), 0x4000);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(Bf16, NanStaysNanAndInfinityStaysInfinity) {
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  // A NaN whose payload lives only in the low 16 bits must not truncate/round to inf.
  for (std::uint32_t bits : {0x7f800001u, 0x7f80ffffu, 0xff800001u, 0x7fffffffu}) {
    float f;
    std::memcpy(&f, &bits, 4);
    EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(f)))) << std::hex << bits;
  }
}

// --------------------------------------------------------------------------------------
// Validation
// --------------------------------------------------------------------------------------

TEST(Validate, AcceptsSupportedShapes) {
  for (std::uint32_t tp : {1u, 2u, 4u})
    EXPECT_NO_THROW(validate(tiny_config(), tp)) << tp;
  for (std::uint32_t tp : {1u, 2u, 4u, 8u})
    EXPECT_NO_THROW(validate(qwen3_30b_a3b(), tp)) << tp;
}

TEST(Validate, RejectsOtherModelTypes) {
  auto c = tiny_config();
  c.model_type = "llama";
  auto e = catch_model_error([&] { validate(c, 1); });
  EXPECT_EQ(e.where, "model.model_type");
  EXPECT_TRUE(contains(e.what(), "'llama'"));
  EXPECT_TRUE(contains(e.what(), "qwen3_moe"));
}

TEST(Validate, RejectsQuantizationAndLora) {
  auto c = tiny_config();
  c.quantization = "fp8";
  auto e = catch_model_error([&] { validate(c, 1); });
  EXPECT_EQ(e.where, "model.quantization");
  EXPECT_TRUE(contains(e.what(), "quantized weights are not supported"));
  EXPECT_TRUE(contains(e.what(), "fp8"));

  c = tiny_config();
  c.lora = true;
  e = catch_model_error([&] { validate(c, 1); });
  EXPECT_EQ(e.where, "model.lora");
  EXPECT_TRUE(contains(e.what(), "LoRA is not supported"));
}

TEST(Validate, RejectsEachZeroSize) {
  const std::pair<const char*, std::uint32_t model_config::*> fields[] = {
    {"num_hidden_layers", &model_config::num_hidden_layers},
    {"hidden_size", &model_config::hidden_size},
    {"num_attention_heads", &model_config::num_attention_heads},
    {"num_key_value_heads", &model_config::num_key_value_heads},
    {"head_dim", &model_config::head_dim},
    {"num_experts", &model_config::num_experts},
    {"num_experts_per_tok", &model_config::num_experts_per_tok},
    {"moe_intermediate_size", &model_config::moe_intermediate_size},
    {"vocab_size", &model_config::vocab_size},
  };
  for (const auto& [key, field] : fields) {
    auto c = tiny_config();
    c.*field = 0;
    auto e = catch_model_error([&] { validate(c, 1); });
    EXPECT_EQ(e.where, std::string("model.") + key);
    EXPECT_TRUE(contains(e.what(), std::string(key) + " must be > 0 (got 0)")) << e.what();
  }
}

TEST(Validate, RejectsTopKAboveExperts) {
  auto c = tiny_config();
  c.num_experts_per_tok = 5;
  auto e = catch_model_error([&] { validate(c, 1); });
  EXPECT_EQ(e.where, "model.num_experts_per_tok");
  EXPECT_TRUE(contains(e.what(), "num_experts_per_tok=5 exceeds num_experts=4")) << e.what();
  c.num_experts_per_tok = 4; // equal is fine
  EXPECT_NO_THROW(validate(c, 1));
}

TEST(Validate, RejectsHeadsNotDivisibleByKvHeads) {
  auto c = tiny_config();
  c.num_key_value_heads = 3;
  auto e = catch_model_error([&] { validate(c, 1); });
  EXPECT_EQ(e.where, "model.num_key_value_heads");
  EXPECT_TRUE(contains(e.what(), "4 attention heads are not divisible by 3 key-value heads"))
    << e.what();
}

TEST(Validate, RejectsTpZero) {
  auto e = catch_model_error([] { validate(tiny_config(), 0); });
  EXPECT_EQ(e.where, "runtime.tp_size");
  EXPECT_TRUE(contains(e.what(), "tp must be >= 1 (got 0)"));
}

TEST(Validate, RejectsHeadsNotDivisibleByTp) {
  auto e = catch_model_error([] { validate(qwen3_30b_a3b(), 3); });
  EXPECT_EQ(e.where, "model.num_attention_heads");
  EXPECT_TRUE(contains(e.what(), "32 attention heads are not divisible by tp=3")) << e.what();
}

TEST(Validate, RejectsIntermediateNotDivisibleByTp) {
  auto c = tiny_config();
  c.moe_intermediate_size = 30;
  auto e = catch_model_error([&] { validate(c, 4); });
  EXPECT_EQ(e.where, "model.moe_intermediate_size");
  EXPECT_TRUE(contains(e.what(), "moe_intermediate_size 30 is not divisible by tp=4"))
    << e.what();
}

TEST(Validate, RejectsKvHeadsAndTpNotDividingEachOther) {
  auto c = tiny_config();
  c.num_attention_heads = 12;
  c.num_key_value_heads = 4;
  c.moe_intermediate_size = 48;
  auto e = catch_model_error([&] { validate(c, 6); });
  EXPECT_EQ(e.where, "model.num_key_value_heads");
  EXPECT_TRUE(contains(e.what(), "4 key-value heads and tp=6")) << e.what();
  EXPECT_NO_THROW(validate(c, 2));  // kv % tp == 0
  EXPECT_NO_THROW(validate(c, 12)); // tp % kv == 0 (replicated kv heads)
}

TEST(Validate, LayoutConstructorValidates) {
  auto e = catch_model_error([] { tp_layout(qwen3_30b_a3b(), 3); });
  EXPECT_EQ(e.where, "model.num_attention_heads");
}

// --------------------------------------------------------------------------------------
// Key stream
// --------------------------------------------------------------------------------------

TEST(KeyStream, TinyNamesShapesAndOrder) {
  const auto stream = expected_key_stream(tiny_config());
  using shape = std::vector<std::int64_t>;
  const std::vector<std::pair<std::string, shape>> layer0 = {
    {"model.layers.0.self_attn.q_proj.weight", {64, 64}},
    {"model.layers.0.self_attn.k_proj.weight", {32, 64}},
    {"model.layers.0.self_attn.v_proj.weight", {32, 64}},
    {"model.layers.0.self_attn.o_proj.weight", {64, 64}},
    {"model.layers.0.self_attn.q_norm.weight", {16}},
    {"model.layers.0.self_attn.k_norm.weight", {16}},
    {"model.layers.0.mlp.gate.weight", {4, 64}},
    {"model.layers.0.mlp.experts.0.gate_proj.weight", {32, 64}},
    {"model.layers.0.mlp.experts.0.up_proj.weight", {32, 64}},
    {"model.layers.0.mlp.experts.0.down_proj.weight", {64, 32}},
    {"model.layers.0.mlp.experts.1.gate_proj.weight", {32, 64}},
    {"model.layers.0.mlp.experts.1.up_proj.weight", {32, 64}},
    {"model.layers.0.mlp.experts.1.down_proj.weight", {64, 32}},
    {"model.layers.0.mlp.experts.2.gate_proj.weight", {32, 64}},
    {"model.layers.0.mlp.experts.2.up_proj.weight", {32, 64}},
    {"model.layers.0.mlp.experts.2.down_proj.weight", {64, 32}},
    {"model.layers.0.mlp.experts.3.gate_proj.weight", {32, 64}},
    {"model.layers.0.mlp.experts.3.up_proj.weight", {32, 64}},
    {"model.layers.0.mlp.experts.3.down_proj.weight", {64, 32}},
    {"model.layers.0.input_layernorm.weight", {64}},
    {"model.layers.0.post_attention_layernorm.weight", {64}},
  };
  ASSERT_EQ(stream.size(), 1 + 2 * layer0.size() + 2);
  EXPECT_EQ(stream[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(stream[0].shape, (shape{256, 64}));
  for (std::size_t layer = 0; layer < 2; ++layer) {
    for (std::size_t k = 0; k < layer0.size(); ++k) {
      std::string name = layer0[k].first;
      name.replace(13, 1, std::to_string(layer)); // "model.layers.0" -> "model.layers.{layer}"
      const auto& p = stream[1 + layer * layer0.size() + k];
      EXPECT_EQ(p.name, name);
      EXPECT_EQ(p.shape, layer0[k].second) << name;
      EXPECT_EQ(p.dt, dtype::bfloat16) << name;
    }
  }
  EXPECT_EQ(stream[stream.size() - 2].name, "model.norm.weight");
  EXPECT_EQ(stream[stream.size() - 2].shape, (shape{64}));
  EXPECT_EQ(stream.back().name, "lm_head.weight");
  EXPECT_EQ(stream.back().shape, (shape{256, 64}));
  EXPECT_EQ(stream[1].numel(), 64u * 64u);
  EXPECT_EQ(stream[1].nbytes(), 64u * 64u * 2u);
}

TEST(KeyStream, TiedEmbeddingsOmitLmHeadAndDtypeFollowsConfig) {
  auto c = tiny_config();
  c.tie_word_embeddings = true;
  c.torch_dtype = dtype::float32;
  const auto stream = expected_key_stream(c);
  ASSERT_EQ(stream.size(), 44u);
  EXPECT_EQ(stream.back().name, "model.norm.weight");
  for (const auto& p : stream) {
    EXPECT_NE(p.name, "lm_head.weight");
    EXPECT_EQ(p.dt, dtype::float32) << p.name;
  }
}

TEST(KeyStream, Qwen3_30B_A3B_CountsAndBytes) {
  const auto c = qwen3_30b_a3b();
  const auto stream = expected_key_stream(c);
  EXPECT_EQ(stream.size(), 18867u);

  const std::uint64_t V = 151936, H = 2048, L = 48, Q = 32 * 128, KV = 4 * 128, D = 128,
                      E = 128, I = 768;
  const std::uint64_t per_layer = 2 * Q * H + 2 * KV * H + 2 * D + E * H + E * 3 * I * H + 2 * H;
  const std::uint64_t expected_bytes = 2 * (2 * V * H + L * per_layer + H);
  EXPECT_EQ(total_bytes(stream), expected_bytes);
  EXPECT_EQ(expected_bytes, 61064245248u);
  EXPECT_GT(expected_bytes, 60'000'000'000u);
  EXPECT_LT(expected_bytes, 62'000'000'000u);

  // The largest tensors are embed_tokens and lm_head (~622 MB each).
  std::uint64_t largest = 0;
  for (const auto& p : stream)
    largest = std::max(largest, p.nbytes());
  EXPECT_EQ(largest, V * H * 2);
  EXPECT_EQ(stream.front().nbytes(), largest);
  EXPECT_EQ(stream.back().nbytes(), largest);
  EXPECT_EQ(stream[1 + 7 + 3 * 127 + 2].name, "model.layers.0.mlp.experts.127.down_proj.weight");
}

TEST(KeyStream, RejectsInvalidConfig) {
  auto c = tiny_config();
  c.hidden_size = 0;
  EXPECT_EQ(catch_model_error([&] { expected_key_stream(c); }).where, "model.hidden_size");
}

// --------------------------------------------------------------------------------------
// Structural manifest
// --------------------------------------------------------------------------------------

TEST(Manifest, DeterministicLowercaseHexSha256) {
  const auto stream = expected_key_stream(tiny_config());
  const auto m = structural_manifest(stream);
  ASSERT_EQ(m.size(), 64u);
  EXPECT_TRUE(std::all_of(m.begin(), m.end(), [](char ch) {
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f');
  })) << m;
  EXPECT_EQ(structural_manifest(expected_key_stream(tiny_config())), m);
  EXPECT_NE(structural_manifest({}), m);
  EXPECT_EQ(structural_manifest({}).size(), 64u);
}

// Known answers from Python's hashlib over the documented encoding (tag, count, then per entry
// name, rank, dims, dtype name, numel, nbytes; strings length-prefixed, integers u64 LE).
TEST(Manifest, MatchesAnIndependentSha256OfTheEncoding) {
  EXPECT_EQ(structural_manifest({}),
            "92c024a86686be894a103ce8c53fc133f41d0782e5926101290251433dfbba5b");
  param_meta w;
  w.name = "w";
  w.shape = {2, 3};
  w.dt = dtype::bfloat16;
  EXPECT_EQ(structural_manifest({w}),
            "7167755c67b236f24e6df8ca4d367af685dc7e2f9cd7e1d6771d5b07dec5aa6b");
}

TEST(Manifest, StreamedChunkByChunkEqualsTheWholeStream) {
  const auto stream = expected_key_stream(tiny_config());
  manifest_stream streamed(stream.size());
  for (const auto& p : stream)
    streamed.add(p);
  EXPECT_EQ(streamed.count(), stream.size());
  EXPECT_EQ(streamed.finish(), std::optional<std::string>(structural_manifest(stream)));
  EXPECT_THROW(streamed.finish(), model_error); // once only
  EXPECT_THROW(streamed.add(stream.front()), model_error);

  // Fewer (or more) tensors than announced: no fingerprint, the caller hashes what it has.
  manifest_stream short_stream(stream.size());
  for (std::size_t i = 0; i + 1 < stream.size(); ++i)
    short_stream.add(stream[i]);
  EXPECT_EQ(short_stream.finish(), std::nullopt);
  manifest_stream long_stream(2);
  for (const auto& p : stream)
    long_stream.add(p);
  EXPECT_EQ(long_stream.finish(), std::nullopt);
}

TEST(Manifest, SensitiveToDropReorderReshapeAndDtype) {
  const auto stream = expected_key_stream(tiny_config());
  const auto base = structural_manifest(stream);

  auto dropped = stream;
  dropped.erase(dropped.begin() + 10);
  EXPECT_NE(structural_manifest(dropped), base);

  auto reordered = stream;
  std::swap(reordered[2], reordered[3]); // k_proj and v_proj: same shape and dtype
  EXPECT_NE(structural_manifest(reordered), base);

  auto reshaped = stream;
  reshaped[1].shape = {32, 128}; // same numel and nbytes
  EXPECT_NE(structural_manifest(reshaped), base);

  auto flattened = stream;
  flattened[1].shape = {64 * 64};
  EXPECT_NE(structural_manifest(flattened), base);

  auto retyped = stream;
  retyped[5].dt = dtype::float16; // same element size
  EXPECT_NE(structural_manifest(retyped), base);

  auto renamed = stream;
  renamed[0].name += "x";
  EXPECT_NE(structural_manifest(renamed), base);
}

TEST(Manifest, FieldBoundariesAreUnambiguous) {
  // Moving characters between adjacent names must change the digest.
  const std::vector<param_meta> a = {{"ab", {1}, dtype::float32}, {"c", {1}, dtype::float32}};
  const std::vector<param_meta> b = {{"a", {1}, dtype::float32}, {"bc", {1}, dtype::float32}};
  EXPECT_NE(structural_manifest(a), structural_manifest(b));
  const std::vector<param_meta> c = {{"a", {2, 3}, dtype::float32}};
  const std::vector<param_meta> d = {{"a", {3, 2}, dtype::float32}};
  EXPECT_NE(structural_manifest(c), structural_manifest(d));
}

// --------------------------------------------------------------------------------------
// TP layout
// --------------------------------------------------------------------------------------

model_config padded_config() {
  auto c = tiny_config();
  c.vocab_size = 250; // not divisible by 4: exercises vocab padding
  return c;
}

TEST(Layout, ResidentNamesAndOrder) {
  const tp_layout layout(tiny_config(), 2);
  const auto& res = layout.residents();
  ASSERT_EQ(res.size(), 1u + 2 * 9 + 2);
  const char* per_layer[] = {
    "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",   "mlp.gate.weight",         "mlp.experts.w13_weight",
    "mlp.experts.w2_weight",     "input_layernorm.weight",  "post_attention_layernorm.weight",
  };
  EXPECT_EQ(res[0].name, "model.embed_tokens.weight");
  for (std::size_t layer = 0; layer < 2; ++layer)
    for (std::size_t k = 0; k < 9; ++k)
      EXPECT_EQ(res[1 + layer * 9 + k].name,
                "model.layers." + std::to_string(layer) + "." + per_layer[k]);
  EXPECT_EQ(res[19].name, "model.norm.weight");
  EXPECT_EQ(res[20].name, "lm_head.weight");
  for (std::size_t i = 0; i < res.size(); ++i)
    EXPECT_EQ(layout.resident_index(res[i].name), i);
}

TEST(Layout, ResidentShapesForTp4WithKvReplicationAndPadding) {
  const tp_layout layout(padded_config(), 4);
  using shape = std::vector<std::int64_t>;
  std::map<std::string, shape> expected = {
    {"model.embed_tokens.weight", {63, 64}}, // ceil(250/4) = 63 rows
    {"model.layers.1.self_attn.qkv_proj.weight", {(1 + 2 * 1) * 16, 64}},
    {"model.layers.1.self_attn.o_proj.weight", {64, 16}},
    {"model.layers.1.self_attn.q_norm.weight", {16}},
    {"model.layers.1.mlp.gate.weight", {4, 64}},
    {"model.layers.1.mlp.experts.w13_weight", {4, 16, 64}},
    {"model.layers.1.mlp.experts.w2_weight", {4, 64, 8}},
    {"model.layers.1.input_layernorm.weight", {64}},
    {"model.norm.weight", {64}},
    {"lm_head.weight", {63, 64}},
  };
  std::uint64_t sum = 0;
  for (const auto& r : layout.residents()) {
    EXPECT_EQ(r.dt, dtype::bfloat16);
    EXPECT_EQ(r.nbytes, (param_meta{r.name, r.shape, r.dt}.nbytes())) << r.name;
    sum += r.nbytes;
  }
  EXPECT_EQ(layout.resident_bytes(), sum);
  for (const auto& [name, s] : expected)
    EXPECT_EQ(layout.residents()[layout.resident_index(name)].shape, s) << name;
  // tp=2: one kv head per rank, no replication.
  const tp_layout tp2(padded_config(), 2);
  EXPECT_EQ(tp2.residents()[tp2.resident_index("model.layers.0.self_attn.qkv_proj.weight")].shape,
            (shape{(2 + 2) * 16, 64}));
  EXPECT_EQ(tp2.residents()[0].shape, (shape{125, 64}));
}

TEST(Layout, Tp1ResidentBytesEqualCanonicalTotal) {
  for (bool tied : {false, true}) {
    auto c = qwen3_30b_a3b();
    c.tie_word_embeddings = tied;
    const tp_layout layout(c, 1);
    EXPECT_EQ(layout.resident_bytes(), total_bytes(expected_key_stream(c))) << tied;
    EXPECT_EQ(layout.residents().size(), 1u + 48 * 9 + (tied ? 1 : 2));
  }
  const tp_layout tiny(tiny_config(), 1);
  EXPECT_EQ(tiny.resident_bytes(), total_bytes(expected_key_stream(tiny_config())));
}

TEST(Layout, TiedEmbeddingsHaveNoLmHeadResident) {
  auto c = tiny_config();
  c.tie_word_embeddings = true;
  const tp_layout layout(c, 2);
  EXPECT_EQ(layout.residents().back().name, "model.norm.weight");
  auto e = catch_model_error([&] { layout.resident_index("lm_head.weight"); });
  EXPECT_EQ(e.where, "lm_head.weight");
  const param_meta lm_head{"lm_head.weight", {256, 64}, dtype::bfloat16};
  EXPECT_EQ(catch_model_error([&] { layout.place(lm_head, 0); }).where, "lm_head.weight");
}

TEST(Layout, PlaceRejectsUnknownNamesMismatchesAndBadRank) {
  const tp_layout layout(tiny_config(), 2);
  const auto stream = expected_key_stream(tiny_config());
  auto check = [&](const param_meta& p, std::uint32_t rank, const std::string& text) {
    auto e = catch_model_error([&] { layout.place(p, rank); });
    EXPECT_EQ(e.where, p.name);
    EXPECT_TRUE(contains(e.what(), text)) << e.what();
  };
  const std::string not_part = "not a tensor of this qwen3_moe model";
  for (const char* name :
       {"model.layers.2.self_attn.q_proj.weight",         // layer out of range
        "model.layers.01.self_attn.q_proj.weight",        // leading zero
        "model.layers.0.mlp.experts.4.up_proj.weight",    // expert out of range
        "model.layers.0.mlp.experts.0.up_proj.bias",      // unknown leaf
        "model.layers.0.self_attn.qkv_proj.weight",       // a resident, not canonical
        "model.layers..self_attn.q_proj.weight", "model.embed_tokens", "lm_head.weight.x", ""})
    check(param_meta{name, {64, 64}, dtype::bfloat16}, 0, not_part);

  auto reshaped = stream[1];
  reshaped.shape = {32, 128};
  check(reshaped, 0, "shape [32, 128] bfloat16 does not match the planned [64, 64] bfloat16");
  auto retyped = stream[1];
  retyped.dt = dtype::float32;
  check(retyped, 1, "shape [64, 64] float32 does not match the planned [64, 64] bfloat16");
  check(stream[1], 2, "rank 2 is out of range for tp=2");
}

TEST(Layout, PlacementsAreMergedStridedCopies) {
  const auto c = padded_config();
  const std::uint64_t es = 2;
  const param_meta o_proj{"model.layers.1.self_attn.o_proj.weight", {64, 64}, dtype::bfloat16};
  const tp_layout tp2(c, 2);
  auto pl = tp2.place(o_proj, 1);
  ASSERT_EQ(pl.size(), 1u);
  EXPECT_EQ(pl[0].resident_index, tp2.resident_index(o_proj.name));
  EXPECT_EQ(pl[0].rows, 64u);           // one row per hidden row
  EXPECT_EQ(pl[0].row_bytes, 32 * es);  // this rank's 2 heads * 16
  EXPECT_EQ(pl[0].src_offset, 32 * es);
  EXPECT_EQ(pl[0].src_stride, 64 * es);
  EXPECT_EQ(pl[0].dst_offset, 0u);
  EXPECT_EQ(pl[0].dst_stride, 32 * es);

  const tp_layout tp1(c, 1);
  pl = tp1.place(o_proj, 0); // whole tensor: contiguous, merged into one row
  ASSERT_EQ(pl.size(), 1u);
  EXPECT_EQ(pl[0].rows * pl[0].row_bytes, o_proj.nbytes());
  EXPECT_EQ(pl[0].rows, 1u);

  const tp_layout tp4(c, 4);
  const param_meta embed{"model.embed_tokens.weight", {250, 64}, dtype::bfloat16};
  pl = tp4.place(embed, 3); // rows 189..249 real, 250..251 padding
  ASSERT_EQ(pl.size(), 1u);
  EXPECT_EQ(pl[0].src_offset, 189 * 64 * es);
  EXPECT_EQ(pl[0].rows * pl[0].row_bytes, 61 * 64 * es);
  EXPECT_EQ(pl[0].dst_offset, 0u);

  const param_meta up{"model.layers.0.mlp.experts.2.up_proj.weight", {32, 64}, dtype::bfloat16};
  pl = tp4.place(up, 1); // gate/up rows 8..15 -> w13[2][8..15]
  ASSERT_EQ(pl.size(), 1u);
  EXPECT_EQ(pl[0].src_offset, 8 * 64 * es);
  EXPECT_EQ(pl[0].dst_offset, (2 * 16 + 8) * 64 * es);
  EXPECT_EQ(pl[0].rows * pl[0].row_bytes, 8 * 64 * es);
}

TEST(Layout, RankWithOnlyPaddingRowsGetsNoEmbeddingPlacement) {
  auto c = tiny_config();
  c.vocab_size = 9; // padded to 12: ranks hold rows 0-2, 3-5, 6-8 and 9-11 (padding only)
  const tp_layout layout(c, 4);
  const param_meta embed{"model.embed_tokens.weight", {9, 64}, dtype::bfloat16};
  EXPECT_TRUE(layout.place(embed, 3).empty());
  auto pl = layout.place(embed, 2);
  ASSERT_EQ(pl.size(), 1u);
  EXPECT_EQ(pl[0].src_offset, 6 * 64 * 2u);
  EXPECT_EQ(pl[0].rows * pl[0].row_bytes, 3 * 64 * 2u);
}

TEST(Layout, Qwen3_30B_A3B_PlacementsCoverResidentsExactly) {
  const auto c = qwen3_30b_a3b();
  const auto stream = expected_key_stream(c);
  for (std::uint32_t tp : {1u, 8u}) { // tp=8 > 4 kv heads: replicated kv
    const tp_layout layout(c, tp);
    for (std::uint32_t rank : {0u, tp - 1}) {
      std::uint64_t placed = 0;
      for (const auto& p : stream) {
        const auto pl = layout.place(p, rank);
        ASSERT_EQ(pl.size(), 1u) << p.name; // at most one (strided) copy per tensor
        const auto& x = pl[0];
        const auto& res = layout.residents()[x.resident_index];
        ASSERT_LE(x.src_offset + (x.rows - 1) * x.src_stride + x.row_bytes, p.nbytes()) << p.name;
        ASSERT_LE(x.dst_offset + (x.rows - 1) * x.dst_stride + x.row_bytes, res.nbytes) << p.name;
        placed += x.rows * x.row_bytes;
      }
      // 151936 is divisible by 8: no padding, so every resident byte is written once.
      EXPECT_EQ(placed, layout.resident_bytes()) << "tp=" << tp << " rank=" << rank;
    }
  }
}

// Scatter every canonical tensor into every rank and check every resident element.
class ScatterTest : public ::testing::TestWithParam<std::tuple<std::uint32_t, dtype>> {};

TEST_P(ScatterTest, EveryResidentElementMatchesReferenceIndex) {
  const auto [tp, dt] = GetParam();
  auto c = padded_config();
  c.torch_dtype = dt;
  const tp_layout layout(c, tp);
  const synthetic_weights w{42, 1e-3f, 0.02f};
  const auto m = scatter_all(c, layout, w, 2);
  std::uint64_t checked = 0, padding = 0;
  for (std::uint32_t rank = 0; rank < tp; ++rank) {
    for (std::size_t r = 0; r < layout.residents().size(); ++r) {
      const auto& spec = layout.residents()[r];
      const auto& bytes = m.residents[rank][r];
      const std::uint64_t n = spec.nbytes / dtype_size(dt);
      for (std::uint64_t i = 0; i < n; ++i) {
        const auto src = reference_source(c, tp, rank, spec.name, i);
        const std::uint32_t got = element_bits(bytes.data(), dt, i);
        if (!src) {
          ASSERT_EQ(got, 0u) << spec.name << " rank " << rank << " element " << i;
          ++padding;
          continue;
        }
        const auto& canonical = m.canonical.at(src->name);
        ASSERT_EQ(got, element_bits(canonical.data(), dt, src->index))
          << spec.name << " rank " << rank << " element " << i << " <- " << src->name << "["
          << src->index << "]";
        ++checked;
      }
    }
  }
  // Only the two vocab-split tensors of the last rank have padding: 63*4 - 250 = 2 rows.
  EXPECT_EQ(padding, tp == 4 ? 2u * 2 * 64 : 0u);
  EXPECT_EQ(checked + padding, tp * layout.resident_bytes() / dtype_size(dt));
}

INSTANTIATE_TEST_SUITE_P(TpAndDtype, ScatterTest,
                         ::testing::Combine(::testing::Values(1u, 2u, 4u),
                                            ::testing::Values(dtype::bfloat16, dtype::float32)));

TEST(Scatter, SelectedElementsTp4) {
  const auto c = padded_config();
  const tp_layout layout(c, 4);
  const auto m = scatter_all(c, layout, synthetic_weights{7, 1e-3f, 0.02f}, 0);
  const dtype dt = dtype::bfloat16;
  auto res = [&](std::uint32_t rank, const std::string& name) {
    return m.residents[rank][layout.resident_index(name)].data();
  };
  auto canon = [&](const std::string& name) { return m.canonical.at(name).data(); };
  const std::string l1 = "model.layers.1.";
  // qkv of rank 3: row 0 = q row 3*16; row 16 = k row of kv head 3*2/4 = 1; row 32 = v row 16.
  const auto* qkv = res(3, l1 + "self_attn.qkv_proj.weight");
  EXPECT_EQ(element_bits(qkv, dt, 0 * 64 + 5), element_bits(canon(l1 + "self_attn.q_proj.weight"), dt, 48 * 64 + 5));
  EXPECT_EQ(element_bits(qkv, dt, 16 * 64 + 7), element_bits(canon(l1 + "self_attn.k_proj.weight"), dt, 16 * 64 + 7));
  EXPECT_EQ(element_bits(qkv, dt, 47 * 64 + 63), element_bits(canon(l1 + "self_attn.v_proj.weight"), dt, 31 * 64 + 63));
  // Ranks 0 and 1 share kv head 0.
  EXPECT_EQ(element_bits(res(1, l1 + "self_attn.qkv_proj.weight"), dt, 20 * 64),
            element_bits(canon(l1 + "self_attn.k_proj.weight"), dt, 4 * 64));
  // o_proj rank 2: [h][c] = o[h][2*16 + c].
  EXPECT_EQ(element_bits(res(2, l1 + "self_attn.o_proj.weight"), dt, 10 * 16 + 3),
            element_bits(canon(l1 + "self_attn.o_proj.weight"), dt, 10 * 64 + 35));
  // w2[e][h][c] == down[h][r*I/tp + c] with r=1, e=3, h=60, c=7.
  EXPECT_EQ(element_bits(res(1, l1 + "mlp.experts.w2_weight"), dt, (3 * 64 + 60) * 8 + 7),
            element_bits(canon(l1 + "mlp.experts.3.down_proj.weight"), dt, 60 * 32 + 8 + 7));
  // w13[e] = [gate rows r*8..+8; up rows r*8..+8] with r=2, e=1.
  const auto* w13 = res(2, l1 + "mlp.experts.w13_weight");
  EXPECT_EQ(element_bits(w13, dt, (1 * 16 + 0) * 64 + 9),
            element_bits(canon(l1 + "mlp.experts.1.gate_proj.weight"), dt, 16 * 64 + 9));
  EXPECT_EQ(element_bits(w13, dt, (1 * 16 + 8) * 64 + 9),
            element_bits(canon(l1 + "mlp.experts.1.up_proj.weight"), dt, 16 * 64 + 9));
  // Vocab: rank 3 row 60 = token 249; rows 61, 62 (tokens 250, 251) are zero padding.
  const auto* lm = res(3, "lm_head.weight");
  EXPECT_EQ(element_bits(lm, dt, 60 * 64 + 1), element_bits(canon("lm_head.weight"), dt, 249 * 64 + 1));
  for (std::uint64_t i = 61 * 64; i < 63 * 64; ++i)
    ASSERT_EQ(element_bits(lm, dt, i), 0u);
  // Replicated tensors are identical on every rank.
  for (std::uint32_t rank = 0; rank < 4; ++rank)
    EXPECT_EQ(m.residents[rank][layout.resident_index(l1 + "mlp.gate.weight")],
              m.canonical.at(l1 + "mlp.gate.weight"));
}

TEST(Scatter, RejectsWrongResidentCount) {
  const tp_layout layout(tiny_config(), 2);
  const auto p = expected_key_stream(tiny_config())[1];
  std::vector<std::byte> src(p.nbytes());
  std::vector<std::byte*> too_few(3, src.data());
  auto e = catch_model_error([&] { layout.scatter(p, src.data(), 0, too_few); });
  EXPECT_EQ(e.where, p.name);
  EXPECT_TRUE(contains(e.what(), "got 3 resident pointers")) << e.what();
}

// --------------------------------------------------------------------------------------
// Synthetic weights
// --------------------------------------------------------------------------------------

const param_meta synth_weight{"model.layers.0.mlp.experts.1.up_proj.weight", {96, 80}, dtype::bfloat16};

TEST(Synthetic, DeterministicAndSeedAndNameDependent) {
  const synthetic_weights w{5, 1e-3f, 0.02f};
  const auto a = fill_full(synth_weight, w, 1);
  EXPECT_EQ(fill_full(synth_weight, w, 1), a);
  EXPECT_NE(fill_full(synth_weight, synthetic_weights{6, 1e-3f, 0.02f}, 1), a);
  auto renamed = synth_weight;
  renamed.name = "model.layers.0.mlp.experts.2.up_proj.weight";
  EXPECT_NE(fill_full(renamed, w, 1), a);
  EXPECT_NE(fill_full(synth_weight, w, 0), a);
}

TEST(Synthetic, InitRangesForWeightsAndNorms) {
  const synthetic_weights w{9, 1e-3f, 0.02f};
  auto p = synth_weight;
  p.dt = dtype::float32;
  const auto weights = fill_full(p, w, 0);
  double sum = 0, sum_sq = 0;
  const std::uint64_t n = p.numel();
  for (std::uint64_t i = 0; i < n; ++i) {
    const float v = element_value(weights.data(), p.dt, i);
    ASSERT_LE(std::fabs(v), 0.02f) << i;
    sum += v;
    sum_sq += double{v} * v;
  }
  EXPECT_LT(std::fabs(sum / n), 0.001);                       // mean ~ 0
  EXPECT_NEAR(std::sqrt(sum_sq / n), 0.02 / std::sqrt(3.0), 0.001); // uniform std

  const param_meta norm{"model.layers.3.post_attention_layernorm.weight", {4096}, dtype::bfloat16};
  const auto norms = fill_full(norm, w, 0);
  std::map<std::uint32_t, int> distinct;
  for (std::uint64_t i = 0; i < norm.numel(); ++i) {
    const float v = element_value(norms.data(), norm.dt, i);
    ASSERT_GE(v, 0.98f - 0.004f) << i; // bf16 spacing near 1 is 2^-7 / 2^-8
    ASSERT_LE(v, 1.02f + 0.008f) << i;
    ++distinct[element_bits(norms.data(), norm.dt, i)];
  }
  EXPECT_GT(distinct.size(), 5u);
}

TEST(Synthetic, FillAtStepEqualsInitPlusAppliedSteps) {
  const synthetic_weights w{11, 1e-3f, 0.02f};
  for (dtype dt : {dtype::bfloat16, dtype::float16, dtype::float32}) {
    for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}) {
      const param_meta p{name, {64, 48}, dt};
      auto stepped = fill_full(p, w, 0);
      for (std::uint64_t s = 1; s <= 3; ++s)
        apply_synthetic_step(p, w, s, 0, p.numel(), stepped.data());
      EXPECT_EQ(fill_full(p, w, 3), stepped) << name << " " << dtype_name(dt);
    }
  }
}

TEST(Synthetic, StepsMoveValuesByAboutLr) {
  const synthetic_weights w{13, 1e-3f, 0.02f};
  auto p = synth_weight;
  p.dt = dtype::float32;
  const auto s0 = fill_full(p, w, 0);
  const auto s1 = fill_full(p, w, 1);
  std::uint64_t changed = 0;
  for (std::uint64_t i = 0; i < p.numel(); ++i) {
    const float d = element_value(s1.data(), p.dt, i) - element_value(s0.data(), p.dt, i);
    ASSERT_LE(std::fabs(d), 1e-3f * 1.0001f) << i;
    changed += d != 0;
  }
  EXPECT_GT(changed, p.numel() * 99 / 100);
}

TEST(Synthetic, ShardEqualsSliceOfFullTensor) {
  const synthetic_weights w{17, 1e-3f, 0.02f};
  for (dtype dt : {dtype::bfloat16, dtype::float16, dtype::float32}) {
    auto p = synth_weight;
    p.dt = dt;
    const std::size_t es = dtype_size(dt);
    const auto full = fill_full(p, w, 2);
    const std::uint64_t begin = 1234, count = 3001;
    std::vector<std::byte> shard(count * es);
    fill_synthetic(p, w, 2, begin, count, shard.data());
    EXPECT_TRUE(std::equal(shard.begin(), shard.end(), full.begin() + begin * es))
      << dtype_name(dt);

    // Applying a step to the shard equals the slice of the stepped full tensor.
    apply_synthetic_step(p, w, 3, begin, count, shard.data());
    const auto full3 = fill_full(p, w, 3);
    EXPECT_TRUE(std::equal(shard.begin(), shard.end(), full3.begin() + begin * es))
      << dtype_name(dt);
  }
}

TEST(Synthetic, Fp16ValuesAreNearestHalfOfFp32Init) {
  // Step 0 computes the value in float and rounds once, so the fp16 fill must be the
  // nearest binary16 value (ties to even) of the fp32 fill. The scales cover normals with
  // ties (scale 1), overflow to infinity (scale 1e5) and subnormals (scale 1e-3).
  for (float scale : {1.0f, 1e5f, 1e-3f}) {
    const synthetic_weights w{19, 1e-3f, scale};
    const param_meta f32{"model.layers.0.self_attn.k_proj.weight", {512, 512}, dtype::float32};
    auto f16 = f32;
    f16.dt = dtype::float16;
    const auto wide = fill_full(f32, w, 0);
    const auto half = fill_full(f16, w, 0);
    std::uint64_t ties = 0, infinities = 0, subnormals = 0;
    for (std::uint64_t i = 0; i < f32.numel(); ++i) {
      const double exact = element_value(wide.data(), dtype::float32, i);
      const auto h = static_cast<std::uint16_t>(element_bits(half.data(), dtype::float16, i));
      const auto magnitude = static_cast<std::uint16_t>(h & 0x7fff);
      const std::uint16_t sign = h & 0x8000;
      ASSERT_EQ(sign != 0, std::signbit(exact)) << i;
      if (std::fabs(exact) >= 65520.0) { // rounds past the largest finite half (65504)
        ASSERT_EQ(magnitude, 0x7c00) << i << " " << exact;
        ++infinities;
        continue;
      }
      const double error = std::fabs(half_value(h) - exact);
      const double up = std::fabs(half_value(static_cast<std::uint16_t>(sign | (magnitude + 1))) - exact);
      const double down = magnitude > 0
                            ? std::fabs(half_value(static_cast<std::uint16_t>(sign | (magnitude - 1))) - exact)
                            : up;
      ASSERT_LE(error, up) << i << " " << exact;
      ASSERT_LE(error, down) << i << " " << exact;
      if (error != 0 && (error == up || error == down)) {
        ASSERT_EQ(magnitude & 1, 0) << "tie not rounded to even: " << i << " " << exact;
        ++ties;
      }
      subnormals += magnitude != 0 && magnitude < 0x400;
    }
    if (scale == 1.0f) {
      EXPECT_GT(ties, 0u);
    } else if (scale == 1e5f) {
      EXPECT_GT(infinities, 0u);
    } else {
      EXPECT_GT(subnormals, 0u);
    }
  }
}

TEST(Synthetic, RejectsStepZeroAndOutOfRange) {
  const synthetic_weights w;
  std::vector<std::byte> buf(16);
  auto e = catch_model_error([&] { apply_synthetic_step(synth_weight, w, 0, 0, 4, buf.data()); });
  EXPECT_EQ(e.where, synth_weight.name);
  EXPECT_TRUE(contains(e.what(), "step must be >= 1"));
  e = catch_model_error([&] { fill_synthetic(synth_weight, w, 0, 96 * 80 - 2, 4, buf.data()); });
  EXPECT_EQ(e.where, synth_weight.name);
  EXPECT_TRUE(contains(e.what(), "elements [7678, 7682) are out of range of 7680 elements"))
    << e.what();
  EXPECT_NO_THROW(fill_synthetic(synth_weight, w, 0, 96 * 80, 0, buf.data()));
}

TEST(Synthetic, FillsHundredMegabytesQuickly) {
  const param_meta big{"model.embed_tokens.weight", {25600, 2048}, dtype::bfloat16}; // 100 MiB
  std::vector<std::byte> out(big.nbytes());
  const auto start = std::chrono::steady_clock::now();
  fill_synthetic(big, synthetic_weights{}, 0, 0, big.numel(), out.data());
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  // Typically ~0.1-0.2 s in a release build; the bound leaves room for a loaded machine.
  EXPECT_LT(took.count(), 2.0);
  EXPECT_NE(element_bits(out.data(), big.dt, big.numel() - 1), 0u);
}

} // namespace

// ---------------------------------------------------------------------------------------
// Dense qwen3: one always-chosen expert whose router row stays zero
// ---------------------------------------------------------------------------------------

TEST(DenseModel, KeyStreamHasTheHfDenseMlpNamesAndNoRouter) {
  const auto cfg = refit::testing::tiny_dense_model();
  const auto stream = expected_key_stream(cfg);
  std::vector<std::string> layer0;
  for (const auto& p : stream)
    if (p.name.rfind("model.layers.0.", 0) == 0)
      layer0.push_back(p.name.substr(15));
  const std::vector<std::string> expected = {
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",    "mlp.up_proj.weight",      "mlp.down_proj.weight",
    "input_layernorm.weight",  "post_attention_layernorm.weight"};
  EXPECT_EQ(layer0, expected);
  for (const auto& p : stream) {
    if (p.name == "model.layers.1.mlp.gate_proj.weight")
      EXPECT_EQ(p.shape, (std::vector<std::int64_t>{96, 64}));
    if (p.name == "model.layers.1.mlp.down_proj.weight")
      EXPECT_EQ(p.shape, (std::vector<std::int64_t>{64, 96}));
    EXPECT_NE(p.name, "lm_head.weight") << "tied embeddings";
  }
  // 1 embed + 2 layers x 11 + final norm.
  EXPECT_EQ(stream.size(), 1u + 2u * 11u + 1u);
}

TEST(DenseModel, MlpLandsLikeExpertZeroOfAOneExpertMoeAndTheRouterStaysUnplaced) {
  const auto dense = refit::testing::tiny_dense_model();
  auto moe = dense;
  moe.model_type = "qwen3_moe"; // same numbers: 1 expert, top-1, width 96
  for (std::uint32_t tp : {1u, 2u, 4u}) {
    const tp_layout dl(dense, tp), ml(moe, tp);
    ASSERT_EQ(dl.residents().size(), ml.residents().size());
    for (std::size_t i = 0; i < dl.residents().size(); ++i)
      EXPECT_EQ(dl.residents()[i].shape, ml.residents()[i].shape) << dl.residents()[i].name;
    const std::pair<const char*, const char*> pairs[] = {
      {"mlp.gate_proj.weight", "mlp.experts.0.gate_proj.weight"},
      {"mlp.up_proj.weight", "mlp.experts.0.up_proj.weight"},
      {"mlp.down_proj.weight", "mlp.experts.0.down_proj.weight"}};
    for (const auto& [d, m] : pairs) {
      const auto dp = param_meta{std::string("model.layers.1.") + d,
                                        d == std::string("mlp.down_proj.weight")
                                          ? std::vector<std::int64_t>{64, 96}
                                          : std::vector<std::int64_t>{96, 64},
                                        dense.torch_dtype};
      auto mp = dp;
      mp.name = std::string("model.layers.1.") + m;
      for (std::uint32_t r = 0; r < tp; ++r) {
        const auto a = dl.place(dp, r), b = ml.place(mp, r);
        ASSERT_EQ(a.size(), b.size()) << d;
        for (std::size_t k = 0; k < a.size(); ++k) {
          EXPECT_EQ(a[k].resident_index, b[k].resident_index);
          EXPECT_EQ(a[k].src_offset, b[k].src_offset);
          EXPECT_EQ(a[k].dst_offset, b[k].dst_offset);
          EXPECT_EQ(a[k].rows, b[k].rows);
        }
      }
    }
    // Nothing in the dense stream writes the router resident: it stays zero, so the softmax
    // over one expert is exactly 1.
    const std::size_t router = dl.resident_index("model.layers.0.mlp.gate.weight");
    for (const auto& p : expected_key_stream(dense))
      for (std::uint32_t r = 0; r < tp; ++r)
        for (const auto& pl : dl.place(p, r))
          EXPECT_NE(pl.resident_index, router) << p.name;
    // MoE names are not part of a dense model.
    EXPECT_THROW(dl.place(param_meta{"model.layers.0.mlp.gate.weight", {1, 64},
                                            dense.torch_dtype}, 0),
                 model_error);
  }
}

TEST(DenseModel, ValidationNamesTheOffendingKey) {
  auto cfg = refit::testing::tiny_dense_model();
  cfg.intermediate_size = 0;
  cfg.moe_intermediate_size = 0;
  try {
    validate(cfg, 1);
    FAIL() << "accepted intermediate_size 0";
  } catch (const model_error& e) {
    EXPECT_EQ(e.where, "model.intermediate_size");
  }
  cfg = refit::testing::tiny_dense_model();
  cfg.num_experts = 4;
  try {
    validate(cfg, 1);
    FAIL() << "accepted experts on a dense model";
  } catch (const model_error& e) {
    EXPECT_EQ(e.where, "model.num_experts");
  }
  cfg = refit::testing::tiny_dense_model();
  cfg.model_type = "llama";
  try {
    validate(cfg, 1);
    FAIL() << "accepted llama";
  } catch (const model_error& e) {
    EXPECT_NE(std::string(e.what()).find("'llama'"), std::string::npos);
  }
}
