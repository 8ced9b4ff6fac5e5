// Typed YAML config: shipped recipes, the embedded default, and every rejection path
// (unknown keys, wrong types, ranges, devices, model validation, syntax, files).
#include "runtime/config/config.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <sys/stat.h>
#include <unistd.h>

namespace {

using namespace refit;
using config::config_error;
using ::testing::HasSubstr;

const std::string source_dir = REFIT_SOURCE_DIR;

// The tiny model as a flow map, and a valid runtime section for it (tp 2 on two CPUs).
const std::string tiny_model =
  "model: {model_type: qwen3_moe, num_hidden_layers: 2, hidden_size: 64,"
  " num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, num_experts: 4,"
  " num_experts_per_tok: 2, moe_intermediate_size: 32, vocab_size: 256}\n";
const std::string tp2_runtime = "runtime: {tp_size: 2, devices: [cpu:0, cpu:1]}\n";

// Parses `text` and returns the config_error it must raise.
config_error parse_error(const std::string& text) {
  try {
    config::parse_yaml(text, "test.yaml");
  } catch (const config_error& e) {
    return e;
  }
  ADD_FAILURE() << "no config_error for:\n" << text;
  return config_error("<none>", "<none>");
}

void expect_error(const std::string& text, const std::string& key, const std::string& message) {
  const config_error e = parse_error(text);
  EXPECT_EQ(e.key, key) << e.what();
  EXPECT_THAT(e.what(), HasSubstr(message));
}

void expect_same_model(const model::model_config& a, const model::model_config& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.torch_dtype, b.torch_dtype);
  EXPECT_EQ(a.quantization, b.quantization);
  EXPECT_EQ(a.lora, b.lora);
}

void expect_same_timeouts(const config::timeouts& a, const config::timeouts& b) {
  EXPECT_EQ(a.describe, b.describe);
  EXPECT_EQ(a.generate, b.generate);
  EXPECT_EQ(a.sleep, b.sleep);
  EXPECT_EQ(a.wake_up, b.wake_up);
  EXPECT_EQ(a.init_weight_transfer, b.init_weight_transfer);
  EXPECT_EQ(a.start_weight_update, b.start_weight_update);
  EXPECT_EQ(a.update_weights, b.update_weights);
  EXPECT_EQ(a.finish_weight_update, b.finish_weight_update);
  EXPECT_EQ(a.release_ipc, b.release_ipc);
  EXPECT_EQ(a.reset_prefix_cache, b.reset_prefix_cache);
  EXPECT_EQ(a.shutdown, b.shutdown);
  EXPECT_EQ(a.startup, b.startup);
}

void expect_same_config(const config::refit_config& a, const config::refit_config& b) {
  expect_same_model(a.model, b.model);
  EXPECT_EQ(a.runtime.executable, b.runtime.executable);
  EXPECT_EQ(a.runtime.tp_size, b.runtime.tp_size);
  EXPECT_EQ(a.runtime.devices, b.runtime.devices);
  EXPECT_EQ(a.runtime.kv_cache_bytes, b.runtime.kv_cache_bytes);
  EXPECT_EQ(a.runtime.max_frame_bytes, b.runtime.max_frame_bytes);
  EXPECT_EQ(a.runtime.kill_grace_ms, b.runtime.kill_grace_ms);
  expect_same_timeouts(a.runtime.timeouts_ms, b.runtime.timeouts_ms);
  ASSERT_EQ(a.runtime.faults.size(), b.runtime.faults.size());
  for (std::size_t i = 0; i < a.runtime.faults.size(); ++i) {
    EXPECT_EQ(a.runtime.faults[i].command, b.runtime.faults[i].command);
    EXPECT_EQ(a.runtime.faults[i].kind, b.runtime.faults[i].kind);
    EXPECT_EQ(a.runtime.faults[i].after, b.runtime.faults[i].after);
  }
  EXPECT_EQ(a.supervisor.max_restarts, b.supervisor.max_restarts);
  EXPECT_EQ(a.supervisor.backoff_initial_ms, b.supervisor.backoff_initial_ms);
  EXPECT_EQ(a.supervisor.backoff_max_ms, b.supervisor.backoff_max_ms);
  EXPECT_EQ(a.supervisor.restart_window_ms, b.supervisor.restart_window_ms);
  EXPECT_EQ(a.job.iterations, b.job.iterations);
  EXPECT_EQ(a.job.seed, b.job.seed);
}

// --- shipped configs ---------------------------------------------------------------------

TEST(ConfigShipped, TinyCpuServesTheCommittedCheckpointFromItsConfigJson) {
  const auto cfg = config::load_file(source_dir + "/configs/tiny-cpu.yaml");
  EXPECT_EQ(cfg.model_path, std::filesystem::path(source_dir + "/tests/data/models/tiny-kjv")
                              .lexically_normal()
                              .string());
  // config.json as transformers 5.17 wrote it (num_local_experts, dtype, rope_parameters).
  EXPECT_EQ(cfg.model.model_type, "qwen3_moe");
  EXPECT_EQ(cfg.model.num_hidden_layers, 4u);
  EXPECT_EQ(cfg.model.hidden_size, 128u);
  EXPECT_EQ(cfg.model.num_experts, 8u);
  EXPECT_EQ(cfg.model.vocab_size, 2112u);
  EXPECT_EQ(cfg.model.rope_theta, 1e6);
  EXPECT_FALSE(cfg.model.norm_topk_prob);
  // Fields given next to the path must agree with config.json.
  auto text = std::string("model: {path: ") + source_dir
              + "/tests/data/models/tiny-kjv, hidden_size: 64}\n";
  expect_error(text, "model.hidden_size", "differs from");
  expect_error("model: {path: /nonexistent/model}\n", "model.path", "/nonexistent/model");
}

