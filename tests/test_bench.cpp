// refit-bench smoke tests: the JSON report of a tiny publication benchmark is complete and
// self-consistent (no timing assertions), failures are one line and a non-zero exit, and the
// streaming bulk copies the publication path uses are byte-identical to memcpy.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <sys/wait.h>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "run_command.hpp"
#include "runtime/publication/host_buffer.hpp"

namespace {

using json = nlohmann::json;

std::string bench_exe() {
  std::string runtime = REFIT_RUNTIME_EXE;
  return runtime.substr(0, runtime.rfind('/') + 1) + "refit-bench";
}

using run_result = refit::testing::command_result;

run_result run(const std::string& args) {
  return refit::testing::run_command(bench_exe() + " " + args);
}

std::string tiny_config() { return std::string(REFIT_SOURCE_DIR) + "/configs/tiny-synthetic.yaml"; }

TEST(Bench, PublishReportIsCompleteAndConsistent) {
  auto r = run("publish --config " + tiny_config()
               + " --iterations 3 --verify --json --bound-reps 3 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  json j = json::parse(r.out);
  for (const char* key :
       {"tensors", "bytes", "chunks", "trainer_ranks", "tp", "seconds", "gbps", "bound_gbps",
        "ratio", "peak_extra_bytes", "verified", "iterations", "seconds_all", "config",
        "buffer_bytes", "buffer_count", "bound_method"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["iterations"], 3);
  ASSERT_EQ(j["seconds_all"].size(), 3u);
  EXPECT_EQ(j["trainer_ranks"], 2);
  EXPECT_EQ(j["tp"], 2);
  EXPECT_GT(j["tensors"].get<std::uint64_t>(), 0u);
  EXPECT_GT(j["chunks"].get<std::uint32_t>(), 1u);
  EXPECT_EQ(j["buffer_bytes"], 65536);
  EXPECT_EQ(j["buffer_count"], 2);
  EXPECT_EQ(j["config"], tiny_config());
  EXPECT_TRUE(j["verified"].get<bool>());

  const double bytes = j["bytes"].get<double>();
  const double seconds = j["seconds"].get<double>();
  const double gbps = j["gbps"].get<double>();
  const double bound = j["bound_gbps"].get<double>();
  ASSERT_GT(seconds, 0.0);
  ASSERT_GT(bound, 0.0);
  EXPECT_NEAR(gbps, bytes / seconds / 1e9, 1e-9 * gbps);
  EXPECT_NEAR(j["ratio"].get<double>(), gbps / bound, 1e-9 * gbps / bound);
  // seconds is the median of seconds_all.
  std::vector<double> all = j["seconds_all"].get<std::vector<double>>();
  std::sort(all.begin(), all.end());
  EXPECT_DOUBLE_EQ(seconds, all[1]);
  EXPECT_NE(j["bound_method"].get<std::string>().find("memcpy"), std::string::npos);
}

TEST(Bench, RegisteredSourcePublishesTheSameBytesVerified) {
  auto synth = run("publish --config " + tiny_config() + " --iterations 1 --json 2>/dev/null");
  auto reg = run("publish --config " + tiny_config()
                 + " --iterations 2 --verify --json --source registered 2>/dev/null");
  ASSERT_EQ(synth.exit_code, 0) << synth.out;
  ASSERT_EQ(reg.exit_code, 0) << reg.out;
  json a = json::parse(synth.out), b = json::parse(reg.out);
  EXPECT_EQ(a["source"], "synthetic");
  EXPECT_EQ(b["source"], "registered");
  EXPECT_EQ(a["bytes"], b["bytes"]);
  EXPECT_EQ(a["tensors"], b["tensors"]);
  EXPECT_EQ(a["chunks"], b["chunks"]);
  EXPECT_TRUE(b["verified"].get<bool>()) << "digest terms of the registered memory == receipts";
  auto bad = run("publish --config " + tiny_config() + " --source torch 2>&1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--source"), std::string::npos) << bad.out;
}

TEST(Bench, MissingConfigIsOneErrorLineAndNonZeroExit) {
  auto r = run("publish --config /nonexistent/bench.yaml --json 2>&1");
  EXPECT_NE(r.exit_code, 0);
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/bench.yaml"), std::string::npos) << r.out;
}

TEST(Bench, BadConfigValueNamesTheKey) {
  char path[] = "/tmp/refit-bench-test-XXXXXX";
  int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  {
    std::ifstream in(tiny_config());
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto at = text.find("buffer_count: 2");
    ASSERT_NE(at, std::string::npos);
    text.replace(at, 15, "buffer_count: -3");
    std::ofstream(path) << text;
  }
  auto r = run(std::string("publish --config ") + path + " 2>&1");
  ::unlink(path);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.out.find('\n'), r.out.size() - 1) << r.out;
  EXPECT_NE(r.out.find("publication.buffer_count"), std::string::npos) << r.out;
}

TEST(Bench, HelpExplainsEveryOption) {
  auto r = run("publish --help 2>&1");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* opt : {"--config", "--iterations", "--verify", "--json", "--bound-reps"})
    EXPECT_NE(r.out.find(opt), std::string::npos) << opt;
}

