// The C ABI from a C translation unit (c_api_smoke.c, compiled as C): world 1 with the
// coordinator embedded in this process and the real refit-runtime child.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "free_port.hpp"
#include "refit/host.hpp"
#include "refit/refit.h"

extern "C" int refit_c_api_smoke(const char* recipe, char* err, size_t err_size);

namespace {

// A world-1 recipe with the coordinator embedded (its own free port).
std::string write_recipe(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string recipe = dir + "recipe.yaml";
  std::ofstream(recipe)
    << "model: {model_type: qwen3_moe, num_hidden_layers: 2, hidden_size: 64, "
       "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, num_experts: 4, "
       "num_experts_per_tok: 2, moe_intermediate_size: 32, vocab_size: 256, "
       "tie_word_embeddings: false, torch_dtype: bfloat16}\n"
    << "runtime: {executable: " << REFIT_RUNTIME_EXE
    << ", tp_size: 1, devices: [cpu:0], kill_grace_ms: 300}\n"
    << "publication: {buffer_bytes: 65536, buffer_count: 2, verify: true, "
       "memory_headroom_bytes: 1048576}\n"
    << "serve: {host: 127.0.0.1, port: " << refit::testing::free_port() << ", token_env: REFIT_C_API_TOKEN, world_size: 1, "
       "embedded: true}\n";
  ::setenv("REFIT_C_API_TOKEN", "refit-c-api-test-secret-0123456789", 1);
  return recipe;
}

TEST(CApi, RegisteredTensorsPublishThroughTheCAbi) {
  const std::string dir = ::testing::TempDir() + "refit-c-api-" + std::to_string(::getpid()) + "/";
  const std::string recipe = write_recipe(dir);
  char err[8192] = {};
  EXPECT_EQ(refit_c_api_smoke(recipe.c_str(), err, sizeof(err)), 0) << err;
  EXPECT_STRNE(refit_version(), "");
  std::filesystem::remove_all(dir);
}

TEST(CppApi, ATensorThatMovedIsRefusedByPublishBeforeAnythingIsPublished) {
  const std::string dir = ::testing::TempDir() + "refit-cpp-api-" + std::to_string(::getpid()) + "/";
  auto created = refit::api::host::create({write_recipe(dir)});
  ASSERT_TRUE(created) << created.failure().text;
  auto& h = *created.value();
  ASSERT_FALSE(h.register_rank({0, 1, "cpu:0"}));
  std::vector<std::vector<std::uint16_t>> memory;
  const void* moved_to = nullptr; // where the callback says lm_head.weight is now
  for (const auto& t : h.model_tensors()) {
    std::uint64_t n = 1;
    for (auto d : t.shape)
      n *= static_cast<std::uint64_t>(d);
    memory.emplace_back(n, std::uint16_t{0x3c00}); // bf16 0.0078125
    refit::api::tensor_spec spec;
    spec.name = t.name;
    spec.data = memory.back().data();
    spec.bytes = n * 2;
    spec.dtype = t.dtype;
    spec.global_shape = t.shape;
    spec.rows = t.shape.empty() ? 1 : static_cast<std::uint64_t>(t.shape[0]);
    if (t.name == "lm_head.weight")
      spec.current = [&moved_to](const void*& data, std::uint64_t&) {
        if (moved_to)
          data = moved_to;
      };
    auto e = h.register_tensor(spec);
    ASSERT_FALSE(e) << e.text;
  }
  EXPECT_EQ(h.register_weights(h.recipe_weights()).code, "invalid_state")
    << "not together with registered tensors";
  auto e = h.connect();
  ASSERT_FALSE(e) << e.text;
  auto first = h.publish(1);
  ASSERT_TRUE(first) << first.failure().text;
  moved_to = memory.front().data();
  auto refused = h.publish(2);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.failure().code, "invalid_argument");
  EXPECT_EQ(refused.failure().where, "lm_head.weight");
  EXPECT_NE(refused.failure().message.find("changed since registration"), std::string::npos)
    << refused.failure().text;
  auto st = h.status();
  ASSERT_TRUE(st) << st.failure().text;
  EXPECT_EQ(st->committed_version, 1u) << "nothing was published";
  moved_to = nullptr;
  EXPECT_TRUE(h.publish(2)) << "back in place: publishes";
  h.close();
  std::filesystem::remove_all(dir);
}

TEST(CApi, ABadRecipeIsAStatusNotAnException) {
  refit_host_options o{};
  o.config_path = "/nonexistent/recipe.yaml";
  o.coordinator_port = -1;
  refit_host* h = reinterpret_cast<refit_host*>(0x1);
  refit_status st;
  EXPECT_EQ(refit_host_create(&o, &h, &st), -1);
  EXPECT_EQ(h, nullptr);
  EXPECT_EQ(st.ok, 0);
  EXPECT_STREQ(st.code, "invalid_argument");
  EXPECT_NE(std::string(st.text).find("/nonexistent/recipe.yaml"), std::string::npos) << st.text;
}

} // namespace