TEST(ConfigShipped, TinySyntheticParses) {
  const auto cfg = config::load_file(source_dir + "/configs/tiny-synthetic.yaml");
  EXPECT_EQ(cfg.model.model_type, "qwen3_moe");
  EXPECT_EQ(cfg.model.num_hidden_layers, 2u);
  EXPECT_EQ(cfg.model.hidden_size, 64u);
  EXPECT_EQ(cfg.model.num_attention_heads, 4u);
  EXPECT_EQ(cfg.model.num_key_value_heads, 2u);
  EXPECT_EQ(cfg.model.head_dim, 16u);
  EXPECT_EQ(cfg.model.num_experts, 4u);
  EXPECT_EQ(cfg.model.num_experts_per_tok, 2u);
  EXPECT_EQ(cfg.model.moe_intermediate_size, 32u);
  EXPECT_EQ(cfg.model.vocab_size, 256u);
  EXPECT_FALSE(cfg.model.tie_word_embeddings);
  EXPECT_EQ(cfg.model.rms_norm_eps, 1e-6);
  EXPECT_EQ(cfg.model.rope_theta, 1e6);
  EXPECT_TRUE(cfg.model.norm_topk_prob);
  EXPECT_EQ(cfg.model.torch_dtype, model::dtype::bfloat16);
  EXPECT_EQ(cfg.runtime.executable, "refit-runtime");
  EXPECT_EQ(cfg.runtime.tp_size, 2u);
  EXPECT_EQ(cfg.runtime.devices, (std::vector<std::string>{"cpu:0", "cpu:1"}));
  EXPECT_EQ(cfg.runtime.kv_cache_bytes, 4u << 20);
  EXPECT_TRUE(cfg.runtime.faults.empty());
  expect_same_timeouts(cfg.runtime.timeouts_ms, config::timeouts{});
  EXPECT_EQ(cfg.job.iterations, 3u);
  EXPECT_EQ(cfg.job.seed, 1234u);
}

TEST(ConfigShipped, Qwen3_30bA3bParses) {
  const auto cfg = config::load_file(source_dir + "/configs/qwen3-30b-a3b.yaml");
  EXPECT_EQ(cfg.model.num_hidden_layers, 48u);
  EXPECT_EQ(cfg.model.hidden_size, 2048u);
  EXPECT_EQ(cfg.model.num_attention_heads, 32u);
  EXPECT_EQ(cfg.model.num_key_value_heads, 4u);
  EXPECT_EQ(cfg.model.head_dim, 128u);
  EXPECT_EQ(cfg.model.num_experts, 128u);
  EXPECT_EQ(cfg.model.num_experts_per_tok, 8u);
  EXPECT_EQ(cfg.model.moe_intermediate_size, 768u);
  EXPECT_EQ(cfg.model.vocab_size, 151936u);
  EXPECT_FALSE(cfg.model.tie_word_embeddings);
  EXPECT_EQ(cfg.model.rms_norm_eps, 1e-6);
  EXPECT_EQ(cfg.model.rope_theta, 1e6);
  EXPECT_EQ(cfg.runtime.tp_size, 2u);
  EXPECT_EQ(cfg.runtime.devices, (std::vector<std::string>{"cuda:0", "cuda:1"}));
  EXPECT_EQ(cfg.runtime.kv_cache_bytes, std::uint64_t{1} << 30);
  EXPECT_EQ(cfg.supervisor.max_restarts, config::supervisor_config{}.max_restarts);
}

TEST(ConfigShipped, EmbeddedDefaultEqualsTinyCpuFile) {
  const auto embedded = config::parse_yaml(config::embedded_default_yaml(), "<embedded>",
                                           config::embedded_base_dir());
  const auto file = config::load_file(source_dir + "/configs/tiny-cpu.yaml");
  expect_same_config(embedded, file);
}

TEST(ConfigParse, OmittedSectionsTakeStructDefaults) {
  const auto cfg = config::parse_yaml(tiny_model);
  config::refit_config expected;
  expected.model = cfg.model;
  expect_same_config(cfg, expected);
  EXPECT_EQ(cfg.runtime.devices, (std::vector<std::string>{"cpu:0"}));
}

TEST(ConfigParse, ReadsEveryRuntimeSupervisorAndJobKey) {
  const auto cfg = config::parse_yaml(
    tiny_model
    + "runtime:\n"
      "  executable: /opt/refit/bin/refit-runtime\n"
      "  tp_size: 2\n"
      "  devices: [cuda:1, cuda:0]\n"
      "  kv_cache_bytes: 8192\n"
      "  max_frame_bytes: 4096\n"
      "  kill_grace_ms: 0\n"
      "  timeouts_ms: {sleep: 1, startup: 3600000}\n"
      "  faults: [{command: sleep, kind: stall}, {command: generate, kind: wrong_id, after: 2}]\n"
      "supervisor: {max_restarts: 0, backoff_initial_ms: 7, backoff_max_ms: 7,"
      " restart_window_ms: 9}\n"
      "job: {iterations: 1, seed: 18446744073709551615}\n");
  EXPECT_EQ(cfg.runtime.executable, "/opt/refit/bin/refit-runtime");
  EXPECT_EQ(cfg.runtime.devices, (std::vector<std::string>{"cuda:1", "cuda:0"}));
  EXPECT_EQ(cfg.runtime.kv_cache_bytes, 8192u);
  EXPECT_EQ(cfg.runtime.max_frame_bytes, 4096u);
  EXPECT_EQ(cfg.runtime.kill_grace_ms, 0u);
  EXPECT_EQ(cfg.runtime.timeouts_ms.sleep, 1u);
  EXPECT_EQ(cfg.runtime.timeouts_ms.startup, 3600000u);
  EXPECT_EQ(cfg.runtime.timeouts_ms.describe, config::timeouts{}.describe);
  ASSERT_EQ(cfg.runtime.faults.size(), 2u);
  EXPECT_EQ(cfg.runtime.faults[0].command, "sleep");
  EXPECT_EQ(cfg.runtime.faults[0].kind, "stall");
  EXPECT_EQ(cfg.runtime.faults[0].after, 0u);
  EXPECT_EQ(cfg.runtime.faults[1].command, "generate");
  EXPECT_EQ(cfg.runtime.faults[1].kind, "wrong_id");
  EXPECT_EQ(cfg.runtime.faults[1].after, 2u);
  EXPECT_EQ(cfg.supervisor.max_restarts, 0u);
  EXPECT_EQ(cfg.supervisor.backoff_initial_ms, 7u);
  EXPECT_EQ(cfg.supervisor.backoff_max_ms, 7u);
  EXPECT_EQ(cfg.supervisor.restart_window_ms, 9u);
  EXPECT_EQ(cfg.job.iterations, 1u);
  EXPECT_EQ(cfg.job.seed, 18446744073709551615u);
}

