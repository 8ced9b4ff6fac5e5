// The README's main job: refit-coordinator runs the colocated loop end to end (real runtime
// child, trainer ranks, publications, generation, parity against the trainer's reference).
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <unistd.h>
#include <nlohmann/json.hpp>

namespace {

struct run_result {
  int exit_code = -1;
  std::string out;
  std::string err;
};

run_result run(const std::string& args) {
  // One file per test and process: ctest -j runs the tests of this binary side by side.
  std::string err_file = ::testing::TempDir() + "refit-coordinator-"
                         + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "-"
                         + std::to_string(::getpid()) + ".stderr";
  std::string cmd = std::string(REFIT_COORDINATOR_EXE) + " " + args + " 2>" + err_file;
  run_result r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe)
    return r;
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), buf.size(), pipe))
    r.out += buf.data();
  int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  return r;
}

std::string write_config(const std::string& name, const std::string& extra) {
  std::ifstream in(std::string(REFIT_SOURCE_DIR) + "/configs/tiny-cpu.yaml");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  // The copy lives elsewhere: the model directory must stay where configs/ points.
  const std::string rel = "path: ../tests/data/models/tiny-kjv";
  if (const auto pos = text.find(rel); pos != std::string::npos)
    text.replace(pos, rel.size(), "path: " + std::string(REFIT_SOURCE_DIR) + "/tests/data/models/tiny-kjv");
  std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text << extra;
  return path;
}

TEST(MainJob, JsonLinesPerIterationWithParity) {
  auto r = run("--json --iterations 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(lines, line))
    rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 3u) << "bootstrap generation + 2 iterations";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    for (const char* key : {"version", "publish_ms", "publish_gbps", "tokens_per_s",
                            "mean_logprob", "parity_max_abs"})
      ASSERT_TRUE(row.contains(key)) << key << " missing in " << row.dump();
    EXPECT_EQ(row["version"].get<std::uint64_t>(), i);
    EXPECT_TRUE(row["parity_ok"].get<bool>());
    EXPECT_LE(row["parity_max_abs"].get<double>(), 1e-3);
    EXPECT_GT(row["tokens"].get<std::uint64_t>(), 0u);
    EXPECT_LT(row["mean_logprob"].get<double>(), 0.0);
    if (i > 0) {
      EXPECT_GT(row["publish_ms"].get<double>(), 0.0);
      EXPECT_GT(row["chunks"].get<std::uint32_t>(), 1u);
    }
  }
}

TEST(MainJob, ParityOutsideTheToleranceExitsNonZero) {
  // The runtime reports every logprob 0.5 too high (a test fault after the real generation):
  // the trainer's reference forward disagrees by exactly that, far outside the tolerance.
  // (A tiny tolerance is no test: fp32 runs with an exact 0 delta exist.)
  auto r = run("--json --iterations 1 --fault runtime:generate:skew_logprobs:1");
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("parity check failed"), std::string::npos) << r.err;
  std::istringstream lines(r.out);
  std::string line, last;
  while (std::getline(lines, line))
    last = line;
  ASSERT_FALSE(last.empty()) << r.err;
  auto row = nlohmann::json::parse(last);
  EXPECT_FALSE(row["parity_ok"].get<bool>());
  EXPECT_NEAR(row["parity_max_abs"].get<double>(), 0.5, 1e-3);
}

TEST(MainJob, FaultIsRecoveredByRepublishOnTheRestartedRuntime) {
  auto r = run("--json --iterations 1 --fault runtime:update_weights:sigkill:1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line, last;
  while (std::getline(lines, line))
    last = line;
  auto row = nlohmann::json::parse(last);
  EXPECT_EQ(row["version"].get<std::uint64_t>(), 1u);
  EXPECT_EQ(row["publish_attempts"].get<std::uint32_t>(), 2u);
  EXPECT_NE(row["recovered_error"].get<std::string>().find("runtime_exited"), std::string::npos);
  EXPECT_TRUE(row["parity_ok"].get<bool>()) << "the fresh runtime generates with the new weights";
}

TEST(MainJob, BadFaultSpecNamesTheProblem) {
  auto r = run("--fault runtime:update_weights:melt");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("runtime.faults[0].kind: 'melt' is not one of"), std::string::npos) << r.err;
}

TEST(MainJob, BadConfigNamesTheKey) {
  auto path = write_config("bad-key.yaml", "\nextra_section: {a: 1}\n");
  auto r = run("--config " + path);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("extra_section: unknown key"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty());
}

TEST(MainJob, HelpExplainsTheOptions) {
  auto r = run("--help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* opt : {"--config", "--iterations", "--json"})
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt;
}

} // namespace

// A copy of the committed tiny checkpoint that a test may damage.
static std::string copy_of_tiny_model(const std::string& name) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::copy(std::string(REFIT_SOURCE_DIR) + "/tests/data/models/tiny-kjv", dir);
  return dir.string();
}

TEST(MainJobModel, TextInTextOutFromTheCommittedCheckpoint) {
  auto r = run("--json --iterations 0 --temperature 0 --max-tokens 12 --prompt 'And God said'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto row = nlohmann::json::parse(r.out.substr(0, r.out.find('\n')));
  EXPECT_EQ(row["version"].get<std::uint64_t>(), 0u);
  const auto& s = row["samples"][0];
  EXPECT_EQ(s["prompt"], "And God said");
  // HF transformers' greedy continuation of this prompt (tests/data/models/tiny-kjv/golden.json).
  std::ifstream in(std::string(REFIT_SOURCE_DIR) + "/tests/data/models/tiny-kjv/golden.json");
  const auto golden = nlohmann::json::parse(in)["prompts"][0];
  ASSERT_EQ(golden["text"], "And God said");
  EXPECT_EQ(s["prompt_token_ids"], golden["prompt_ids"]);
  EXPECT_EQ(s["token_ids"], golden["generated_ids"]);
  EXPECT_EQ(s["text"], golden["generated_text"]);
  EXPECT_EQ(s["finish_reason"], "length");
}

TEST(MainJobModel, ADamagedCheckpointIsOneErrorNamingFileAndTensorAndNothingIsServed) {
  const auto dir = copy_of_tiny_model("damaged-model");
  std::filesystem::resize_file(dir + "/model.safetensors", 1000000);
  auto r = run("--iterations 0 --model " + dir);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(dir + "/model.safetensors"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("model.embed_tokens.weight"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("refit-runtime["), std::string::npos) << "no runtime was started: " << r.err;
}

TEST(MainJobModel, AnUnsupportedConfigFieldIsNamed) {
  const auto dir = copy_of_tiny_model("yarn-model");
  std::ifstream in(dir + "/config.json");
  auto cfg = nlohmann::json::parse(in);
  in.close();
  cfg["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  std::ofstream(dir + "/config.json") << cfg.dump(2);
  auto r = run("--iterations 0 --model " + dir);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("rope_scaling"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("yarn"), std::string::npos) << r.err;
}