// refit-bench generate on the tiny recipe (TP 2, bf16 residents, fp32 CPU forward): every
// field present, tokens as requested, the decode bytes equal a calculation by hand from the
// model shape, ratios finite and positive, and the fp32 score reproduces the CPU engine's
// logprobs exactly. No timing bars.
TEST(Bench, GenerateReportIsCompleteAndConsistent) {
  const unsigned prompt = 20, tokens = 6;
  auto r = run("generate --config " + tiny_config() + " --batch 1,3 --prompt-len "
               + std::to_string(prompt) + " --max-tokens " + std::to_string(tokens)
               + " --repeat 2 --bound-bytes 16777216 --bound-reps 2 --seed 9 --json 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const json j = json::parse(r.out);
  for (const char* key : {"benchmark", "config", "model_type", "weights", "tp", "devices",
                          "prompt_len", "max_tokens", "temperature", "seed", "repeat",
                          "bound_method", "bound_bytes", "bound_seconds_all", "bytes_model",
                          "batches"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j["benchmark"], "generate");
  EXPECT_EQ(j["weights"], "synthetic");
  EXPECT_TRUE(j["engine_env"].is_object());
  EXPECT_EQ(j["tp"], 2);
  EXPECT_NE(j["bound_method"].get<std::string>().find("memcpy"), std::string::npos);
  EXPECT_EQ(j["bound_seconds_all"].size(), 2u * 2u * 2u) << "2 copies after each of 4 requests";

  // By hand, per TP rank (tp 2): 2 layers, hidden 64, 2 of 4 q heads, 1 of 2 KV heads, head_dim
  // 16, 4 experts of 16 of 32 intermediate rows, 128 of 256 vocab rows, bf16 (2 bytes).
  const double attention = 2 * ((2 + 2) * 16 * 64 + 64 * 2 * 16) * 2.0;
  const double norms = (2 * (2 * 16 + 2 * 64) + 64) * 2.0;
  const double router = 2 * 4 * 64 * 2.0, lm_head = 128 * 64 * 2.0;
  const double embedding_row = 64 * 2.0, expert = 3 * 16 * 64 * 2.0;
  const double kv_position = 2 * 2 * 1 * 16 * 4.0; // fp32 KV: layers x (k, v) x head x dim
  EXPECT_EQ(j["bytes_model"]["fixed_per_step"].get<double>(), attention + norms + router + lm_head);
  EXPECT_EQ(j["bytes_model"]["per_expert_load"].get<double>(), expert);
  // Memory of TP worker 0: its resident weights, the recipe's KV arena, no device workspace.
  EXPECT_GT(j["memory"]["weight_bytes"].get<double>(), 0.0);
  EXPECT_EQ(j["memory"]["kv_cache_bytes"].get<std::uint64_t>(), 4194304u) << "tiny-synthetic.yaml";
  EXPECT_EQ(j["memory"]["peak_workspace_bytes"].get<std::uint64_t>(), 0u) << "CPU";
  EXPECT_EQ(j["memory"]["total_bytes"].get<std::uint64_t>(),
            j["memory"]["weight_bytes"].get<std::uint64_t>()
              + j["memory"]["kv_cache_bytes"].get<std::uint64_t>());

  ASSERT_EQ(j["batches"].size(), 2u);
  for (const auto& b : j["batches"]) {
    const unsigned batch = b["batch"].get<unsigned>();
    SCOPED_TRACE("batch " + std::to_string(batch));
    for (const char* key : {"samples", "generated_tokens", "expected_tokens", "prompt_tokens",
                            "waves", "decode_steps", "decode_tokens", "prefill_seconds",
                            "prefill_tok_s", "ttft_seconds", "decode_seconds", "decode_tok_s",
                            "decode_step_seconds", "request_seconds", "decode_bytes_per_step",
                            "decode_gbps", "roofline_ratio", "bound_gbps", "expert_loads_source",
                            "decode_bytes_breakdown", "logprob_gap", "runs"})
      EXPECT_TRUE(b.contains(key)) << key;
    EXPECT_EQ(b["generated_tokens"], batch * tokens);
    EXPECT_EQ(b["expected_tokens"], batch * tokens);
    EXPECT_TRUE(b["all_finished_by_length"].get<bool>());
    EXPECT_EQ(b["prompt_tokens"], batch * prompt);
    EXPECT_EQ(b["computed_prompt_tokens"], batch * prompt) << "the prefix cache is reset";
    EXPECT_EQ(b["decode_steps"], tokens - 1);
    EXPECT_EQ(b["decode_tokens"], batch * (tokens - 1));
    for (const char* key : {"prefill_tok_s", "ttft_seconds", "decode_tok_s", "decode_step_seconds",
                            "decode_gbps", "roofline_ratio", "bound_gbps"}) {
      ASSERT_TRUE(b[key].is_number()) << key;
      EXPECT_TRUE(std::isfinite(b[key].get<double>())) << key;
      EXPECT_GT(b[key].get<double>(), 0.0) << key;
    }
    EXPECT_NE(b["expert_loads_source"].get<std::string>().find("counted"), std::string::npos);
    ASSERT_EQ(b["runs"].size(), 2u);
    const double bound = b["bound_gbps"].get<double>();
    for (const auto& run : b["runs"]) {
      const double steps = run["decode_steps"].get<double>();
      ASSERT_EQ(steps, tokens - 1);
      EXPECT_EQ(run["decode_tokens"].get<double>(), batch * steps);
      EXPECT_EQ(run["max_live_samples"].get<unsigned>(), batch) << "one admission, no stops";
      EXPECT_EQ(run["graph_replays"].get<unsigned>(), 0u) << "no CUDA graphs on the CPU";
      EXPECT_EQ(run["preload_gemms"].get<unsigned>(), 0u) << "no preloading GEMM on the CPU";
      // Step k feeds position prompt + k - 1 of every sample and attends prompt + k positions.
      double kv = 0;
      for (unsigned k = 1; k < tokens; ++k)
        kv += batch * (prompt + k);
      EXPECT_EQ(run["decode_kv_positions"].get<double>(), kv);
      const double loads = run["decode_expert_loads"].get<double>() / steps;
      EXPECT_GE(loads, 2 * 2.0) << "2 layers x top-2";
      EXPECT_LE(loads, 2 * std::min(4.0, 2.0 * batch));
      const double want = attention + norms + router + lm_head + batch * embedding_row
                          + loads * expert + kv / steps * kv_position + batch * kv_position;
      EXPECT_DOUBLE_EQ(run["decode_bytes_per_step"].get<double>(), want);
      const double step = run["decode_seconds"].get<double>() / steps;
      EXPECT_NEAR(run["roofline_ratio"].get<double>(), want / step / 1e9 / bound,
                  1e-9 * run["roofline_ratio"].get<double>());
    }
    const auto& bd = b["decode_bytes_breakdown"];
    EXPECT_DOUBLE_EQ(bd["total"].get<double>(),
                     bd["attention"].get<double>() + bd["norms"].get<double>()
                       + bd["router"].get<double>() + bd["lm_head"].get<double>()
                       + bd["embedding"].get<double>() + bd["experts"].get<double>()
                       + bd["kv_read"].get<double>() + bd["kv_write"].get<double>());
    const auto& gap = b["logprob_gap"];
    ASSERT_TRUE(gap["compared"].get<bool>());
    EXPECT_EQ(gap["tokens"], batch * tokens);
    EXPECT_EQ(gap["max_abs"].get<double>(), 0.0) << "the CPU engine is the fp32 forward";
    EXPECT_EQ(gap["mean_abs"].get<double>(), 0.0);
  }
}

// The engine knobs set for a run are in its report (which kernels a result measured); the
// others are not.
TEST(Bench, GenerateRecordsTheEngineKnobsThatWereSet) {
  auto r = refit::testing::run_command(
    "env -u REFIT_EXPERT_MMA_MAX_COPIES REFIT_EXPERT_MMA_CHUNKS=2 REFIT_PDL=0 " + bench_exe()
    + " generate --config " + tiny_config()
    + " --batch 1 --prompt-len 8 --max-tokens 2 --repeat 1 --no-gap --bound-bytes 1048576"
      " --bound-reps 1 --json 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const json j = json::parse(r.out);
  EXPECT_EQ(j["engine_env"]["REFIT_EXPERT_MMA_CHUNKS"], "2");
  EXPECT_EQ(j["engine_env"]["REFIT_PDL"], "0");
  EXPECT_FALSE(j["engine_env"].contains("REFIT_EXPERT_MMA_MAX_COPIES"));
}

TEST(Bench, GenerateAtAnotherTemperatureSaysWhyTheGapIsNotCompared) {
  auto r = run("generate --config " + tiny_config()
               + " --batch 2 --prompt-len 5 --max-tokens 2 --repeat 1 --temperature 0.7 "
                 "--bound-bytes 1048576 --json 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto gap = json::parse(r.out)["batches"][0]["logprob_gap"];
  EXPECT_FALSE(gap["compared"].get<bool>());
  EXPECT_NE(gap["reason"].get<std::string>().find("temperature"), std::string::npos);
}

TEST(Bench, GenerateRefusesABadBatchList) {
  auto r = run("generate --config " + tiny_config() + " --batch 1,0 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("--batch"), std::string::npos) << r.out;
}

// The streaming copies must equal memcpy for every alignment and size around the thresholds.
TEST(BulkCopy, MatchesMemcpyForAnyAlignmentAndSize) {
  using refit::publication::bulk_copy;
  using refit::publication::bulk_copy_rows;
  const std::size_t max = refit::publication::streaming_copy_min_bytes * 3;
  std::vector<std::byte> src(max + 256), dst(max + 256), want(max + 256);
  for (std::size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<std::byte>((i * 131 + 7) & 0xff);
  const std::size_t min = refit::publication::streaming_copy_min_bytes;
  for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{100}, min - 1, min,
                            min + 1, min + 63, 2 * min + 129, max}) {
    for (std::size_t doff : {0, 1, 17, 63, 64}) {
      for (std::size_t soff : {0, 3, 64}) {
        std::fill(dst.begin(), dst.end(), std::byte{0xAA});
        want = dst;
        std::memcpy(want.data() + doff, src.data() + soff, bytes);
        bulk_copy(dst.data() + doff, src.data() + soff, bytes);
        ASSERT_EQ(dst, want) << "bytes " << bytes << " dst+" << doff << " src+" << soff;
      }
    }
  }
  // One source to several destinations (the all-gather's push), with equal and with mixed
  // cache-line offsets.
  using refit::publication::bulk_copy_to_all;
  for (std::size_t bytes : {std::size_t{100}, min, 2 * min + 129}) {
    for (std::vector<std::size_t> offs :
         {std::vector<std::size_t>{0}, {0, 64 * 40}, {17, 17 + 64 * 50, 17 + 64 * 100},
          {0, 3 + 64 * 40}}) {
      std::vector<std::byte> out(offs.size() * (bytes + 192) + 64, std::byte{0x11});
      auto expect = out;
      std::vector<std::byte*> dsts;
      for (std::size_t off : offs) {
        off = off % 64 + (dsts.size() * (bytes + 128) / 64) * 64; // disjoint, keeps off % 64
        dsts.push_back(out.data() + off);
        std::memcpy(expect.data() + off, src.data() + 5, bytes);
      }
      bulk_copy_to_all(dsts.data(), dsts.size(), src.data() + 5, bytes);
      ASSERT_EQ(out, expect) << "bytes " << bytes << " destinations " << dsts.size();
    }
  }
  // Strided rows (a TP column slice): 512-byte rows out of 1024-byte rows, and short rows.
  for (std::size_t row : {std::size_t{40}, std::size_t{512}, std::size_t{777}}) {
    const std::size_t rows = max / (2 * row + 64);
    std::fill(dst.begin(), dst.end(), std::byte{0x55});
    want = dst;
    for (std::size_t r = 0; r < rows; ++r)
      std::memcpy(want.data() + 5 + r * (row + 3), src.data() + 1 + r * 2 * row, row);
    bulk_copy_rows(dst.data() + 5, row + 3, src.data() + 1, 2 * row, row, rows);
    ASSERT_EQ(dst, want) << "row " << row;
  }
}

} // namespace