// --- unknown and missing keys --------------------------------------------------------------

TEST(ConfigRanges, TwoRuntimeFaultsOnOneOccurrenceAreRejected) {
  expect_error(tiny_model
                 + "runtime: {faults: [{command: sleep, kind: stall}, {command: sleep, kind: exit}]}\n",
               "runtime.faults[1]", "targets the same occurrence of 'sleep' as runtime.faults[0]");
}

TEST(ConfigKeys, UnknownTopLevelKey) {
  expect_error(tiny_model + "jobs: {iterations: 2}\n", "jobs",
               "unknown key (known keys: model, runtime, supervisor, trainer, publication, job, journal, serve)");
}

TEST(ConfigKeys, UnknownNestedKey) {
  expect_error(tiny_model + "runtime: {timeouts_ms: {slep: 5}}\n", "runtime.timeouts_ms.slep",
               "unknown key (known keys: describe, generate, sleep, wake_up,");
  expect_error(tiny_model + "supervisor: {max_restart: 5}\n", "supervisor.max_restart",
               "unknown key");
}

TEST(ConfigKeys, UnknownModelKey) {
  expect_error("model: {num_layers: 2}\n", "model.num_layers",
               "unknown key (known keys: model_type, num_hidden_layers,");
}

TEST(ConfigKeys, UnknownKeyInsideAFault) {
  expect_error(tiny_model
                 + "runtime: {faults: [{command: sleep, kind: stall},"
                   " {command: sleep, kynd: exit}]}\n",
               "runtime.faults[1].kynd", "unknown key (known keys: command, kind, after, incarnation)");
}

TEST(ConfigKeys, DuplicateKey) {
  expect_error(tiny_model + "job: {seed: 1, seed: 2}\n", "job.seed", "duplicate key");
}

TEST(ConfigKeys, MissingModelSectionAndModelFields) {
  expect_error("job: {seed: 1}\n", "model", "required key is missing");
  expect_error("model: {model_type: qwen3_moe}\n", "model.num_hidden_layers",
               "required key is missing");
  expect_error(tiny_model + "runtime: {faults: [{command: sleep}]}\n", "runtime.faults[0].kind",
               "required key is missing");
}

// --- wrong types ------------------------------------------------------------------------------

TEST(ConfigTypes, UnsignedIntegerRejectsWords) {
  expect_error(tiny_model + "runtime: {tp_size: two}\n", "runtime.tp_size",
               "runtime.tp_size: expected an unsigned integer, got 'two'");
  expect_error(tiny_model + "job: {iterations: 2.5}\n", "job.iterations",
               "expected an unsigned integer, got '2.5'");
}

TEST(ConfigTypes, UnsignedIntegerRejectsNegative) {
  expect_error(tiny_model + "runtime: {kill_grace_ms: -1}\n", "runtime.kill_grace_ms",
               "expected an unsigned integer, got '-1' (negative)");
}

TEST(ConfigTypes, UnsignedIntegerRejectsOverflow) {
  expect_error(tiny_model + "supervisor: {max_restarts: 4294967296}\n", "supervisor.max_restarts",
               "'4294967296' is too large (maximum 4294967295)");
  expect_error(tiny_model + "job: {seed: 18446744073709551616}\n", "job.seed",
               "'18446744073709551616' is too large (maximum 18446744073709551615)");
}

TEST(ConfigTypes, QuotedNumberIsAString) {
  expect_error(tiny_model + "runtime: {tp_size: \"2\"}\n", "runtime.tp_size",
               "expected an unsigned integer, got the quoted string '2'");
}

TEST(ConfigTypes, BooleanMustBeTrueOrFalse) {
  expect_error("model: {tie_word_embeddings: yes}\n", "model.tie_word_embeddings",
               "expected true or false, got 'yes'");
}

TEST(ConfigTypes, NumberMustBeFinite) {
  expect_error("model: {rope_theta: .inf}\n", "model.rope_theta",
               "expected a finite number, got '.inf'");
  expect_error("model: {rms_norm_eps: 1e-6x}\n", "model.rms_norm_eps",
               "expected a finite number, got '1e-6x'");
}

TEST(ConfigTypes, MapWhereScalarExpected) {
  expect_error(tiny_model + "runtime: {kv_cache_bytes: {mib: 4}}\n", "runtime.kv_cache_bytes",
               "expected an unsigned integer, got a map");
  expect_error("model: {model_type: [qwen3_moe]}\n", "model.model_type",
               "expected a string, got a sequence");
}

TEST(ConfigTypes, EmptyValue) {
  expect_error(tiny_model + "job: {seed: }\n", "job.seed",
               "expected an unsigned integer, got an empty value");
}

