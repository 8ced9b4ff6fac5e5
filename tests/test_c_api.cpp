// The C ABI from a C translation unit (c_api_smoke.c, compiled as C): world 1 with the
// coordinator embedded in this process and the real refit-runtime child.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "free_port.hpp"
#include "refit/refit.h"

extern "C" int refit_c_api_smoke(const char* recipe, char* err, size_t err_size);

namespace {

TEST(CApi, RegisteredTensorsPublishThroughTheCAbi) {
  const std::string dir = ::testing::TempDir() + "refit-c-api-" + std::to_string(::getpid()) + "/";
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
  char err[8192] = {};
  EXPECT_EQ(refit_c_api_smoke(recipe.c_str(), err, sizeof(err)), 0) << err;
  EXPECT_STRNE(refit_version(), "");
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