TEST(ConfigTypes, SectionsAndSequencesHaveTheirShape) {
  expect_error(tiny_model + "runtime: [tp_size, 2]\n", "runtime", "expected a map, got a sequence");
  expect_error(tiny_model + "runtime: {devices: cpu:0}\n", "runtime.devices",
               "expected a sequence, got a scalar");
  expect_error(tiny_model + "runtime: {tp_size: 2, devices: [cpu:0, {cpu: 1}]}\n",
               "runtime.devices[1]", "expected a string, got a map");
  expect_error(tiny_model + "runtime: {faults: [sleep]}\n", "runtime.faults[0]",
               "expected a map, got a scalar");
  expect_error("- model\n", "", "expected a map, got a sequence");
}

TEST(ConfigTypes, ErrorNamesLineAndColumn) {
  expect_error(tiny_model + "runtime:\n  tp_size: two\n", "runtime.tp_size",
               "(at test.yaml:3:12)");
}

// --- ranges -------------------------------------------------------------------------------------

TEST(ConfigRanges, TpSizeAtLeastOne) {
  expect_error(tiny_model + "runtime: {tp_size: 0, devices: []}\n", "runtime.tp_size",
               "0 is too small (minimum 1)");
}

TEST(ConfigRanges, Timeouts) {
  expect_error(tiny_model + "runtime: {timeouts_ms: {sleep: 0}}\n", "runtime.timeouts_ms.sleep",
               "0 is out of range [1, 3600000]");
  expect_error(tiny_model + "runtime: {timeouts_ms: {startup: 3600001}}\n",
               "runtime.timeouts_ms.startup", "3600001 is out of range [1, 3600000]");
}

TEST(ConfigRanges, KillGrace) {
  expect_error(tiny_model + "runtime: {kill_grace_ms: 60001}\n", "runtime.kill_grace_ms",
               "60001 is out of range [0, 60000]");
}

TEST(ConfigRanges, MaxFrameBytes) {
  expect_error(tiny_model + "runtime: {max_frame_bytes: 4095}\n", "runtime.max_frame_bytes",
               "4095 is out of range [4096, 1073741824]");
  expect_error(tiny_model + "runtime: {max_frame_bytes: 1073741825}\n", "runtime.max_frame_bytes",
               "1073741825 is out of range [4096, 1073741824]");
}

TEST(ConfigRanges, KvCacheBytes) {
  expect_error(tiny_model + "runtime: {kv_cache_bytes: 4095}\n", "runtime.kv_cache_bytes",
               "4095 is too small (minimum 4096)");
}

TEST(ConfigRanges, FaultCommandAndKind) {
  expect_error(tiny_model + "runtime: {faults: [{command: slep, kind: stall}]}\n",
               "runtime.faults[0].command",
               "'slep' is not one of describe, generate, sleep, wake_up,");
  expect_error(tiny_model
                 + "runtime: {faults: [{command: sleep, kind: stall},"
                   " {command: shutdown, kind: crash}]}\n",
               "runtime.faults[1].kind", "'crash' is not one of stall, exit, sigkill,");
}

TEST(ConfigRanges, SupervisorBackoff) {
  expect_error(tiny_model + "supervisor: {backoff_initial_ms: 6000}\n",
               "supervisor.backoff_initial_ms", "6000 exceeds supervisor.backoff_max_ms (5000)");
}

TEST(ConfigRanges, JobIterations) {
  expect_error(tiny_model + "job: {iterations: 1000001}\n", "job.iterations",
               "1000001 is out of range");
  EXPECT_EQ(config::parse_yaml(tiny_model + "job: {iterations: 0}\n").job.iterations, 0u)
    << "0 = the bootstrap generation only";
}

TEST(ConfigRanges, RangeErrorsNameTheirLocation) {
  expect_error(tiny_model + "job:\n  max_tokens: 0\n", "job.max_tokens", "(at test.yaml:3:15)");
}

// --- devices ------------------------------------------------------------------------------------

TEST(ConfigDevices, CountMustEqualTpSize) {
  expect_error(tiny_model + "runtime: {tp_size: 2, devices: [cpu:0]}\n", "runtime.devices",
               "lists 1 devices but runtime.tp_size is 2");
  expect_error(tiny_model + "runtime: {tp_size: 2}\n", "runtime.devices",
               "lists 1 devices but runtime.tp_size is 2");
}

TEST(ConfigDevices, MustBeDistinct) {
  expect_error(tiny_model + "runtime: {tp_size: 2, devices: [cuda:3, cuda:03]}\n",
               "runtime.devices[1]", "device 'cuda:03' is already used by runtime.devices[0]");
}

TEST(ConfigDevices, BadSpec) {
  const config_error e =
    parse_error(tiny_model + "runtime: {tp_size: 2, devices: [cpu:0, gpu:1]}\n");
  EXPECT_EQ(e.key, "runtime.devices[1]");
  EXPECT_THAT(e.what(), HasSubstr("device 'gpu:1' has unknown kind 'gpu'"));
  // The key is not repeated inside the message.
  EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("runtime.devices[1]: runtime.devices[1]")));
}

// --- model --------------------------------------------------------------------------------------

TEST(ConfigModel, ValidationErrorBecomesConfigKey) {
  // 6 heads do not split over tp 4 (everything else does).
  expect_error(
    "model: {num_hidden_layers: 2, hidden_size: 64, num_attention_heads: 6,"
    " num_key_value_heads: 2, head_dim: 16, num_experts: 4, num_experts_per_tok: 2,"
    " moe_intermediate_size: 32, vocab_size: 256}\n"
    "runtime: {tp_size: 4, devices: [cpu:0, cpu:1, cpu:2, cpu:3]}\n",
    "model.num_attention_heads", "(at test.yaml:1:69)");
}

TEST(ConfigModel, QuantizationIsRejected) {
  const config_error e = parse_error(tiny_model.substr(0, tiny_model.size() - 2)
                                     + ", quantization: fp8}\n");
  EXPECT_EQ(e.key, "model.quantization") << e.what();
}

TEST(ConfigModel, TorchDtype) {
  const auto cfg = config::parse_yaml(tiny_model.substr(0, tiny_model.size() - 2)
                                      + ", torch_dtype: fp16}\n");
  EXPECT_EQ(cfg.model.torch_dtype, model::dtype::float16);
  const config_error e =
    parse_error(tiny_model.substr(0, tiny_model.size() - 2) + ", torch_dtype: int8}\n");
  EXPECT_EQ(e.key, "model.torch_dtype") << e.what();
  EXPECT_THAT(e.what(), HasSubstr("int8"));
}

TEST(ConfigModel, ValidateCatchesConfigsBuiltInCode) {
  config::refit_config cfg = config::parse_yaml(tiny_model + tp2_runtime);
  cfg.runtime.devices.push_back("cpu:2");
  try {
    config::validate(cfg);
    FAIL() << "validate accepted 3 devices for tp 2";
  } catch (const config_error& e) {
    EXPECT_EQ(e.key, "runtime.devices");
    EXPECT_EQ(std::string(e.what()),
              "runtime.devices: lists 3 devices but runtime.tp_size is 2 (one device per TP worker)");
  }
}

TEST(ConfigModel, ModelYamlRoundTrip) {
  for (const char* file : {"/configs/tiny-cpu.yaml", "/configs/tiny-synthetic.yaml", "/configs/qwen3-30b-a3b.yaml"}) {
    const auto m = config::load_file(source_dir + file).model;
    const std::string text = config::model_to_yaml(m);
    EXPECT_EQ(text.find('\n'), std::string::npos) << text;
    expect_same_model(config::parse_model_yaml(text, "<argv>"), m);
  }
  model::model_config odd = config::parse_yaml(tiny_model).model;
  odd.rms_norm_eps = 0.1 + 0.2;
  odd.rope_theta = 12345.678901234567;
  odd.torch_dtype = model::dtype::float32;
  odd.tie_word_embeddings = true;
  odd.norm_topk_prob = false;
  odd.quantization = "fp8, \"e4m3\"}";
  odd.lora = true;
  odd.model_type = "null";
  expect_same_model(config::parse_model_yaml(config::model_to_yaml(odd), "<argv>"), odd);
}

TEST(ConfigModel, ModelYamlRendersAFlowMap) {
  const auto m = config::load_file(source_dir + "/configs/tiny-synthetic.yaml").model;
  EXPECT_EQ(config::model_to_yaml(m),
            "{model_type: qwen3_moe, num_hidden_layers: 2, hidden_size: 64,"
            " num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, num_experts: 4,"
            " num_experts_per_tok: 2, moe_intermediate_size: 32, intermediate_size: 0, vocab_size: 256,"
            " tie_word_embeddings: false, rms_norm_eps: 1e-06, rope_theta: 1e+06,"
            " norm_topk_prob: true, torch_dtype: bfloat16, quantization: \"\", lora: false}");
}

TEST(ConfigModel, ModelYamlErrorsUseModelKeys) {
  try {
    config::parse_model_yaml("{hidden_size: big}", "<argv>");
    FAIL() << "accepted hidden_size: big";
  } catch (const config_error& e) {
    EXPECT_EQ(e.key, "model.hidden_size");
    EXPECT_THAT(e.what(), HasSubstr("expected an unsigned integer, got 'big' (at <argv>:1:15)"));
  }
}

// --- journal section and the whole config as YAML ----------------------------------------

TEST(ConfigJournal, OffByDefaultAndParsed) {
  auto off = config::parse_yaml(tiny_model);
  EXPECT_FALSE(off.journal.enabled);
  EXPECT_EQ(off.journal.path, "refit-journal.bin");
  auto on = config::parse_yaml(tiny_model + "journal: {enabled: true, path: /tmp/x.journal}\n");
  EXPECT_TRUE(on.journal.enabled);
  EXPECT_EQ(on.journal.path, "/tmp/x.journal");
}

TEST(ConfigJournal, StrictKeysTypesAndPath) {
  expect_error(tiny_model + "journal: {enable: true}\n", "journal.enable",
               "unknown key (known keys: enabled, path) (at test.yaml:2:11)");
  expect_error(tiny_model + "journal: {enabled: \"yes\"}\n", "journal.enabled",
               "expected true or false, got the quoted string 'yes' (at test.yaml:2:20)");
  expect_error(tiny_model + "journal: {enabled: true, path: [a]}\n", "journal.path",
               "expected a string, got a sequence");
  expect_error(tiny_model + "journal: {enabled: true, path: \"\"}\n", "journal.path",
               "must not be empty when journal.enabled is true (at test.yaml:2:32)");
}

// Everything parse_yaml reads, compared through the renderer (to_yaml is deterministic).
void expect_round_trip(const config::refit_config& cfg) {
  const std::string text = config::to_yaml(cfg);
  config::refit_config back;
  ASSERT_NO_THROW(back = config::parse_yaml(text, "<to_yaml>")) << text;
  EXPECT_EQ(config::to_yaml(back), text);
  expect_same_model(back.model, cfg.model);
  EXPECT_EQ(back.runtime.devices, cfg.runtime.devices);
  EXPECT_EQ(back.runtime.timeouts_ms.update_weights, cfg.runtime.timeouts_ms.update_weights);
  EXPECT_EQ(back.trainer.lr, cfg.trainer.lr);
  EXPECT_EQ(back.trainer.init_scale, cfg.trainer.init_scale);
  EXPECT_EQ(back.job.prompts, cfg.job.prompts);
  EXPECT_EQ(back.job.temperature, cfg.job.temperature);
  EXPECT_EQ(back.publication.buffer_bytes, cfg.publication.buffer_bytes);
  EXPECT_EQ(back.journal.path, cfg.journal.path);
}

TEST(ConfigYaml, EveryShippedRecipeRoundTrips) {
  for (const char* file :
       {"/configs/tiny-cpu.yaml", "/configs/tiny-synthetic.yaml", "/configs/bench-cpu.yaml",
        "/configs/qwen3-30b-a3b.yaml"})
    expect_round_trip(config::load_file(source_dir + file));
}

TEST(ConfigYaml, OddValuesRoundTrip) {
  auto cfg = config::parse_yaml(tiny_model + tp2_runtime);
  cfg.runtime.executable = "/opt/refit bin/refit-runtime";
  cfg.runtime.faults = {{"update_weights", "sigkill", 2, 1}, {"release_ipc", "stall", 0, 0}};
  cfg.trainer.devices = {"cpu:1", "cpu:0"};
  cfg.trainer.lr = 0.1f + 0.2f;
  cfg.trainer.init_scale = 1.0f / 3.0f;
  cfg.trainer.faults = {{1, "drop_tensor", "model.norm.weight", 0, true}, {0, "never_report", "", 3}};
  cfg.job.prompts = {"quote \" and \\ backslash", "tab\there: colon, [brackets] {braces}",
                     "null", "true", "# not a comment", "caf\xc3\xa9 \x01 control"};
  cfg.job.temperature = 0.7f;
  cfg.job.top_k = 40;
  cfg.journal = {true, "/tmp/refit journal.bin"};
  config::validate(cfg);
  expect_round_trip(cfg);
  auto back = config::parse_yaml(config::to_yaml(cfg));
  ASSERT_EQ(back.runtime.faults.size(), 2u);
  EXPECT_EQ(back.runtime.faults[1].incarnation, 0u);
  ASSERT_EQ(back.trainer.faults.size(), 2u);
  EXPECT_TRUE(back.trainer.faults[0].repeat);
  EXPECT_EQ(back.trainer.faults[1].chunk, 3u);
  EXPECT_EQ(back.runtime.executable, cfg.runtime.executable);
  EXPECT_TRUE(back.journal.enabled);
}

// --- syntax and files ---------------------------------------------------------------------------

TEST(ConfigSyntax, YamlSyntaxErrorHasLineAndColumn) {
  const config_error e = parse_error(tiny_model + "runtime: {tp_size: 2\njob: {}\n");
  EXPECT_EQ(e.key, "");
  EXPECT_THAT(e.what(), ::testing::MatchesRegex("test\\.yaml:[0-9]+:[0-9]+: invalid YAML: .+"));
}

TEST(ConfigSyntax, EmptyAndMultiDocumentInputs) {
  expect_error("", "", "test.yaml: the document is empty");
  expect_error(tiny_model + "---\n" + tiny_model, "", "expected one YAML document, found 2");
}

TEST(ConfigFiles, MissingFileNamesThePath) {
  const std::string path = source_dir + "/configs/no-such-config.yaml";
  try {
    config::load_file(path);
    FAIL() << "loaded a missing file";
  } catch (const config_error& e) {
    EXPECT_EQ(e.key, "");
    EXPECT_THAT(e.what(), HasSubstr("config file '" + path + "': cannot open"));
  }
}

TEST(ConfigFiles, DirectoryIsRejected) {
  try {
    config::load_file(source_dir + "/configs");
    FAIL() << "loaded a directory";
  } catch (const config_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("is a directory, not a regular file"));
  }
}

// Only regular files of bounded size are read: /dev/zero, a FIFO or a huge (sparse) file is
// refused before a byte of it is buffered, naming the file.
TEST(ConfigFiles, UnboundedOrSpecialFilesAreRefusedNamingTheFile) {
  auto refused = [](const std::string& path) -> std::string {
    try {
      config::load_file(path);
    } catch (const config_error& e) {
      return e.what();
    }
    return "<loaded>";
  };
  auto zero = refused("/dev/zero");
  EXPECT_THAT(zero, HasSubstr("config file '/dev/zero': is a character device, not a regular file"));
  const auto dir = std::filesystem::temp_directory_path();
  const auto fifo = (dir / ("refit-test-fifo-" + std::to_string(::getpid()))).string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THAT(refused(fifo), HasSubstr("'" + fifo + "': is a FIFO")) << "and open() did not block";
  std::filesystem::remove(fifo);
  const auto huge = (dir / ("refit-test-huge-" + std::to_string(::getpid()) + ".yaml")).string();
  std::ofstream(huge).close();
  std::filesystem::resize_file(huge, 17u << 20); // sparse: no disk used
  EXPECT_THAT(refused(huge), HasSubstr("has 17825792 bytes, more than the 16777216-byte cap"));
  std::filesystem::remove(huge);
}

TEST(ConfigFiles, ParseErrorsNameTheFile) {
  const auto path = std::filesystem::temp_directory_path()
                    / ("refit-test-config-" + std::to_string(::getpid()) + ".yaml");
  std::ofstream(path) << tiny_model << "runtime: {tp_size: 0}\n";
  try {
    config::load_file(path.string());
    ADD_FAILURE() << "accepted tp_size 0";
  } catch (const config_error& e) {
    EXPECT_EQ(e.key, "runtime.tp_size");
    EXPECT_THAT(e.what(), HasSubstr("(at " + path.string() + ":2:20)"));
  }
  std::filesystem::remove(path);
}

// --- serve (multi-process deployment) ------------------------------------------------------

TEST(ConfigServe, TinyCpuServesOnLoopbackWithATokenFromTheEnvironment) {
  const auto cfg = config::load_file(source_dir + "/configs/tiny-cpu.yaml");
  EXPECT_TRUE(cfg.serve.present);
  EXPECT_EQ(cfg.serve.host, "127.0.0.1");
  EXPECT_EQ(cfg.serve.port, 0u);
  EXPECT_EQ(cfg.serve.token_env, "REFIT_TOKEN");
  EXPECT_TRUE(cfg.serve.token.empty());
  EXPECT_EQ(config::serve_world(cfg), 2u);
  EXPECT_FALSE(cfg.serve.embedded);
  EXPECT_FALSE(cfg.serve.tls.enabled);
}

TEST(ConfigServe, DefaultsWithoutTheSection) {
  const auto cfg = config::parse_yaml(tiny_model + tp2_runtime);
  EXPECT_FALSE(cfg.serve.present);
  EXPECT_EQ(cfg.serve.host, "127.0.0.1");
  EXPECT_EQ(config::serve_world(cfg), 2u);
  try {
    config::resolve_token(cfg.serve);
    ADD_FAILURE() << "a token without a serve section";
  } catch (const config_error& e) {
    EXPECT_EQ(e.key, "serve");
  }
}

TEST(ConfigServe, ReadsEveryKey) {
  const auto cfg = config::parse_yaml(
    tiny_model + tp2_runtime
    + "serve: {host: localhost, port: 4567, token: 0123456789abcdef01, world_size: 2,"
      " embedded: true, join_timeout_ms: 1500, publish_barrier_ms: 2500,"
      " publish_timeout_ms: 3500, tls: {enabled: true, certificate: c.pem, key: k.pem,"
      " passphrase: pw, cafile: ca.pem}}\n");
  EXPECT_EQ(cfg.serve.host, "localhost");
  EXPECT_EQ(cfg.serve.port, 4567u);
  EXPECT_EQ(config::resolve_token(cfg.serve), "0123456789abcdef01");
  EXPECT_TRUE(cfg.serve.embedded);
  EXPECT_EQ(cfg.serve.join_timeout_ms, 1500u);
  EXPECT_EQ(cfg.serve.publish_barrier_ms, 2500u);
  EXPECT_EQ(cfg.serve.publish_timeout_ms, 3500u);
  EXPECT_TRUE(cfg.serve.tls.enabled);
  EXPECT_EQ(cfg.serve.tls.certificate, "c.pem");
  EXPECT_EQ(cfg.serve.tls.key, "k.pem");
  EXPECT_EQ(cfg.serve.tls.passphrase, "pw");
  EXPECT_EQ(cfg.serve.tls.cafile, "ca.pem");
}

TEST(ConfigServe, TokenRules) {
  const std::string base = tiny_model + tp2_runtime;
  expect_error(base + "serve: {host: 127.0.0.1}\n", "serve.token_env", "a shared secret is required");
  expect_error(base + "serve: {token: 0123456789abcdef, token_env: REFIT_TOKEN}\n", "serve.token",
               "exactly one of serve.token and serve.token_env");
  expect_error(base + "serve: {token: short}\n", "serve.token", "at least 16 are required");
  expect_error(base + "serve: {token_env: 1BAD-NAME}\n", "serve.token_env",
               "not an environment variable name");
  expect_error(base + "serve: {token_env: REFIT_TOKEN, tokn: x}\n", "serve.tokn", "unknown key");
}

TEST(ConfigServe, TokenFromTheEnvironment) {
  const auto cfg = config::parse_yaml(tiny_model + tp2_runtime
                                      + "serve: {token_env: REFIT_TEST_CONFIG_TOKEN}\n");
  ::unsetenv("REFIT_TEST_CONFIG_TOKEN");
  try {
    config::resolve_token(cfg.serve);
    ADD_FAILURE() << "resolved an unset variable";
  } catch (const config_error& e) {
    EXPECT_EQ(e.key, "serve.token_env");
    EXPECT_THAT(e.what(), HasSubstr("REFIT_TEST_CONFIG_TOKEN is not set or empty"));
  }
  ::setenv("REFIT_TEST_CONFIG_TOKEN", "too-short", 1);
  EXPECT_THROW(config::resolve_token(cfg.serve), config_error);
  ::setenv("REFIT_TEST_CONFIG_TOKEN", "a-long-enough-secret", 1);
  EXPECT_EQ(config::resolve_token(cfg.serve), "a-long-enough-secret");
  ::unsetenv("REFIT_TEST_CONFIG_TOKEN");
}

TEST(ConfigServe, RangesAndCrossChecks) {
  const std::string base = tiny_model + tp2_runtime;
  const std::string token = "token_env: REFIT_TOKEN";
  expect_error(base + "serve: {" + token + ", port: 70000}\n", "serve.port", "out of range");
  expect_error(base + "serve: {" + token + ", world_size: 3}\n", "serve.world_size",
               "runtime.tp_size is 2");
  expect_error(base + "serve: {" + token + ", embedded: true}\n", "serve.port",
               "must be set (not 0) when serve.embedded is true");
  expect_error(base + "serve: {" + token + ", join_timeout_ms: 0}\n", "serve.join_timeout_ms",
               "out of range");
  expect_error(base + "serve: {" + token + ", host: ''}\n", "serve.host", "not a host name");
  expect_error(base + "serve: {" + token + ", tls: {certificate: c.pem}}\n",
               "serve.tls.certificate", "serve.tls.enabled is false");
  expect_error(base + "serve: {" + token + ", tls: {enabled: true, certificate: c.pem}}\n",
               "serve.tls.key", "set together");
  expect_error(base + "serve: {" + token + ", tls: {enabled: true, certificate: c.pem, key: k.pem}}\n",
               "serve.tls.cafile", "verifies the peers");
  expect_error(base + "serve: {" + token + ", tls: {enabled: true, cafile: ca.pem}}\n",
               "serve.tls.certificate", "anonymous TLS authenticates neither side");
  // Anonymous encryption would hand the hello's token to whoever holds the port: refused.
  expect_error(base + "serve: {" + token + ", tls: {enabled: true}}\n", "serve.tls.certificate",
               "an impostor listener would receive the shared secret");
  // The listener's handshake bounds.
  expect_error(base + "serve: {" + token + ", handshake_timeout_ms: 0}\n",
               "serve.handshake_timeout_ms", "out of range");
  expect_error(base + "serve: {" + token + ", max_pending_handshakes: 0}\n",
               "serve.max_pending_handshakes", "out of range");
  auto bounded = config::parse_yaml(base + "serve: {" + token
                                    + ", handshake_timeout_ms: 750, max_pending_handshakes: 8}\n");
  EXPECT_EQ(bounded.serve.handshake_timeout_ms, 750u);
  EXPECT_EQ(bounded.serve.max_pending_handshakes, 8u);
}

} // namespace

TEST(ConfigTransport, FollowsTheDevicesWhenLeftOutAndMustMatchThemWhenGiven) {
  const auto gpu = config::parse_yaml(tiny_model + "runtime: {tp_size: 2, devices: [cuda:1, cuda:0]}\n");
  EXPECT_EQ(gpu.publication.transport, "cuda_ipc");
  const auto cpu = config::parse_yaml(tiny_model);
  EXPECT_EQ(cpu.publication.transport, "shm");
  expect_error(tiny_model + "runtime: {tp_size: 1, devices: [cuda:0]}\n"
                            "publication: {transport: shm}\n",
               "publication.transport",
               "transport 'shm' needs cpu:N devices, but runtime.devices[0] is 'cuda:0'");
  expect_error(tiny_model + "publication: {transport: cuda_ipc}\n", "publication.transport",
               "transport 'cuda_ipc' needs cuda:N devices, but runtime.devices[0] is 'cpu:0'");
}

TEST(ConfigMode, PackedByDefaultDirectOnRequestAnythingElseNamesTheKey) {
  EXPECT_EQ(config::parse_yaml(tiny_model).publication.mode, "packed");
  EXPECT_EQ(config::parse_yaml(tiny_model + "publication: {mode: direct}\n").publication.mode,
            "direct");
  expect_error(tiny_model + "publication: {mode: staged}\n", "publication.mode", "staged");
  // The direct write fault needs the direct mode.
  expect_error(tiny_model + "trainer: {faults: [{rank: 0, kind: fail_copy, chunk: 1}]}\n",
               "trainer.faults[0].kind", "needs publication.mode direct");
  const auto emitted = config::to_yaml(config::parse_yaml(tiny_model + "publication: {mode: direct}\n"));
  EXPECT_EQ(config::parse_yaml(emitted).publication.mode, "direct") << "to_yaml keeps the mode";
}

TEST(ConfigEngine, ComputeDtypeAndMaxBatchAreCheckedAndKept) {
  const auto d = config::parse_yaml(tiny_model);
  EXPECT_EQ(d.runtime.compute_dtype, "auto");
  EXPECT_EQ(d.runtime.max_batch, 256u);
  expect_error(tiny_model + "runtime: {compute_dtype: fp8}\n", "runtime.compute_dtype", "'fp8'");
  expect_error(tiny_model + "runtime: {max_batch: 0}\n", "runtime.max_batch", "out of range");
  const auto set = config::parse_yaml(tiny_model + "runtime: {compute_dtype: bfloat16, max_batch: 8}\n");
  const auto again = config::parse_yaml(config::to_yaml(set));
  EXPECT_EQ(again.runtime.compute_dtype, "bfloat16") << "to_yaml keeps the compute dtype";
  EXPECT_EQ(again.runtime.max_batch, 8u);
  // The bf16 engine reads bf16 residents.
  std::string fp32_model = tiny_model;
  fp32_model.replace(fp32_model.find("vocab_size: 256}"), 16, "vocab_size: 256, torch_dtype: float32}");
  expect_error(fp32_model + "runtime: {compute_dtype: bfloat16}\n", "runtime.compute_dtype",
               "needs a bfloat16 model");
}

// Every shipped recipe is valid, and its transport matches its devices.
TEST(ConfigRecipes, EveryShippedRecipeLoads) {
  for (const char* file : {"/configs/tiny-cpu.yaml", "/configs/tiny-synthetic.yaml", "/configs/bench-cpu.yaml",
                           "/configs/tiny-gpu.yaml", "/configs/qwen3-30b-a3b.yaml",
                           "/configs/qwen3-30b-a3b-tp4.yaml", "/configs/qwen3-30b-a3b-tp1.yaml"}) {
    const auto cfg = config::load_file(source_dir + file);
    const bool gpu = cfg.runtime.devices.front().rfind("cuda:", 0) == 0;
    EXPECT_EQ(cfg.publication.transport, gpu ? "cuda_ipc" : "shm") << file;
    EXPECT_EQ(cfg.runtime.devices.size(), cfg.runtime.tp_size) << file;
  }
}

TEST(ConfigModel, DenseQwen3NeedsIntermediateSizeAndRoundTrips) {
  const std::string dense =
    "model: {model_type: qwen3, num_hidden_layers: 2, hidden_size: 64, num_attention_heads: 4,"
    " num_key_value_heads: 2, head_dim: 16, intermediate_size: 96, vocab_size: 256,"
    " tie_word_embeddings: true}\n";
  const auto cfg = refit::config::parse_yaml(dense, "dense.yaml");
  EXPECT_TRUE(cfg.model.dense());
  EXPECT_EQ(cfg.model.num_experts, 1u);
  EXPECT_EQ(cfg.model.num_experts_per_tok, 1u);
  EXPECT_EQ(cfg.model.moe_intermediate_size, 96u);
  const auto again = refit::config::parse_model_yaml(refit::config::model_to_yaml(cfg.model), "m");
  EXPECT_EQ(refit::config::model_to_yaml(again), refit::config::model_to_yaml(cfg.model));
  std::string missing = dense;
  missing.replace(missing.find(" intermediate_size: 96,"), 23, "");
  expect_error(missing, "model.intermediate_size", "required key is missing");
}
