// Process tests of the refit-runtime child executable: spawn the real binary, talk control
// frames over its socket, and observe state, memory (RssAnon), exit codes and faults.
#include <gtest/gtest.h>

#include "runtime/checkpoint/source.hpp"

#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <stdexcept>
#include <set>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "messages/control.pb.h"
#include "runtime/config/config.hpp"
#include "runtime/device/device.hpp"
#include "runtime/control/framing.hpp"
#include "runtime/inference/reference.hpp"
#include "runtime/model/digest.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"
#include "runtime/publication/direct_plan.hpp"
#include "runtime/control/process.hpp"
#include "runtime/control/protocol.hpp"
#include "runtime/control/protocol_version.hpp"
#include "runtime/publication/host_buffer.hpp"

namespace {

namespace pb = refit::control::v1;
namespace proc = refit::proc;
namespace wire = refit::wire;
using namespace std::chrono_literals;

const std::string tiny_model =
  "{model_type: qwen3_moe, num_hidden_layers: 2, hidden_size: 64, num_attention_heads: 4, "
  "num_key_value_heads: 2, head_dim: 16, num_experts: 4, num_experts_per_tok: 2, "
  "moe_intermediate_size: 32, vocab_size: 256, tie_word_embeddings: false, "
  "torch_dtype: bfloat16}";

constexpr std::uint64_t small_kv_bytes = 4u << 20;
constexpr std::uint64_t large_kv_bytes = 64u << 20;
constexpr auto call_timeout = 10s;

struct runtime_args {
  std::uint32_t tp = 1;
  std::uint64_t kv_cache_bytes = small_kv_bytes;
  std::vector<std::string> faults;
};

runtime_args args_for(std::uint32_t tp, std::uint64_t kv_cache_bytes = small_kv_bytes) {
  runtime_args a;
  a.tp = tp;
  a.kv_cache_bytes = kv_cache_bytes;
  return a;
}

std::vector<std::string> command_line(const runtime_args& a) {
  std::string devices;
  for (std::uint32_t i = 0; i < a.tp; ++i)
    devices += (i ? ",cpu:" : "cpu:") + std::to_string(i);
  std::vector<std::string> args = {"--control-fd", "3",
                                   "--tp", std::to_string(a.tp),
                                   "--devices", devices,
                                   "--model", tiny_model,
                                   "--kv-cache-bytes", std::to_string(a.kv_cache_bytes),
                                   "--max-frame-bytes", "67108864",
                                   "--seed", "1234"};
  for (const auto& f : a.faults) {
    args.push_back("--fault");
    args.push_back(f);
  }
  return args;
}

refit::model::tp_layout tiny_layout(std::uint32_t tp) {
  return refit::model::tp_layout(refit::config::parse_model_yaml(tiny_model, "test"), tp);
}

// A spawned refit-runtime; always terminated and reaped when the test ends.
class runtime_child {
public:
  explicit runtime_child(const std::vector<std::string>& args) {
    proc::spawn_options opts;
    opts.executable = REFIT_RUNTIME_EXE;
    opts.args = args;
    child_ = proc::spawn_child(opts);
  }
  explicit runtime_child(const runtime_args& a) : runtime_child(command_line(a)) {}
  runtime_child(const runtime_child&) = delete;
  runtime_child& operator=(const runtime_child&) = delete;

  ~runtime_child() {
    close_channel();
    if (!exit_)
      proc::terminate_group(child_.pid, 2000ms);
  }

  pid_t pid() const { return child_.pid; }
  int fd() const { return child_.control_fd; }

  // A request for `command` with its (empty) payload and a fresh request id.
  pb::Request request(pb::Command command) {
    auto req = refit::protocol::make_request(next_request_id_++, command);
    const auto* field =
      pb::Request::descriptor()->FindFieldByNumber(refit::protocol::payload_case_for(command));
    req.GetReflection()->MutableMessage(&req, field);
    return req;
  }

  void send(const pb::Request& req) { send_bytes(req.SerializeAsString()); }

  void send_bytes(const std::string& payload) {
    auto st = wire::write_frame(fd(), payload, wire::default_max_frame_bytes,
                                wire::clock::now() + call_timeout);
    if (!st)
      throw std::runtime_error(std::string("write_frame: ") + wire::to_string(st.code) + ": "
                               + st.message);
  }

  wire::frame_status receive(pb::Response& rsp, std::chrono::milliseconds timeout = call_timeout) {
    std::string payload;
    auto st = wire::read_frame(fd(), payload, wire::default_max_frame_bytes,
                               wire::clock::now() + timeout);
    if (st && !rsp.ParseFromString(payload))
      throw std::runtime_error("the child answered a frame that is not a Response");
    return st;
  }

  pb::Response call(const pb::Request& req) {
    send(req);
    pb::Response rsp;
    auto st = receive(rsp);
    if (!st)
      throw std::runtime_error("no response to " + std::string(refit::protocol::command_name(
                                                      req.command()))
                               + ": " + wire::to_string(st.code) + ": " + st.message);
    return rsp;
  }

  pb::Response call(pb::Command command) { return call(request(command)); }

  pb::DescribeResult describe() {
    auto rsp = call(pb::COMMAND_DESCRIBE);
    if (!rsp.ok() || !rsp.has_describe())
      throw std::runtime_error("describe failed: " + rsp.error().message());
    return rsp.describe();
  }

  pb::Response sleep(std::uint32_t level) {
    auto req = request(pb::COMMAND_SLEEP);
    req.mutable_sleep()->set_level(level);
    return call(req);
  }

  pb::Response wake_up(const std::vector<int>& tags) {
    auto req = request(pb::COMMAND_WAKE_UP);
    for (int tag : tags)
      req.mutable_wake_up()->add_tags(static_cast<pb::WakeTag>(tag));
    return call(req);
  }

  void close_channel() {
    if (child_.control_fd >= 0)
      ::close(child_.control_fd);
    child_.control_fd = -1;
  }

  // Waits for the child to exit on its own.
  std::optional<proc::exit_info> wait_exit(std::chrono::milliseconds timeout = 10s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!exit_ && std::chrono::steady_clock::now() < deadline) {
      exit_ = proc::try_reap(child_.pid);
      if (!exit_)
        std::this_thread::sleep_for(10ms);
    }
    return exit_;
  }

  proc::exit_info terminate() {
    exit_ = proc::terminate_group(child_.pid, 2000ms);
    return *exit_;
  }

private:
  proc::child_process child_;
  std::optional<proc::exit_info> exit_;
  std::uint64_t next_request_id_ = 1;
};

void expect_error(const pb::Response& rsp, pb::ErrorCode code, const std::string& where) {
  EXPECT_FALSE(rsp.ok());
  EXPECT_TRUE(rsp.has_error());
  EXPECT_EQ(rsp.result_case(), pb::Response::RESULT_NOT_SET);
  EXPECT_EQ(rsp.error().code(), code) << pb::ErrorCode_Name(rsp.error().code()) << ": "
                                      << rsp.error().message();
  EXPECT_EQ(rsp.error().where(), where) << rsp.error().message();
  EXPECT_FALSE(rsp.error().message().empty());
}

// ---------------------------------------------------------------------------- describe

class DescribeTest : public ::testing::TestWithParam<std::uint32_t> {};

TEST_P(DescribeTest, ReportsRuntimeAndWorkers) {
  const std::uint32_t tp = GetParam();
  runtime_child child(args_for(tp));
  auto req = child.request(pb::COMMAND_DESCRIBE);
  auto rsp = child.call(req);
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  EXPECT_EQ(rsp.protocol_version(), refit::wire::protocol_version);
  EXPECT_EQ(rsp.request_id(), req.request_id());
  EXPECT_EQ(rsp.command(), pb::COMMAND_DESCRIBE);
  EXPECT_FALSE(rsp.has_error());
  ASSERT_EQ(rsp.result_case(), pb::Response::kDescribe);

  const auto layout = tiny_layout(tp);
  const auto& d = rsp.describe();
  EXPECT_EQ(d.runtime_kind(), "refit-runtime");
  EXPECT_FALSE(d.runtime_version().empty());
  EXPECT_EQ(d.tp_world_size(), tp);
  EXPECT_EQ(d.sleep_level(), 0u);
  EXPECT_TRUE(d.weights_awake());
  EXPECT_TRUE(d.kv_cache_awake());
  EXPECT_EQ(d.model_version(), 0u);
  EXPECT_TRUE(d.weights_valid());
  EXPECT_EQ(d.pid(), static_cast<std::uint32_t>(child.pid()));
  ASSERT_EQ(d.workers_size(), static_cast<int>(tp));
  for (std::uint32_t i = 0; i < tp; ++i) {
    const auto& w = d.workers(static_cast<int>(i));
    EXPECT_EQ(w.rank(), i);
    EXPECT_EQ(w.device_index(), static_cast<int>(i));
    EXPECT_EQ(w.device_uuid(), refit::device::cpu_uuid(static_cast<int>(i)));
    EXPECT_EQ(w.weight_bytes_resident(), refit::publication::resident_arena_bytes(layout));
    EXPECT_EQ(w.kv_cache_bytes_resident(), small_kv_bytes);
    EXPECT_EQ(w.weight_bytes_offloaded(), 0u);
    EXPECT_GT(w.device_free_bytes(), 0u);
    EXPECT_EQ(w.resident_tensor_count(), layout.residents().size());
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, DescribeTest, ::testing::Values(1u, 2u),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

TEST(DescribeCheckpoint, ReportsWhatWasLoadedFromAModelDirectory) {
  const std::string dir = std::string(REFIT_SOURCE_DIR) + "/tests/data/models/tiny-qwen3";
  const auto cfg = refit::checkpoint::read_model_config(dir);
  auto args = command_line(args_for(2));
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--model")
      args[i + 1] = refit::config::model_to_yaml(cfg);
  args.push_back("--checkpoint");
  args.push_back(dir);
  runtime_child child(args);
  auto rsp = child.call(child.request(pb::COMMAND_DESCRIBE));
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  const auto& c = rsp.describe().checkpoint();
  const auto source = refit::checkpoint::model_source::open(dir, cfg);
  EXPECT_EQ(c.path(), dir);
  EXPECT_EQ(c.tensors(), source->tensor_count());
  EXPECT_EQ(c.bytes(), source->bytes());
  EXPECT_EQ(c.fingerprint(), refit::model::structural_manifest(refit::model::expected_key_stream(cfg)));
  EXPECT_GT(c.load_seconds(), 0.0);
  EXPECT_TRUE(rsp.describe().weights_valid());
}

TEST(DescribeCheckpoint, AModelDirectoryThatDoesNotFitIsFatalBeforeServing) {
  // The tiny synthetic model's shape against tiny-qwen3's files: every tensor mismatches.
  auto args = command_line(args_for(1));
  args.push_back("--checkpoint");
  args.push_back(std::string(REFIT_SOURCE_DIR) + "/tests/data/models/tiny-qwen3");
  runtime_child child(args);
  try {
    child.send(child.request(pb::COMMAND_DESCRIBE));
  } catch (const std::exception&) {
    // the child may be gone before the request is written
  }
  pb::Response rsp;
  const auto st = child.receive(rsp, 20s);
  ASSERT_FALSE(st) << "the runtime answered although its checkpoint does not load";
  EXPECT_EQ(st.code, wire::frame_errc::eof) << "it exited instead of hanging: "
                                            << wire::to_string(st.code);
}

// ---------------------------------------------------------------------------- sleep / wake

constexpr std::uint64_t rss_slack = 8u << 20;

TEST(RuntimeChildMemory, SleepLevel1OffloadsWeightsAndWakeRestoresThem) {
  runtime_child child(args_for(2, large_kv_bytes));
  const auto layout = tiny_layout(2);
  const std::uint64_t per_worker = refit::publication::resident_arena_bytes(layout) + large_kv_bytes;
  ASSERT_TRUE(child.describe().kv_cache_awake()); // answered only once startup is complete
  const std::uint64_t awake_rss = proc::rss_anon_bytes(child.pid());
  ASSERT_GT(awake_rss, 2 * per_worker);

  auto rsp = child.sleep(1);
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  ASSERT_EQ(rsp.result_case(), pb::Response::kSleep);
  const auto& slept = rsp.sleep().state();
  EXPECT_EQ(slept.sleep_level(), 1u);
  EXPECT_FALSE(slept.weights_awake());
  EXPECT_FALSE(slept.kv_cache_awake());
  EXPECT_TRUE(slept.weights_valid());
  for (const auto& w : slept.workers()) {
    EXPECT_EQ(w.weight_bytes_resident(), 0u);
    EXPECT_EQ(w.kv_cache_bytes_resident(), 0u);
    EXPECT_EQ(w.weight_bytes_offloaded(), refit::publication::resident_arena_bytes(layout));
    EXPECT_EQ(w.resident_tensor_count(), 0u);
  }
  const std::uint64_t asleep_rss = proc::rss_anon_bytes(child.pid());
  EXPECT_LE(asleep_rss + 2 * per_worker, awake_rss + rss_slack)
    << "awake " << awake_rss << " bytes, asleep " << asleep_rss << " bytes";

  rsp = child.wake_up({pb::WAKE_TAG_WEIGHTS});
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  ASSERT_EQ(rsp.result_case(), pb::Response::kWakeUp);
  const auto& weights_only = rsp.wake_up().state();
  EXPECT_TRUE(weights_only.weights_awake());
  EXPECT_FALSE(weights_only.kv_cache_awake());
  EXPECT_EQ(weights_only.sleep_level(), 1u);
  EXPECT_TRUE(weights_only.weights_valid());
  for (const auto& w : weights_only.workers()) {
    EXPECT_EQ(w.weight_bytes_resident(), refit::publication::resident_arena_bytes(layout));
    EXPECT_EQ(w.weight_bytes_offloaded(), 0u);
    EXPECT_EQ(w.kv_cache_bytes_resident(), 0u);
    EXPECT_EQ(w.resident_tensor_count(), layout.residents().size());
  }

  rsp = child.wake_up({pb::WAKE_TAG_KV_CACHE});
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  const auto& awake = rsp.wake_up().state();
  EXPECT_TRUE(awake.weights_awake());
  EXPECT_TRUE(awake.kv_cache_awake());
  EXPECT_EQ(awake.sleep_level(), 0u);
  EXPECT_TRUE(awake.weights_valid());
  for (const auto& w : awake.workers())
    EXPECT_EQ(w.kv_cache_bytes_resident(), large_kv_bytes);
  const std::uint64_t woken_rss = proc::rss_anon_bytes(child.pid());
  EXPECT_GE(woken_rss + rss_slack, asleep_rss + 2 * per_worker)
    << "asleep " << asleep_rss << " bytes, woken " << woken_rss << " bytes";

  EXPECT_TRUE(child.describe().weights_valid());
}

TEST(RuntimeChildMemory, SleepLevel2DropsWeightsAndWakeLeavesThemInvalid) {
  runtime_child child(args_for(1, large_kv_bytes));
  const auto layout = tiny_layout(1);
  ASSERT_TRUE(child.describe().kv_cache_awake()); // answered only once startup is complete
  const std::uint64_t awake_rss = proc::rss_anon_bytes(child.pid());

  auto rsp = child.sleep(2);
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  const auto& slept = rsp.sleep().state();
  EXPECT_EQ(slept.sleep_level(), 2u);
  EXPECT_FALSE(slept.weights_valid());
  EXPECT_FALSE(slept.weights_awake());
  EXPECT_FALSE(slept.kv_cache_awake());
  ASSERT_EQ(slept.workers_size(), 1);
  EXPECT_EQ(slept.workers(0).weight_bytes_resident(), 0u);
  EXPECT_EQ(slept.workers(0).weight_bytes_offloaded(), 0u);
  EXPECT_EQ(slept.workers(0).kv_cache_bytes_resident(), 0u);
  const std::uint64_t asleep_rss = proc::rss_anon_bytes(child.pid());
  EXPECT_LE(asleep_rss + refit::publication::resident_arena_bytes(layout) + large_kv_bytes, awake_rss + rss_slack)
    << "awake " << awake_rss << " bytes, asleep " << asleep_rss << " bytes";

  rsp = child.wake_up({});
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  const auto& woken = rsp.wake_up().state();
  EXPECT_EQ(woken.sleep_level(), 0u);
  EXPECT_TRUE(woken.weights_awake());
  EXPECT_TRUE(woken.kv_cache_awake());
  EXPECT_FALSE(woken.weights_valid());
  EXPECT_EQ(woken.workers(0).weight_bytes_resident(), refit::publication::resident_arena_bytes(layout));
  EXPECT_EQ(woken.workers(0).resident_tensor_count(), 0u);
}

TEST(RuntimeChildMemory, SleepLevel2AfterLevel1DropsTheHostBackup) {
  runtime_child child(args_for(1));
  auto rsp = child.sleep(1);
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  EXPECT_GT(rsp.sleep().state().workers(0).weight_bytes_offloaded(), 0u);

  rsp = child.sleep(2);
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  EXPECT_EQ(rsp.sleep().state().sleep_level(), 2u);
  EXPECT_EQ(rsp.sleep().state().workers(0).weight_bytes_offloaded(), 0u);
  EXPECT_FALSE(rsp.sleep().state().weights_valid());

  rsp = child.wake_up({pb::WAKE_TAG_WEIGHTS, pb::WAKE_TAG_KV_CACHE});
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  EXPECT_FALSE(rsp.wake_up().state().weights_valid());
}

TEST(RuntimeChildMemory, RejectsInvalidSleepLevels) {
  runtime_child child(args_for(1));
  for (std::uint32_t level : {0u, 3u}) {
    expect_error(child.sleep(level), pb::ERROR_CODE_INVALID_ARGUMENT, "sleep.level");
  }
  auto d = child.describe();
  EXPECT_EQ(d.sleep_level(), 0u);
  EXPECT_TRUE(d.weights_awake());
  EXPECT_TRUE(d.kv_cache_awake());
}

TEST(RuntimeChildMemory, RejectsInvalidWakeTags) {
  runtime_child child(args_for(1));
  ASSERT_TRUE(child.sleep(1).ok());
  expect_error(child.wake_up({pb::WAKE_TAG_WEIGHTS, pb::WAKE_TAG_UNSPECIFIED}),
               pb::ERROR_CODE_INVALID_ARGUMENT, "wake_up.tags[1]");
  expect_error(child.wake_up({7}), pb::ERROR_CODE_INVALID_ARGUMENT, "wake_up.tags[0]");
  auto d = child.describe();
  EXPECT_FALSE(d.weights_awake()) << "a rejected wake_up must not change state";
  EXPECT_EQ(d.sleep_level(), 1u);
}

// ---------------------------------------------------------------------------- protocol

TEST(RuntimeChildProtocol, GenerateWithoutPromptsIsAnInvalidArgument) {
  runtime_child child(args_for(1));
  auto req = child.request(pb::COMMAND_GENERATE);
  auto rsp = child.call(req);
  EXPECT_EQ(rsp.request_id(), req.request_id());
  EXPECT_EQ(rsp.command(), pb::COMMAND_GENERATE);
  expect_error(rsp, pb::ERROR_CODE_INVALID_ARGUMENT, "generate.prompts");
  EXPECT_NE(rsp.error().message().find("no prompts"), std::string::npos) << rsp.error().message();
}

TEST(RuntimeChildProtocol, RejectsAnotherProtocolVersion) {
  runtime_child child(args_for(1));
  auto req = child.request(pb::COMMAND_DESCRIBE);
  req.set_protocol_version(refit::wire::protocol_version + 1);
  auto rsp = child.call(req);
  EXPECT_EQ(rsp.protocol_version(), refit::wire::protocol_version);
  EXPECT_EQ(rsp.request_id(), req.request_id());
  EXPECT_EQ(rsp.command(), pb::COMMAND_DESCRIBE);
  expect_error(rsp, pb::ERROR_CODE_PROTOCOL_VERSION, "protocol_version");
}

TEST(RuntimeChildProtocol, AnswersGarbagePayloadAsMalformedAndKeepsServing) {
  runtime_child child(args_for(1));
  // A valid frame whose payload is not a Request (wire type 7 does not exist).
  child.send_bytes(std::string("\x0f\x0f\x0f garbage", 11));
  pb::Response rsp;
  auto st = child.receive(rsp);
  ASSERT_TRUE(st) << st.message;
  EXPECT_EQ(rsp.request_id(), 0u);
  EXPECT_EQ(rsp.command(), pb::COMMAND_UNSPECIFIED);
  expect_error(rsp, pb::ERROR_CODE_MALFORMED, "request");
  EXPECT_EQ(child.describe().runtime_kind(), "refit-runtime");
}

TEST(RuntimeChildProtocol, RejectsPayloadThatDoesNotMatchTheCommand) {
  runtime_child child(args_for(1));
  auto req = child.request(pb::COMMAND_SLEEP);
  req.mutable_describe(); // replaces the sleep payload
  auto rsp = child.call(req);
  EXPECT_EQ(rsp.request_id(), req.request_id());
  EXPECT_EQ(rsp.command(), pb::COMMAND_SLEEP);
  expect_error(rsp, pb::ERROR_CODE_MALFORMED, "payload");

  req = child.request(pb::COMMAND_DESCRIBE);
  req.clear_payload();
  expect_error(child.call(req), pb::ERROR_CODE_MALFORMED, "payload");
  EXPECT_TRUE(child.describe().weights_awake()) << "a rejected sleep must not change state";
}

TEST(RuntimeChildProtocol, ResetPrefixCacheReportsDroppedEntries) {
  runtime_child child(args_for(1));
  auto rsp = child.call(pb::COMMAND_RESET_PREFIX_CACHE);
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  ASSERT_EQ(rsp.result_case(), pb::Response::kResetPrefixCache);
  EXPECT_EQ(rsp.reset_prefix_cache().entries_dropped(), 0u);
}

// ---------------------------------------------------------------------------- lifecycle

TEST(RuntimeChildLifecycle, ShutdownAnswersAndExitsCleanly) {
  runtime_child child(args_for(2));
  auto rsp = child.call(pb::COMMAND_SHUTDOWN);
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  EXPECT_EQ(rsp.result_case(), pb::Response::kShutdown);
  auto info = child.wait_exit();
  ASSERT_TRUE(info) << "the child did not exit after shutdown";
  EXPECT_TRUE(info->exited) << info->describe();
  EXPECT_EQ(info->code, 0) << info->describe();
  EXPECT_TRUE(proc::processes_in_group(child.pid()).empty());
}

TEST(RuntimeChildLifecycle, ExitsCleanlyWhenTheParentClosesTheChannel) {
  runtime_child child(args_for(2));
  ASSERT_TRUE(child.describe().weights_awake());
  child.close_channel();
  auto info = child.wait_exit();
  ASSERT_TRUE(info) << "the child did not exit after EOF on its control channel";
  EXPECT_TRUE(info->exited) << info->describe();
  EXPECT_EQ(info->code, 0) << info->describe();
  EXPECT_TRUE(proc::processes_in_group(child.pid()).empty());
}

// ---------------------------------------------------------------------------- faults

runtime_args with_fault(const std::string& fault) {
  runtime_args a;
  a.faults = {fault};
  return a;
}

TEST(RuntimeChildFaults, StallNeverAnswersButSigtermEndsIt) {
  runtime_child child(with_fault("describe:stall"));
  child.send(child.request(pb::COMMAND_DESCRIBE));
  pb::Response rsp;
  auto st = child.receive(rsp, 500ms);
  EXPECT_EQ(st.code, wire::frame_errc::timeout) << wire::to_string(st.code);
  EXPECT_FALSE(proc::try_reap(child.pid())) << "a stalled child must stay alive";
  auto info = child.terminate();
  EXPECT_EQ(info.signal, SIGTERM) << info.describe();
}

TEST(RuntimeChildFaults, ExitEndsWithCode3WithoutAnswering) {
  runtime_child child(with_fault("sleep:exit"));
  auto req = child.request(pb::COMMAND_SLEEP);
  req.mutable_sleep()->set_level(1);
  child.send(req);
  pb::Response rsp;
  auto st = child.receive(rsp);
  EXPECT_EQ(st.code, wire::frame_errc::eof) << wire::to_string(st.code);
  auto info = child.wait_exit();
  ASSERT_TRUE(info);
  EXPECT_TRUE(info->exited) << info->describe();
  EXPECT_EQ(info->code, 3) << info->describe();
}

TEST(RuntimeChildFaults, SigkillKillsTheChild) {
  runtime_child child(with_fault("describe:sigkill"));
  child.send(child.request(pb::COMMAND_DESCRIBE));
  pb::Response rsp;
  auto st = child.receive(rsp);
  EXPECT_EQ(st.code, wire::frame_errc::eof) << wire::to_string(st.code);
  auto info = child.wait_exit();
  ASSERT_TRUE(info);
  EXPECT_FALSE(info->exited) << info->describe();
  EXPECT_EQ(info->signal, SIGKILL) << info->describe();
}

TEST(RuntimeChildFaults, BadFrameIsNotAFrameHeader) {
  runtime_child child(with_fault("describe:bad_frame"));
  child.send(child.request(pb::COMMAND_DESCRIBE));
  pb::Response rsp;
  auto st = child.receive(rsp);
  EXPECT_EQ(st.code, wire::frame_errc::bad_magic) << wire::to_string(st.code) << ": "
                                                  << st.message;
}

TEST(RuntimeChildFaults, ErrorAnswersInjected) {
  runtime_child child(with_fault("sleep:error"));
  auto rsp = child.sleep(1);
  expect_error(rsp, pb::ERROR_CODE_INJECTED, "sleep");
  auto d = child.describe();
  EXPECT_EQ(d.sleep_level(), 0u) << "a faulted command must not change state";
  EXPECT_TRUE(d.weights_awake());
}

TEST(RuntimeChildFaults, WrongIdEchoesAnotherRequestId) {
  runtime_child child(with_fault("describe:wrong_id"));
  auto req = child.request(pb::COMMAND_DESCRIBE);
  auto rsp = child.call(req);
  EXPECT_EQ(rsp.request_id(), req.request_id() + 1);
  auto v = refit::protocol::validate_response(rsp, req.request_id(), req.command());
  ASSERT_TRUE(v);
  EXPECT_EQ(v->field, "request_id");
}

TEST(RuntimeChildFaults, WrongCommandEchoesAnotherCommand) {
  runtime_child child(with_fault("describe:wrong_command"));
  auto req = child.request(pb::COMMAND_DESCRIBE);
  auto rsp = child.call(req);
  EXPECT_EQ(rsp.request_id(), req.request_id());
  EXPECT_NE(rsp.command(), pb::COMMAND_DESCRIBE);
}

TEST(RuntimeChildFaults, WrongResultCarriesAnotherCommandsResult) {
  runtime_child child(with_fault("wake_up:wrong_result"));
  auto rsp = child.wake_up({});
  EXPECT_TRUE(rsp.ok());
  EXPECT_EQ(rsp.command(), pb::COMMAND_WAKE_UP);
  EXPECT_NE(rsp.result_case(), pb::Response::kWakeUp);
  EXPECT_NE(rsp.result_case(), pb::Response::RESULT_NOT_SET);
}

TEST(RuntimeChildFaults, WrongVersionEchoesVersion99) {
  runtime_child child(with_fault("reset_prefix_cache:wrong_version"));
  auto req = child.request(pb::COMMAND_RESET_PREFIX_CACHE);
  auto rsp = child.call(req);
  EXPECT_EQ(rsp.protocol_version(), 99u);
  EXPECT_EQ(rsp.request_id(), req.request_id());
}

TEST(RuntimeChildFaults, AfterCountsEarlierOccurrences) {
  runtime_child child(with_fault("describe:error:1"));
  EXPECT_TRUE(child.call(pb::COMMAND_DESCRIBE).ok());
  expect_error(child.call(pb::COMMAND_DESCRIBE), pb::ERROR_CODE_INJECTED, "describe");
  EXPECT_TRUE(child.call(pb::COMMAND_DESCRIBE).ok());
}

TEST(RuntimeChildFaults, ShutdownFaultKeepsTheChildRunning) {
  runtime_child child(with_fault("shutdown:error"));
  expect_error(child.call(pb::COMMAND_SHUTDOWN), pb::ERROR_CODE_INJECTED, "shutdown");
  EXPECT_EQ(child.describe().runtime_kind(), "refit-runtime");
  ASSERT_TRUE(child.call(pb::COMMAND_SHUTDOWN).ok());
  auto info = child.wait_exit();
  ASSERT_TRUE(info);
  EXPECT_EQ(info->code, 0) << info->describe();
}

// ---------------------------------------------------------------------------- command line

struct bad_arguments {
  std::string name;
  std::vector<std::string> args;
  std::string expected; // substring of the stderr line
};

std::vector<std::string> replace_option(std::vector<std::string> args, const std::string& option,
                                        const std::string& value) {
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == option)
      args[i + 1] = value;
  return args;
}

std::vector<std::string> drop_option(std::vector<std::string> args, const std::string& option) {
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == option) {
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i),
                 args.begin() + static_cast<std::ptrdiff_t>(i) + 2);
      break;
    }
  return args;
}

std::vector<bad_arguments> bad_argument_cases() {
  const auto good = command_line(args_for(1));
  auto with_extra = good;
  with_extra.push_back("--fault");
  with_extra.push_back("describe:explode");
  const auto with = [&](const char* option, const char* value) {
    auto args = good;
    args.push_back(option);
    args.push_back(value);
    return args;
  };
  return {
    {"TpDoesNotMatchDevices", replace_option(good, "--tp", "2"), "--tp"},
    {"TpNotANumber", replace_option(good, "--tp", "two"), "--tp"},
    {"UnknownDeviceKind", replace_option(good, "--devices", "gpu:0"), "--devices"},
    {"DuplicateDevice", replace_option(replace_option(good, "--tp", "2"), "--devices",
                                       "cpu:0,cpu:0"),
     "--devices"},
    {"CudaDevice", replace_option(good, "--devices", "cuda:0"),
     "CUDA devices need a build with REFIT_CUDA=ON"},
    {"UnsupportedModel", replace_option(good, "--model", "{model_type: llama}"), "--model"},
    {"ZeroKvCache", replace_option(good, "--kv-cache-bytes", "0"), "--kv-cache-bytes"},
    {"UnknownComputeDtype", with("--compute-dtype", "fp8"), "--compute-dtype"},
    {"ZeroMaxBatch", with("--max-batch", "0"), "--max-batch"},
    {"UnknownFaultKind", with_extra, "--fault"},
    {"MissingSeed", drop_option(good, "--seed"), "--seed"},
    {"ControlFdNotOpen", replace_option(good, "--control-fd", "9"), "--control-fd"},
  };
}

// Spawns the child with its stderr on a pipe; returns what it wrote and how it ended.
std::pair<std::string, proc::exit_info> run_capturing_stderr(const std::vector<std::string>& args) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0)
    throw std::runtime_error("pipe2 failed");
  int saved_stderr = ::dup(STDERR_FILENO);
  ::dup2(pipe_fds[1], STDERR_FILENO); // inherited by the child (dup2 clears close-on-exec)
  std::optional<proc::child_process> child;
  std::string spawn_error;
  try {
    proc::spawn_options opts;
    opts.executable = REFIT_RUNTIME_EXE;
    opts.args = args;
    child = proc::spawn_child(opts);
  } catch (const std::exception& e) {
    spawn_error = e.what();
  }
  ::dup2(saved_stderr, STDERR_FILENO);
  ::close(saved_stderr);
  ::close(pipe_fds[1]);
  if (!child) {
    ::close(pipe_fds[0]);
    throw std::runtime_error("spawn failed: " + spawn_error);
  }

  std::string output;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{pipe_fds[0], POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0)
      continue;
    char buf[4096];
    ssize_t n = ::read(pipe_fds[0], buf, sizeof(buf));
    if (n <= 0)
      break;
    output.append(buf, static_cast<std::size_t>(n));
  }
  ::close(pipe_fds[0]);
  ::close(child->control_fd);
  auto info = proc::terminate_group(child->pid, 2000ms); // reaps it (it has exited already)
  return {output, info};
}

class BadArgumentsTest : public ::testing::TestWithParam<bad_arguments> {};

TEST_P(BadArgumentsTest, ExitsWithCode2NamingTheOption) {
  const auto& c = GetParam();
  auto [output, info] = run_capturing_stderr(c.args);
  EXPECT_TRUE(info.exited) << info.describe();
  EXPECT_EQ(info.code, 2) << info.describe() << "\nstderr: " << output;
  EXPECT_NE(output.find(c.expected), std::string::npos) << "stderr: " << output;
  EXPECT_NE(output.find("refit-runtime["), std::string::npos) << "stderr: " << output;
}

INSTANTIATE_TEST_SUITE_P(RuntimeChild, BadArgumentsTest,
                         ::testing::ValuesIn(bad_argument_cases()),
                         [](const auto& info) { return info.param.name; });

// REFIT_TP_COMM picks the TP group's collectives: a value that is neither 'inproc' nor 'nccl',
// and 'nccl' where NCCL cannot work (CPU devices), are startup errors naming the variable.
TEST(RuntimeChildTpComm, AnUnknownOrImpossibleRefitTpCommIsAStartupErrorNamingIt) {
  struct env_guard {
    explicit env_guard(const char* value) { ::setenv("REFIT_TP_COMM", value, 1); }
    ~env_guard() { ::unsetenv("REFIT_TP_COMM"); }
  };
  {
    env_guard env("shm");
    auto [output, info] = run_capturing_stderr(command_line(args_for(2)));
    EXPECT_TRUE(info.exited) << info.describe();
    EXPECT_EQ(info.code, 1) << info.describe() << "\nstderr: " << output;
    EXPECT_NE(output.find("REFIT_TP_COMM='shm': expected 'inproc' (host memory) or 'nccl'"),
              std::string::npos) << output;
  }
  {
    env_guard env("nccl");
    auto [output, info] = run_capturing_stderr(command_line(args_for(2)));
    EXPECT_TRUE(info.exited) << info.describe();
    EXPECT_EQ(info.code, 1) << info.describe() << "\nstderr: " << output;
    EXPECT_NE(output.find("REFIT_TP_COMM=nccl"), std::string::npos) << output;
    EXPECT_NE(output.find("cpu:0,cpu:1"), std::string::npos) << output;
  }
  {
    // 'inproc' is what CPU devices use anyway: the child starts and serves.
    env_guard env("inproc");
    runtime_child child(args_for(2));
    EXPECT_EQ(child.describe().runtime_kind(), "refit-runtime");
  }
}

// refit-runtime's own memory preflight: a KV cache beyond the machine is refused before any
// allocation, with the key and both numbers, and a distinct exit code (3), not SIGKILL by OOM.
TEST(RuntimeChildPreflight, AKvCacheBeyondTheMachineExitsWith3NamingTheKey) {
  auto [output, info] = run_capturing_stderr(command_line(args_for(2, std::uint64_t{1} << 62)));
  EXPECT_TRUE(info.exited) << info.describe();
  EXPECT_EQ(info.code, 3) << info.describe() << "\nstderr: " << output;
  EXPECT_NE(output.find("preflight: runtime.kv_cache_bytes: 2 TP worker(s) on the host need"),
            std::string::npos) << output;
  EXPECT_NE(output.find("available (MemAvailable)"), std::string::npos) << output;
}

// The child keeps only fds 0, 1, 2 and its control fd, also when the parent's descriptor
// limit was raised (the serve listener raises it) and an fd sits at the top of the range.
TEST(SpawnChild, OnlyTheControlFdIsInheritedEvenAtTheTopOfTheFdRange) {
  rlimit rl{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &rl), 0);
  const rlimit before = rl;
  rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, 1u << 20);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &rl), 0);
  const int top = static_cast<int>(rl.rlim_cur - 1);
  const int high = ::dup2(STDERR_FILENO, top); // inheritable (dup2 clears close-on-exec)
  ASSERT_EQ(high, top);
  const std::string out = ::testing::TempDir() + "refit-child-fds-" + std::to_string(::getpid());
  proc::spawn_options opts;
  opts.executable = "/bin/sh";
  opts.args = {"-c", "ls /proc/self/fd > '" + out + "'"};
  auto child = proc::spawn_child(opts);
  ::close(high);
  ::close(child.control_fd);
  std::optional<proc::exit_info> done;
  for (int i = 0; i < 500 && !done; ++i) {
    done = proc::try_reap(child.pid);
    if (!done)
      std::this_thread::sleep_for(10ms);
  }
  ::setrlimit(RLIMIT_NOFILE, &before);
  ASSERT_TRUE(done && done->exited && done->code == 0);
  std::ifstream in(out);
  std::set<int> fds;
  for (int fd; in >> fd;)
    fds.insert(fd);
  std::remove(out.c_str());
  EXPECT_EQ(fds.count(top), 0u) << "fd " << top << " leaked into the child";
  EXPECT_EQ(fds.count(3), 1u) << "the control fd";
  EXPECT_LE(fds.size(), 5u) << "0, 1, 2, 3 and the fd ls reads /proc/self/fd through";
}

// The runtime child does not inherit the parent's secrets: the configured serve.token_env
// (whatever its name) and anything named like a token or secret.
TEST(SpawnChild, TheChildEnvironmentHasNoSecrets) {
  const std::string out = ::testing::TempDir() + "refit-child-env-" + std::to_string(::getpid());
  ::setenv("REFIT_TOKEN", "the-shared-secret-value", 1);
  ::setenv("MY_DEPLOYMENT_KEY", "configured-token-env-value", 1);
  ::setenv("REFIT_HARMLESS", "kept", 1);
  proc::spawn_options opts;
  opts.executable = "/bin/sh";
  opts.args = {"-c", "env > '" + out + "'"};
  opts.scrub_env = {"MY_DEPLOYMENT_KEY"};
  auto child = proc::spawn_child(opts);
  ::close(child.control_fd);
  std::optional<proc::exit_info> done;
  for (int i = 0; i < 500 && !done; ++i) {
    done = proc::try_reap(child.pid);
    if (!done)
      std::this_thread::sleep_for(10ms);
  }
  ::unsetenv("REFIT_TOKEN");
  ::unsetenv("MY_DEPLOYMENT_KEY");
  ::unsetenv("REFIT_HARMLESS");
  ASSERT_TRUE(done && done->exited && done->code == 0);
  std::ifstream in(out);
  std::string env((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(out.c_str());
  EXPECT_EQ(env.find("the-shared-secret-value"), std::string::npos) << env;
  EXPECT_EQ(env.find("configured-token-env-value"), std::string::npos) << env;
  EXPECT_NE(env.find("REFIT_HARMLESS=kept"), std::string::npos) << env;
  EXPECT_NE(env.find("PATH="), std::string::npos) << env;
  EXPECT_TRUE(proc::is_secret_env_name("HF_TOKEN"));
  EXPECT_TRUE(proc::is_secret_env_name("db_password"));
  EXPECT_FALSE(proc::is_secret_env_name("OMP_NUM_THREADS"));
  EXPECT_TRUE(proc::is_secret_env_name("GITHUB_TOKEN_FILE"));
  EXPECT_TRUE(proc::is_secret_env_name("refit_token"));
  EXPECT_TRUE(proc::is_secret_env_name("MAX_TOKENS_TOKEN")); // a TOKEN after the count
  // A count of tokens reaches the runtime (the engine's knobs were dropped before).
  EXPECT_FALSE(proc::is_secret_env_name("REFIT_ROUTE_BUCKET_MAX_TOKENS"));
}

// ---------------------------------------------------------------------------- weight publication
//
// The test plays the trainer side: one host_buffer_pool per trainer rank holding the full
// canonical tensors of a synthetic optimizer step, packed into chunks, published through
// init / start / update... / finish / release. The expected resident bytes are computed
// independently here (the same full tensors scattered through a tp_layout into zeroed
// scratch residents) and compared with the receipts' SHA-256 checksums.

namespace model = refit::model;

constexpr std::uint64_t publication_buffer_bytes = 64u << 10; // several chunks for the tiny model
constexpr std::uint32_t publication_buffer_count = 2;
constexpr std::uint64_t pack_alignment = 256;
constexpr std::uint64_t trainer_seed = 77;
constexpr const char* refit_buffer_mapping = "memfd:refit-buffer";

const model::model_config& tiny_config() {
  static const model::model_config config = refit::config::parse_model_yaml(tiny_model, "test");
  return config;
}

// Throws (failing the test with the runtime's error) unless `rsp` is ok.
const pb::Response& require_ok(const pb::Response& rsp) {
  if (!rsp.ok())
    throw std::runtime_error(std::string(refit::protocol::command_name(rsp.command()))
                             + " failed: " + pb::ErrorCode_Name(rsp.error().code()) + " at '"
                             + rsp.error().where() + "': " + rsp.error().message());
  return rsp;
}

// The full canonical tensors of the tiny model after `step` synthetic optimizer steps.
struct canonical_weights {
  std::vector<model::param_meta> params; // expected key stream order
  std::vector<std::vector<std::byte>> bytes;
};

canonical_weights synthetic_canonical(std::uint64_t step) {
  canonical_weights w;
  w.params = model::expected_key_stream(tiny_config());
  model::synthetic_weights synthetic;
  synthetic.seed = trainer_seed;
  for (const auto& p : w.params) {
    std::vector<std::byte> bytes(p.nbytes());
    model::fill_synthetic(p, synthetic, step, 0, p.numel(), bytes.data());
    w.bytes.push_back(std::move(bytes));
  }
  return w;
}

// Element digest of every resident tensor of every rank, in layout order, after scattering
// `w` into zeroed scratch residents (built bytes, independent of the verifier's placement sums).
std::vector<std::vector<std::string>> expected_checksums(const canonical_weights& w,
                                                         std::uint32_t tp) {
  const auto layout = tiny_layout(tp);
  std::vector<std::vector<std::string>> checksums(tp);
  for (std::uint32_t rank = 0; rank < tp; ++rank) {
    std::vector<std::vector<std::byte>> residents;
    std::vector<std::byte*> pointers;
    for (const auto& r : layout.residents())
      residents.emplace_back(r.nbytes, std::byte{0});
    for (auto& r : residents)
      pointers.push_back(r.data());
    for (std::size_t i = 0; i < w.params.size(); ++i)
      layout.scatter(w.params[i], w.bytes[i].data(), rank, pointers);
    for (std::size_t i = 0; i < residents.size(); ++i)
      checksums[rank].push_back(model::digest_hex(model::element_digest(
        residents[i].data(), residents[i].size(), model::dtype_size(layout.residents()[i].dt))));
  }
  return checksums;
}

// One packed chunk: the buffer it uses and (tensor index, byte offset) of its tensors.
struct packed_chunk {
  std::uint32_t buffer = 0;
  std::vector<std::pair<std::size_t, std::uint64_t>> tensors;
};

// Greedy packing in key stream order at aligned offsets; chunks alternate between buffers.
std::vector<packed_chunk> pack(const canonical_weights& w) {
  std::vector<packed_chunk> chunks(1);
  std::uint64_t used = 0;
  for (std::size_t i = 0; i < w.params.size(); ++i) {
    const std::uint64_t nbytes = w.params[i].nbytes();
    std::uint64_t offset = (used + pack_alignment - 1) / pack_alignment * pack_alignment;
    if (offset + nbytes > publication_buffer_bytes) {
      packed_chunk next;
      next.buffer = static_cast<std::uint32_t>(chunks.size() % publication_buffer_count);
      chunks.push_back(next);
      offset = 0;
    }
    chunks.back().tensors.emplace_back(i, offset);
    used = offset + nbytes;
  }
  return chunks;
}

// The trainer side: one buffer pool per trainer rank r, whose handles are keyed by the
// device UUID of TP worker r.
class trainer_ranks {
public:
  explicit trainer_ranks(std::uint32_t tp) {
    for (std::uint32_t rank = 0; rank < tp; ++rank)
      pools_.push_back(std::make_unique<refit::publication::host_buffer_pool>(
        publication_buffer_count, publication_buffer_bytes));
  }

  // Packs chunk `k` of `chunks` into its buffer on every rank and returns its request.
  pb::UpdateWeightsRequest chunk(const canonical_weights& w,
                                 const std::vector<packed_chunk>& chunks, std::size_t k,
                                 const std::string& publication_id) const {
    const packed_chunk& c = chunks[k];
    pb::UpdateWeightsRequest req;
    req.set_publication_id(publication_id);
    req.set_chunk_index(static_cast<std::uint32_t>(k));
    req.set_is_first(k == 0);
    req.set_is_last(k + 1 == chunks.size());
    for (const auto& [index, offset] : c.tensors) {
      const auto& p = w.params[index];
      auto* meta = req.add_tensors();
      meta->set_name(p.name);
      for (auto d : p.shape)
        meta->add_shape(d);
      meta->set_dtype(static_cast<pb::DType>(p.dt));
      meta->set_offset(offset);
      meta->set_nbytes(p.nbytes());
      for (const auto& pool : pools_)
        std::memcpy(pool->data(c.buffer) + offset, w.bytes[index].data(), p.nbytes());
    }
    for (std::uint32_t rank = 0; rank < pools_.size(); ++rank) {
      auto* handle = req.add_handles();
      handle->set_device_uuid(refit::device::cpu_uuid(static_cast<int>(rank)));
      handle->set_buffer_index(c.buffer);
      handle->set_handle(pools_[rank]->handle(c.buffer));
      handle->set_size(pools_[rank]->bytes());
    }
    return req;
  }

private:
  std::vector<std::unique_ptr<refit::publication::host_buffer_pool>> pools_;
};

pb::PublicationHeader publication_header(std::uint32_t tp, std::uint64_t model_version,
                                         const std::string& publication_id) {
  const auto stream = model::expected_key_stream(tiny_config());
  pb::PublicationHeader h;
  h.set_protocol_version(refit::wire::protocol_version);
  h.set_transport("shm");
  h.set_publication_id(publication_id);
  h.set_model_version(model_version);
  h.set_tp_world_size(tp);
  h.set_manifest_fingerprint(model::structural_manifest(stream));
  for (std::uint32_t rank = 0; rank < tp; ++rank) {
    h.add_device_uuids(refit::device::cpu_uuid(static_cast<int>(rank)));
    h.add_producer_pids(static_cast<std::uint32_t>(::getpid())); // this test plays every rank
  }
  h.set_expected_tensor_count(stream.size());
  h.set_verify(true);
  return h;
}

pb::Response init_transfer(runtime_child& child, const std::string& transport = "shm",
                           std::uint64_t buffer_bytes = publication_buffer_bytes,
                           std::uint32_t buffer_count = publication_buffer_count) {
  auto req = child.request(pb::COMMAND_INIT_WEIGHT_TRANSFER);
  req.mutable_init_weight_transfer()->set_transport(transport);
  req.mutable_init_weight_transfer()->set_buffer_bytes(buffer_bytes);
  req.mutable_init_weight_transfer()->set_buffer_count(buffer_count);
  return child.call(req);
}

pb::Response start_update(runtime_child& child, const pb::PublicationHeader& header) {
  auto req = child.request(pb::COMMAND_START_WEIGHT_UPDATE);
  *req.mutable_start_weight_update()->mutable_header() = header;
  return child.call(req);
}

pb::Response update_weights(runtime_child& child, const pb::UpdateWeightsRequest& chunk) {
  auto req = child.request(pb::COMMAND_UPDATE_WEIGHTS);
  *req.mutable_update_weights() = chunk;
  return child.call(req);
}

pb::Response finish_update(runtime_child& child, const std::string& publication_id,
                           std::uint64_t model_version) {
  auto req = child.request(pb::COMMAND_FINISH_WEIGHT_UPDATE);
  req.mutable_finish_weight_update()->set_publication_id(publication_id);
  req.mutable_finish_weight_update()->set_model_version(model_version);
  return child.call(req);
}

pb::Response release_ipc(runtime_child& child, const std::string& publication_id) {
  auto req = child.request(pb::COMMAND_RELEASE_IPC);
  req.mutable_release_ipc()->set_publication_id(publication_id);
  return child.call(req);
}

// Sends every chunk of `w` (answers must be ok) for the started publication `header`.
void send_all_chunks(runtime_child& child, const trainer_ranks& trainer,
                     const canonical_weights& w, const pb::PublicationHeader& header) {
  const auto chunks = pack(w);
  for (std::size_t k = 0; k < chunks.size(); ++k) {
    const auto rsp = require_ok(update_weights(
      child, trainer.chunk(w, chunks, k, header.publication_id())));
    EXPECT_EQ(rsp.update_weights().chunk_index(), k);
    EXPECT_EQ(rsp.update_weights().tensors_loaded(), chunks[k].tensors.size());
  }
}

// init + start + every chunk + finish; returns the finish result.
pb::FinishWeightUpdateResult publish(runtime_child& child, const trainer_ranks& trainer,
                                     const canonical_weights& w,
                                     const pb::PublicationHeader& header) {
  EXPECT_EQ(require_ok(init_transfer(child)).init_weight_transfer().transport(), "shm");
  EXPECT_EQ(require_ok(start_update(child, header)).start_weight_update().publication_id(),
            header.publication_id());
  send_all_chunks(child, trainer, w, header);
  return require_ok(finish_update(child, header.publication_id(), header.model_version()))
    .finish_weight_update();
}

void expect_verified_receipts(const pb::FinishWeightUpdateResult& result,
                              const pb::PublicationHeader& header,
                              const std::vector<std::vector<std::string>>& expected) {
  const auto layout = tiny_layout(header.tp_world_size());
  EXPECT_EQ(result.publication_id(), header.publication_id());
  EXPECT_EQ(result.model_version(), header.model_version());
  EXPECT_TRUE(result.prefix_cache_reset());
  ASSERT_EQ(result.receipts_size(), static_cast<int>(header.tp_world_size()));
  for (std::uint32_t rank = 0; rank < header.tp_world_size(); ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const auto& receipt = result.receipts(static_cast<int>(rank));
    EXPECT_EQ(receipt.publication_id(), header.publication_id());
    EXPECT_EQ(receipt.model_version(), header.model_version());
    EXPECT_EQ(receipt.tp_world_size(), header.tp_world_size());
    EXPECT_EQ(receipt.manifest_fingerprint(), header.manifest_fingerprint());
    EXPECT_EQ(receipt.tp_rank(), rank);
    EXPECT_EQ(receipt.device_uuid(), refit::device::cpu_uuid(static_cast<int>(rank)));
    EXPECT_EQ(receipt.resident_tensor_count(), layout.residents().size());
    ASSERT_EQ(receipt.checksums_size(), static_cast<int>(layout.residents().size()));
    for (std::size_t i = 0; i < layout.residents().size(); ++i) {
      const auto& checksum = receipt.checksums(static_cast<int>(i));
      EXPECT_EQ(checksum.name(), layout.residents()[i].name);
      EXPECT_EQ(checksum.digest(), expected[rank][i]) << checksum.name();
    }
  }
}

// Whether the child maps any producer buffer (host_buffer_pool memfds are "refit-buffer").
bool maps_refit_buffers(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(refit_buffer_mapping) != std::string::npos)
      return true;
  return false;
}

class PublicationTest : public ::testing::TestWithParam<std::uint32_t> {};

TEST_P(PublicationTest, TwoVerifiedPublicationsAreByteExactAndReleaseUnmaps) {
  const std::uint32_t tp = GetParam();
  const auto layout = tiny_layout(tp);
  runtime_child child(args_for(tp));
  trainer_ranks trainer(tp);
  ASSERT_EQ(child.describe().model_version(), 0u);
  ASSERT_GE(pack(synthetic_canonical(1)).size(), 3u) << "the test must exercise both buffers";

  std::vector<std::string> first_checksums;
  for (std::uint64_t version : {1u, 2u}) {
    SCOPED_TRACE("model version " + std::to_string(version));
    const auto weights = synthetic_canonical(version); // synthetic step == version
    const auto header = publication_header(tp, version, "pub-" + std::to_string(version));
    const auto expected = expected_checksums(weights, tp);
    expect_verified_receipts(publish(child, trainer, weights, header), header, expected);

    const auto d = child.describe();
    EXPECT_EQ(d.model_version(), version);
    EXPECT_TRUE(d.weights_valid());
    for (const auto& w : d.workers())
      EXPECT_EQ(w.resident_tensor_count(), layout.residents().size());

    EXPECT_TRUE(maps_refit_buffers(child.pid()));
    const auto released = require_ok(release_ipc(child, header.publication_id()));
    EXPECT_EQ(released.release_ipc().buffers_closed(), tp * publication_buffer_count);
    EXPECT_FALSE(maps_refit_buffers(child.pid()));

    if (version == 1)
      first_checksums = expected[0];
    else
      EXPECT_NE(expected[0], first_checksums) << "the two steps must publish different bytes";
  }

  // The committed version is 2 now: a publication must exceed it.
  ASSERT_TRUE(init_transfer(child).ok());
  expect_error(start_update(child, publication_header(tp, 2, "pub-again")),
               pb::ERROR_CODE_VALIDATION, "header.model_version");
  EXPECT_EQ(child.describe().model_version(), 2u);
}

INSTANTIATE_TEST_SUITE_P(Tp, PublicationTest, ::testing::Values(1u, 2u),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

TEST(Publication, MakesWeightsWokenFromSleepLevel2Valid) {
  runtime_child child(args_for(2));
  ASSERT_TRUE(child.sleep(2).ok());
  expect_error(init_transfer(child), pb::ERROR_CODE_INVALID_STATE, "init_weight_transfer");
  ASSERT_TRUE(child.wake_up({pb::WAKE_TAG_WEIGHTS}).ok());
  ASSERT_FALSE(child.describe().weights_valid());

  trainer_ranks trainer(2);
  const auto weights = synthetic_canonical(3);
  const auto header = publication_header(2, 1, "after-sleep");
  expect_verified_receipts(publish(child, trainer, weights, header), header,
                           expected_checksums(weights, 2));
  ASSERT_TRUE(require_ok(release_ipc(child, header.publication_id())).ok());
  ASSERT_TRUE(child.wake_up({pb::WAKE_TAG_KV_CACHE}).ok());
  const auto d = child.describe();
  EXPECT_TRUE(d.weights_valid());
  EXPECT_EQ(d.model_version(), 1u);
  EXPECT_EQ(d.sleep_level(), 0u);
}

// The producer of a buffer the runtime has mapped tries to shrink it between two chunks (the
// runtime reuses the mapping, so a shrunk memfd used to kill it with SIGBUS): the seals refuse
// the ftruncate, and the publication goes on and commits.
TEST(Publication, AMappedBufferCannotBeShrunkBetweenChunks) {
  runtime_child child(args_for(2));
  trainer_ranks trainer(2);
  const auto weights = synthetic_canonical(2);
  const auto header = publication_header(2, 1, "pub-shrink");
  const auto chunks = pack(weights);
  ASSERT_GE(chunks.size(), 3u) << "buffer 0 is used again for chunk 2";
  ASSERT_TRUE(init_transfer(child).ok());
  ASSERT_TRUE(require_ok(start_update(child, header)).ok());
  const auto first = trainer.chunk(weights, chunks, 0, header.publication_id());
  ASSERT_TRUE(require_ok(update_weights(child, first)).ok());
  const std::string handle = first.handles(0).handle();
  const int fd = std::stoi(handle.substr(handle.rfind(':') + 1));
  errno = 0;
  EXPECT_EQ(::ftruncate(fd, 0), -1);
  EXPECT_EQ(errno, EPERM) << "F_SEAL_SHRINK";
  for (std::size_t k = 1; k < chunks.size(); ++k)
    ASSERT_TRUE(require_ok(update_weights(child, trainer.chunk(weights, chunks, k, header.publication_id()))).ok())
      << "chunk " << k;
  ASSERT_TRUE(require_ok(finish_update(child, header.publication_id(), 1)).ok());
  EXPECT_EQ(child.describe().model_version(), 1u);
}

TEST(Publication, SleepIsRefusedWhileAnUpdateIsOpen) {
  runtime_child child(args_for(1));
  trainer_ranks trainer(1);
  const auto weights = synthetic_canonical(1);
  const auto header = publication_header(1, 1, "pub-sleep");
  ASSERT_TRUE(require_ok(init_transfer(child)).ok());
  ASSERT_TRUE(require_ok(start_update(child, header)).ok());
  const auto chunks = pack(weights);
  ASSERT_TRUE(require_ok(update_weights(child, trainer.chunk(weights, chunks, 0, "pub-sleep"))).ok());

  expect_error(child.sleep(1), pb::ERROR_CODE_INVALID_STATE, "sleep");
  EXPECT_TRUE(child.describe().weights_awake());

  for (std::size_t k = 1; k < chunks.size(); ++k)
    ASSERT_TRUE(require_ok(update_weights(child, trainer.chunk(weights, chunks, k, "pub-sleep"))).ok());
  expect_verified_receipts(
    require_ok(finish_update(child, "pub-sleep", 1)).finish_weight_update(), header,
    expected_checksums(weights, 1));
  EXPECT_TRUE(child.sleep(1).ok()) << "sleep is allowed again once the update finished";
}

TEST(Publication, InitValidatesItsArguments) {
  runtime_child child(args_for(1));
  expect_error(init_transfer(child, "cuda_ipc"), pb::ERROR_CODE_INVALID_ARGUMENT,
               "init_weight_transfer.transport");
  expect_error(init_transfer(child, "shm", 0), pb::ERROR_CODE_INVALID_ARGUMENT,
               "init_weight_transfer.buffer_bytes");
  expect_error(init_transfer(child, "shm", publication_buffer_bytes, 0),
               pb::ERROR_CODE_INVALID_ARGUMENT, "init_weight_transfer.buffer_count");

  EXPECT_EQ(require_ok(init_transfer(child)).init_weight_transfer().transport(), "shm");
  expect_error(init_transfer(child), pb::ERROR_CODE_INVALID_STATE, "init_weight_transfer");
  EXPECT_EQ(require_ok(release_ipc(child, "")).release_ipc().buffers_closed(), 0u)
    << "release after init without a publication";
  EXPECT_TRUE(init_transfer(child).ok()) << "release clears the transfer";
}

TEST(Publication, CommandsNeedInitAndAnOpenPublication) {
  runtime_child child(args_for(1));
  expect_error(start_update(child, publication_header(1, 1, "p")), pb::ERROR_CODE_INVALID_STATE,
               "start_weight_update");
  pb::UpdateWeightsRequest chunk;
  chunk.set_publication_id("p");
  chunk.set_is_first(true);
  expect_error(update_weights(child, chunk), pb::ERROR_CODE_INVALID_STATE, "update_weights");
  expect_error(finish_update(child, "p", 1), pb::ERROR_CODE_INVALID_STATE, "finish_weight_update");
  expect_error(release_ipc(child, "p"), pb::ERROR_CODE_INVALID_STATE, "release_ipc");

  ASSERT_TRUE(init_transfer(child).ok());
  expect_error(update_weights(child, chunk), pb::ERROR_CODE_INVALID_STATE, "update_weights");
  const auto d = child.describe();
  EXPECT_TRUE(d.weights_valid());
  EXPECT_EQ(d.model_version(), 0u);
}

TEST(Publication, ASecondStartFailsThePublication) {
  runtime_child child(args_for(1));
  const auto header = publication_header(1, 1, "pub-twice");
  ASSERT_TRUE(init_transfer(child).ok());
  ASSERT_TRUE(require_ok(start_update(child, header)).ok());
  EXPECT_FALSE(child.describe().weights_valid()) << "storage is being mutated";

  auto rsp = start_update(child, header);
  expect_error(rsp, pb::ERROR_CODE_INVALID_STATE, "start_weight_update");
  EXPECT_NE(rsp.error().message().find("already called for publication 'pub-twice'"),
            std::string::npos)
    << rsp.error().message();

  rsp = finish_update(child, "pub-twice", 1);
  expect_error(rsp, pb::ERROR_CODE_INVALID_STATE, "finish_weight_update");
  EXPECT_NE(rsp.error().message().find("publication 'pub-twice' failed"), std::string::npos)
    << rsp.error().message();
  expect_error(release_ipc(child, "pub-twice"), pb::ERROR_CODE_INVALID_STATE, "release_ipc");
  const auto d = child.describe();
  EXPECT_FALSE(d.weights_valid());
  EXPECT_EQ(d.model_version(), 0u);
}

TEST(Publication, FinishWithAMissingTensorNamesItAndCommitsNothing) {
  runtime_child child(args_for(2));
  trainer_ranks trainer(2);
  const auto weights = synthetic_canonical(1);
  const auto header = publication_header(2, 1, "pub-missing");
  const auto chunks = pack(weights);
  const std::string missing = weights.params[chunks.back().tensors.back().first].name;
  ASSERT_TRUE(init_transfer(child).ok());
  ASSERT_TRUE(require_ok(start_update(child, header)).ok());
  for (std::size_t k = 0; k < chunks.size(); ++k) {
    auto chunk = trainer.chunk(weights, chunks, k, header.publication_id());
    if (k + 1 == chunks.size())
      chunk.mutable_tensors()->RemoveLast();
    ASSERT_TRUE(require_ok(update_weights(child, chunk)).ok());
  }

  auto rsp = finish_update(child, header.publication_id(), 1);
  expect_error(rsp, pb::ERROR_CODE_VALIDATION, missing);
  EXPECT_NE(rsp.error().message().find("1 of " + std::to_string(weights.params.size())),
            std::string::npos)
    << rsp.error().message();
  EXPECT_NE(rsp.error().message().find(missing), std::string::npos) << rsp.error().message();
  const auto d = child.describe();
  EXPECT_EQ(d.model_version(), 0u);
  EXPECT_FALSE(d.weights_valid());
  expect_error(finish_update(child, header.publication_id(), 1), pb::ERROR_CODE_INVALID_STATE,
               "finish_weight_update");
}

TEST(Publication, FinishMustNameTheStartedVersion) {
  runtime_child child(args_for(1));
  trainer_ranks trainer(1);
  const auto weights = synthetic_canonical(1);
  const auto header = publication_header(1, 4, "pub-version");
  ASSERT_TRUE(init_transfer(child).ok());
  ASSERT_TRUE(require_ok(start_update(child, header)).ok());
  send_all_chunks(child, trainer, weights, header);
  expect_error(finish_update(child, header.publication_id(), 5), pb::ERROR_CODE_VALIDATION,
               "finish_weight_update.model_version");
  EXPECT_EQ(child.describe().model_version(), 0u);
}

TEST(Publication, ReleaseMustNameTheFinishedPublication) {
  runtime_child child(args_for(1));
  trainer_ranks trainer(1);
  auto header = publication_header(1, 1, "pub-release");
  header.set_verify(false);
  const auto finished = publish(child, trainer, synthetic_canonical(1), header);
  EXPECT_EQ(finished.model_version(), 1u);
  ASSERT_EQ(finished.receipts_size(), 1);
  EXPECT_EQ(finished.receipts(0).checksums_size(), 0) << "checksums only when verifying";
  EXPECT_EQ(finished.receipts(0).resident_tensor_count(), tiny_layout(1).residents().size());
  expect_error(release_ipc(child, "another"), pb::ERROR_CODE_INVALID_ARGUMENT,
               "release_ipc.publication_id");
  EXPECT_TRUE(maps_refit_buffers(child.pid()));
  EXPECT_EQ(require_ok(release_ipc(child, "pub-release")).release_ipc().buffers_closed(),
            publication_buffer_count);
  EXPECT_FALSE(maps_refit_buffers(child.pid()));
}

// ---- header validation: each case in a fresh tp=2 runtime

struct header_case {
  std::string name;
  std::function<void(pb::PublicationHeader&)> mutate;
  std::string where;
};

std::vector<header_case> header_cases() {
  return {
    {"WrongFingerprint",
     [](auto& h) { h.set_manifest_fingerprint(model::sha256_hex("other", 5)); },
     "header.manifest_fingerprint"},
    {"SwappedDeviceUuids",
     [](auto& h) { h.mutable_device_uuids()->SwapElements(0, 1); }, "header.device_uuids"},
    {"MissingDeviceUuid", [](auto& h) { h.mutable_device_uuids()->RemoveLast(); },
     "header.device_uuids"},
    {"TpMismatch", [](auto& h) { h.set_tp_world_size(1); }, "header.tp_world_size"},
    {"VersionNotIncreasing", [](auto& h) { h.set_model_version(0); }, "header.model_version"},
    {"WrongProtocolVersion", [](auto& h) { h.set_protocol_version(refit::wire::protocol_version + 1); },
     "header.protocol_version"},
    {"WrongTensorCount",
     [](auto& h) { h.set_expected_tensor_count(h.expected_tensor_count() + 1); },
     "header.expected_tensor_count"},
    {"OtherTransport", [](auto& h) { h.set_transport("cuda_ipc"); }, "header.transport"},
    {"EmptyPublicationId", [](auto& h) { h.set_publication_id(""); }, "header.publication_id"},
    {"MissingProducerPids", [](auto& h) { h.clear_producer_pids(); }, "header.producer_pids"},
    {"ZeroProducerPid", [](auto& h) { h.set_producer_pids(1, 0); }, "header.producer_pids"},
  };
}

class HeaderValidationTest : public ::testing::TestWithParam<header_case> {};

TEST_P(HeaderValidationTest, StartAnswersValidationAndThePublicationStaysFailed) {
  runtime_child child(args_for(2));
  auto header = publication_header(2, 1, "pub-header");
  GetParam().mutate(header);
  ASSERT_TRUE(init_transfer(child).ok());
  expect_error(start_update(child, header), pb::ERROR_CODE_VALIDATION, GetParam().where);

  pb::UpdateWeightsRequest chunk;
  chunk.set_publication_id(header.publication_id());
  chunk.set_is_first(true);
  auto rsp = update_weights(child, chunk);
  expect_error(rsp, pb::ERROR_CODE_INVALID_STATE, "update_weights");
  EXPECT_NE(rsp.error().message().find("failed"), std::string::npos) << rsp.error().message();
  const auto d = child.describe();
  EXPECT_EQ(d.model_version(), 0u);
  EXPECT_TRUE(d.weights_valid()) << "a rejected header must not touch the weights";
}

INSTANTIATE_TEST_SUITE_P(Publication, HeaderValidationTest, ::testing::ValuesIn(header_cases()),
                         [](const auto& info) { return info.param.name; });

// ---- chunk validation: chunk 0 is loaded, then a broken chunk 1 fails the publication

struct chunk_case {
  std::string name;
  // Breaks chunk 1 (`first` is the chunk 0 that was loaded); returns the expected `where`.
  std::function<std::string(pb::UpdateWeightsRequest& chunk, const pb::UpdateWeightsRequest& first)>
    mutate;
  std::string message; // part of the error message
  pb::ErrorCode code = pb::ERROR_CODE_VALIDATION;
};

std::vector<chunk_case> chunk_cases() {
  return {
    {"UnexpectedTensor",
     [](auto& c, const auto&) {
       c.mutable_tensors(0)->set_name("model.layers.7.mlp.gate.weight");
       return std::string("model.layers.7.mlp.gate.weight");
     },
     "unexpected tensor"},
    {"DuplicateTensorOfAnEarlierChunk",
     [](auto& c, const auto& first) {
       *c.add_tensors() = first.tensors(0);
       return first.tensors(0).name();
     },
     "duplicate tensor: already loaded in chunk 0"},
    {"DuplicateTensorInTheChunk",
     [](auto& c, const auto&) {
       *c.add_tensors() = c.tensors(0);
       return c.tensors(0).name();
     },
     "duplicate tensor: already loaded in chunk 1"},
    {"WrongShape",
     [](auto& c, const auto&) {
       auto* t = c.mutable_tensors(0);
       std::swap(*t->mutable_shape()->Mutable(0), *t->mutable_shape()->Mutable(1));
       return t->name();
     },
     "does not match the plan"},
    {"WrongDtype",
     [](auto& c, const auto&) {
       c.mutable_tensors(0)->set_dtype(pb::DTYPE_FLOAT32);
       return c.tensors(0).name();
     },
     "dtype DTYPE_FLOAT32 does not match the plan bfloat16"},
    {"WrongNbytes",
     [](auto& c, const auto&) {
       c.mutable_tensors(0)->set_nbytes(c.tensors(0).nbytes() + 2);
       return c.tensors(0).name();
     },
     "does not match the plan's"},
    {"OffsetBeyondTheBuffer",
     [](auto& c, const auto&) {
       auto* t = c.mutable_tensors(0);
       t->set_offset(c.handles(0).size() - t->nbytes() + 2);
       return t->name();
     },
     "lie beyond the " + std::to_string(publication_buffer_bytes) + "-byte buffer"},
    {"MissingHandleForAWorker",
     [](auto& c, const auto&) {
       c.mutable_handles()->RemoveLast(); // the handle of TP worker 1
       return std::string("update_weights.handles");
     },
     "no buffer handle for device " + refit::device::cpu_uuid(1)},
    {"OutOfOrderChunk",
     [](auto& c, const auto&) {
       c.set_chunk_index(2);
       return std::string("update_weights.chunk_index");
     },
     "chunk 2 arrived, expected chunk 1"},
    {"IsFirstOnALaterChunk",
     [](auto& c, const auto&) {
       c.set_is_first(true);
       return std::string("update_weights.is_first");
     },
     "is_first is true on chunk 1"},
    {"BufferIndexOutOfRange",
     [](auto& c, const auto&) {
       c.mutable_handles(1)->set_buffer_index(publication_buffer_count);
       return std::string("update_weights.handles[1].buffer_index");
     },
     "buffer_index 2 is out of range"},
    // A handle that cannot be mapped is the producer side's bad input: a validation error.
    {"UnmappableHandle",
     [](auto& c, const auto&) {
       c.mutable_handles(1)->set_handle("memfd:" + std::to_string(::getpid()) + ":999999");
       return std::string("update_weights.handles");
     },
     "TP worker 1: buffer handle 'memfd:"},
    // A memfd without seals could be shrunk under the mapping (SIGBUS): refused.
    {"UnsealedMemfd",
     [](auto& c, const auto&) {
       int fd = ::memfd_create("hostile-unsealed", MFD_CLOEXEC); // held for the test's life
       EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(c.handles(1).size())), 0);
       c.mutable_handles(1)->set_handle("memfd:" + std::to_string(::getpid()) + ":" + std::to_string(fd));
       return std::string("update_weights.handles");
     },
     "without the required seals"},
    // A plain file of this uid (it could be any secret the producer can open): not a memfd.
    {"PlainFileHandle",
     [](auto& c, const auto&) {
       auto path = ::testing::TempDir() + "refit-plain-file-" + std::to_string(::getpid());
       std::ofstream(path) << std::string(c.handles(1).size(), 'x');
       int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC); // held for the test's life
       ::unlink(path.c_str());
       c.mutable_handles(1)->set_handle("memfd:" + std::to_string(::getpid()) + ":" + std::to_string(fd));
       return std::string("update_weights.handles");
     },
     "is not a memfd"},
    // A handle naming another process than the publishing rank's.
    {"HandleOfAnotherProcess",
     [](auto& c, const auto&) {
       c.mutable_handles(1)->set_handle("memfd:" + std::to_string(::getppid()) + ":0");
       return std::string("update_weights.handles");
     },
     "names pid " + std::to_string(::getppid()) + ", but the rank that publishes it is pid "
       + std::to_string(::getpid())},
    // An offset near 2^64: the error names it without a wrapped byte range.
    {"OffsetNear2To64",
     [](auto& c, const auto&) {
       c.mutable_tensors(0)->set_offset(~std::uint64_t{0});
       return c.tensors(0).name();
     },
     "bytes at offset 18446744073709551615 lie beyond"},
    {"AnotherPublicationId",
     [](auto& c, const auto&) {
       c.set_publication_id("another");
       return std::string("update_weights.publication_id");
     },
     "publication 'another' is not the open publication 'pub-chunks'",
     pb::ERROR_CODE_INVALID_ARGUMENT},
  };
}

class ChunkValidationTest : public ::testing::TestWithParam<chunk_case> {};

TEST_P(ChunkValidationTest, UpdateAnswersTheErrorAndNothingCommits) {
  runtime_child child(args_for(2));
  trainer_ranks trainer(2);
  const auto weights = synthetic_canonical(1);
  const auto header = publication_header(2, 1, "pub-chunks");
  const auto chunks = pack(weights);
  ASSERT_TRUE(init_transfer(child).ok());
  ASSERT_TRUE(require_ok(start_update(child, header)).ok());
  const auto first = trainer.chunk(weights, chunks, 0, header.publication_id());
  ASSERT_TRUE(require_ok(update_weights(child, first)).ok());

  auto chunk = trainer.chunk(weights, chunks, 1, header.publication_id());
  const std::string where = GetParam().mutate(chunk, first);
  auto rsp = update_weights(child, chunk);
  expect_error(rsp, GetParam().code, where);
  EXPECT_NE(rsp.error().message().find(GetParam().message), std::string::npos)
    << rsp.error().message();

  // The publication is failed for good: even the intact chunk is refused now.
  rsp = update_weights(child, trainer.chunk(weights, chunks, 1, header.publication_id()));
  expect_error(rsp, pb::ERROR_CODE_INVALID_STATE, "update_weights");
  EXPECT_NE(rsp.error().message().find("publication 'pub-chunks' failed"), std::string::npos)
    << rsp.error().message();
  expect_error(finish_update(child, header.publication_id(), 1), pb::ERROR_CODE_INVALID_STATE,
               "finish_weight_update");
  const auto d = child.describe();
  EXPECT_EQ(d.model_version(), 0u);
  EXPECT_FALSE(d.weights_valid());
}

INSTANTIATE_TEST_SUITE_P(Publication, ChunkValidationTest, ::testing::ValuesIn(chunk_cases()),
                         [](const auto& info) { return info.param.name; });

// ---------------------------------------------------------------------------- generation
//
// The runtime generates with the weights it holds: its checkpoint (synthetic seed 1234, step
// 0) or the last committed publication. Every test scores the runtime's samples with the
// unsharded TP=1 reference computed here from the same canonical tensors.

namespace inf = refit::inference;

constexpr std::uint64_t checkpoint_seed = 1234; // --seed of command_line()

canonical_weights checkpoint_canonical() {
  canonical_weights w;
  w.params = model::expected_key_stream(tiny_config());
  model::synthetic_weights synthetic;
  synthetic.seed = checkpoint_seed;
  for (const auto& p : w.params) {
    std::vector<std::byte> bytes(p.nbytes());
    model::fill_synthetic(p, synthetic, 0, 0, p.numel(), bytes.data());
    w.bytes.push_back(std::move(bytes));
  }
  return w;
}

inf::resident_set tp1_residents(const canonical_weights& w) {
  std::vector<const std::byte*> pointers;
  for (const auto& b : w.bytes)
    pointers.push_back(b.data());
  return inf::scatter_residents(tiny_config(), 1, 0, w.params, pointers);
}

inf::sampling_config sampling(float temperature, std::uint32_t max_tokens, std::uint32_t n = 1,
                              std::int32_t top_k = 0, float top_p = 1.0f, std::uint64_t seed = 0) {
  inf::sampling_config p;
  p.temperature = temperature;
  p.max_tokens = max_tokens;
  p.n = n;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

pb::Response generate(runtime_child& child, const std::vector<std::vector<std::int32_t>>& prompts,
                      const inf::sampling_config& p) {
  auto req = child.request(pb::COMMAND_GENERATE);
  auto* g = req.mutable_generate();
  for (const auto& prompt : prompts)
    g->add_prompts()->mutable_token_ids()->Add(prompt.begin(), prompt.end());
  auto* params = g->mutable_params();
  params->set_n(p.n);
  params->set_max_tokens(p.max_tokens);
  params->set_temperature(p.temperature);
  params->set_top_k(p.top_k);
  params->set_top_p(p.top_p);
  params->set_seed(p.seed);
  params->mutable_stop_token_ids()->Add(p.stop_token_ids.begin(), p.stop_token_ids.end());
  params->set_max_prompt_length(p.max_prompt_length);
  return child.call(req);
}

pb::Response score(runtime_child& child, const std::vector<std::vector<std::int32_t>>& sequences,
                   std::uint32_t start) {
  auto req = child.request(pb::COMMAND_SCORE);
  auto* sc = req.mutable_score();
  for (const auto& seq : sequences)
    sc->add_sequences()->mutable_token_ids()->Add(seq.begin(), seq.end());
  sc->set_start(start);
  return child.call(req);
}

std::vector<std::int32_t> ids(const google::protobuf::RepeatedField<std::int32_t>& r) {
  return {r.begin(), r.end()};
}
std::vector<float> floats(const google::protobuf::RepeatedField<float>& r) {
  return {r.begin(), r.end()};
}

std::vector<std::int32_t> prompt_tokens(std::size_t length, std::int32_t salt = 0) {
  std::vector<std::int32_t> tokens;
  for (std::size_t i = 0; i < length; ++i)
    tokens.push_back(static_cast<std::int32_t>((i * 53 + 7 + std::size_t(salt) * 89) % 256));
  return tokens;
}

// Greedy continuation by the reference (full forwards, TP = 1).
std::vector<std::int32_t> reference_greedy(const inf::resident_set& tp1,
                                           std::vector<std::int32_t> tokens, std::size_t count) {
  const auto& cfg = tiny_config();
  std::vector<std::int32_t> out;
  for (std::size_t i = 0; i < count; ++i) {
    const auto logits = inf::reference_logits(cfg, tp1.pointers(), tokens);
    const float* last = logits.data() + (tokens.size() - 1) * cfg.vocab_size;
    out.push_back(static_cast<std::int32_t>(std::max_element(last, last + cfg.vocab_size) - last));
    tokens.push_back(out.back());
  }
  return out;
}

// Largest |runtime logprob - reference logprob| over every sample of `result`.
float reference_delta(const pb::GenerateResult& result, const inf::resident_set& tp1,
                      const inf::sampling_config& p) {
  std::vector<inf::scored_sequence> seqs;
  for (const auto& s : result.samples())
    seqs.push_back({ids(s.prompt_token_ids()), ids(s.token_ids())});
  const auto ref = inf::reference_logprobs(tiny_config(), tp1.pointers(), seqs, p);
  float delta = 0.0f;
  for (int i = 0; i < result.samples_size(); ++i) {
    const auto got = floats(result.samples(i).logprobs());
    EXPECT_EQ(got.size(), ref[static_cast<std::size_t>(i)].size());
    for (std::size_t t = 0; t < got.size() && t < ref[static_cast<std::size_t>(i)].size(); ++t)
      delta = std::max(delta, std::fabs(got[t] - ref[static_cast<std::size_t>(i)][t]));
  }
  return delta;
}

class GenerateTest : public ::testing::TestWithParam<std::uint32_t> {};

TEST_P(GenerateTest, GreedyAndSampledOutputsMatchTheUnshardedReference) {
  const std::uint32_t tp = GetParam();
  runtime_child child(args_for(tp));
  const auto tp1 = tp1_residents(checkpoint_canonical());
  const std::vector<std::vector<std::int32_t>> prompts = {prompt_tokens(6, 1),
                                                          prompt_tokens(13, 2)};

  const auto greedy = sampling(0.0f, 8);
  const auto rsp = require_ok(generate(child, prompts, greedy));
  ASSERT_EQ(rsp.result_case(), pb::Response::kGenerate);
  const auto& result = rsp.generate();
  EXPECT_EQ(result.model_version(), 0u);
  ASSERT_EQ(result.samples_size(), 2);
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    const auto& s = result.samples(i);
    EXPECT_EQ(s.prompt_index(), static_cast<std::uint32_t>(i));
    EXPECT_EQ(ids(s.prompt_token_ids()), prompts[static_cast<std::size_t>(i)]);
    EXPECT_FALSE(s.prompt_truncated());
    EXPECT_EQ(s.finish_reason(), "length");
    EXPECT_EQ(ids(s.token_ids()), reference_greedy(tp1, prompts[static_cast<std::size_t>(i)], 8));
    ASSERT_EQ(s.logprobs_size(), 8);
    for (float lp : s.logprobs()) {
      EXPECT_LT(lp, 0.0f);
      EXPECT_GE(lp, -std::log(256.0f) - 1e-4f) << "the greedy token is the most probable";
    }
  }
  const float greedy_delta = reference_delta(result, tp1, greedy);
  EXPECT_LT(greedy_delta, inf::parity_tolerance);

  const auto sampled = sampling(0.7f, 10, 2, 50, 0.9f, 7);
  const auto first = require_ok(generate(child, prompts, sampled)).generate();
  ASSERT_EQ(first.samples_size(), 4);
  const float sampled_delta = reference_delta(first, tp1, sampled);
  EXPECT_LT(sampled_delta, inf::parity_tolerance);
  std::cout << "[ measured ] refit-runtime tp=" << tp << ": max |logprob - reference| greedy "
            << greedy_delta << ", sampled " << sampled_delta << "\n";
  // Same seed, same weights: the same samples, bit for bit (prompts shorter than a KV block,
  // so both requests compute the same way).
  const auto second = require_ok(generate(child, prompts, sampled)).generate();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(ids(second.samples(i).token_ids()), ids(first.samples(i).token_ids()));
    EXPECT_EQ(floats(second.samples(i).logprobs()), floats(first.samples(i).logprobs()));
  }
  EXPECT_NE(ids(first.samples(0).token_ids()), ids(first.samples(1).token_ids()))
    << "the two samples of a prompt are different draws";
}

INSTANTIATE_TEST_SUITE_P(Tp, GenerateTest, ::testing::Values(1u, 2u, 4u),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

TEST(Generation, StopTokensEndSamplesAndLongPromptsKeepTheirLastTokens) {
  runtime_child child(args_for(2));
  const auto prompt = prompt_tokens(30, 3);
  auto p = sampling(0.0f, 10);
  const auto free_run = require_ok(generate(child, {prompt}, p)).generate().samples(0);
  ASSERT_EQ(free_run.token_ids_size(), 10);
  const std::int32_t stop = free_run.token_ids(4);
  int first = 0;
  while (free_run.token_ids(first) != stop)
    ++first;
  p.stop_token_ids = {stop};
  const auto stopped = require_ok(generate(child, {prompt}, p)).generate().samples(0);
  EXPECT_EQ(stopped.finish_reason(), "stop");
  ASSERT_EQ(stopped.token_ids_size(), first + 1);
  EXPECT_EQ(stopped.token_ids(first), stop) << "the stop token is included";
  for (int i = 0; i <= first; ++i)
    EXPECT_EQ(stopped.token_ids(i), free_run.token_ids(i));

  p.stop_token_ids.clear();
  p.max_prompt_length = 12;
  const auto truncated = require_ok(generate(child, {prompt, {1, 2, 3}}, p)).generate();
  ASSERT_EQ(truncated.samples_size(), 2);
  EXPECT_TRUE(truncated.samples(0).prompt_truncated());
  EXPECT_EQ(ids(truncated.samples(0).prompt_token_ids()),
            std::vector<std::int32_t>(prompt.end() - 12, prompt.end()));
  EXPECT_FALSE(truncated.samples(1).prompt_truncated());
  const auto tp1 = tp1_residents(checkpoint_canonical());
  EXPECT_EQ(ids(truncated.samples(0).token_ids()),
            reference_greedy(tp1, std::vector<std::int32_t>(prompt.end() - 12, prompt.end()), 10));
  EXPECT_LT(reference_delta(truncated, tp1, p), inf::parity_tolerance);
}

TEST(Generation, InvalidRequestsNameTheField) {
  runtime_child child(args_for(1, 64u << 10)); // tp=1: 8 KiB per 16-position block, 8 blocks
  const std::vector<std::vector<std::int32_t>> prompt = {{1, 2, 3}};
  expect_error(generate(child, prompt, sampling(-1.0f, 4)), pb::ERROR_CODE_INVALID_ARGUMENT,
               "generate.params.temperature");
  expect_error(generate(child, prompt, sampling(1.0f, 4, 0)), pb::ERROR_CODE_INVALID_ARGUMENT,
               "generate.params.n");
  expect_error(generate(child, prompt, sampling(1.0f, 0)), pb::ERROR_CODE_INVALID_ARGUMENT,
               "generate.params.max_tokens");
  expect_error(generate(child, prompt, sampling(1.0f, 4, 1, 0, 2.0f)),
               pb::ERROR_CODE_INVALID_ARGUMENT, "generate.params.top_p");
  expect_error(generate(child, {{1, 256}}, sampling(1.0f, 4)), pb::ERROR_CODE_INVALID_ARGUMENT,
               "generate.prompts[0].token_ids[1]");
  expect_error(generate(child, {{1}, {}}, sampling(1.0f, 4)), pb::ERROR_CODE_INVALID_ARGUMENT,
               "generate.prompts[1].token_ids");

  // The KV region bounds a request: no allocation elsewhere.
  auto rsp = generate(child, prompt, sampling(1.0f, 1000));
  expect_error(rsp, pb::ERROR_CODE_INVALID_ARGUMENT, "generate.params.max_tokens");
  EXPECT_NE(rsp.error().message().find("kv_cache_bytes=65536"), std::string::npos)
    << rsp.error().message();
  EXPECT_NE(rsp.error().message().find("holds 8 blocks"), std::string::npos)
    << rsp.error().message();
  expect_error(generate(child, prompt, sampling(1.0f, 100, 9)), pb::ERROR_CODE_INVALID_ARGUMENT,
               "generate.params.n");
  // What fits still runs (several waves if needed).
  const auto ok = require_ok(generate(child, {prompt_tokens(20), prompt_tokens(20, 1)},
                                      sampling(1.0f, 40, 2, 0, 1.0f, 1)));
  EXPECT_EQ(ok.generate().samples_size(), 4); // 7 of 8 blocks per prompt: two waves
}

TEST(Generation, RefusedWhileAsleepWithInvalidWeightsOrDuringAnUpdate) {
  runtime_child child(args_for(2));
  const std::vector<std::vector<std::int32_t>> prompt = {prompt_tokens(5)};
  const auto p = sampling(0.0f, 4);
  ASSERT_TRUE(require_ok(generate(child, prompt, p)).ok());

  // Scoring is refused exactly when generation is.
  const std::vector<std::vector<std::int32_t>> scored = {prompt_tokens(8)};
  ASSERT_TRUE(require_ok(score(child, scored, 5)).ok());

  ASSERT_TRUE(child.sleep(1).ok());
  auto rsp = generate(child, prompt, p);
  expect_error(rsp, pb::ERROR_CODE_INVALID_STATE, "generate");
  EXPECT_NE(rsp.error().message().find("resident weights"), std::string::npos);
  expect_error(score(child, scored, 5), pb::ERROR_CODE_INVALID_STATE, "score");
  ASSERT_TRUE(child.wake_up({pb::WAKE_TAG_WEIGHTS}).ok());
  rsp = generate(child, prompt, p);
  expect_error(rsp, pb::ERROR_CODE_INVALID_STATE, "generate");
  EXPECT_NE(rsp.error().message().find("KV cache"), std::string::npos) << rsp.error().message();
  ASSERT_TRUE(child.wake_up({pb::WAKE_TAG_KV_CACHE}).ok());
  ASSERT_TRUE(require_ok(generate(child, prompt, p)).ok()) << "awake again";

  // While a publication is open its weights are being written.
  trainer_ranks trainer(2);
  const auto weights = synthetic_canonical(1);
  const auto header = publication_header(2, 1, "pub-generate");
  const auto chunks = pack(weights);
  ASSERT_TRUE(require_ok(init_transfer(child)).ok());
  ASSERT_TRUE(require_ok(start_update(child, header)).ok());
  const auto chunk = [&](std::size_t k) {
    return trainer.chunk(weights, chunks, k, "pub-generate");
  };
  ASSERT_TRUE(require_ok(update_weights(child, chunk(0))).ok());
  rsp = generate(child, prompt, p);
  expect_error(rsp, pb::ERROR_CODE_INVALID_STATE, "generate");
  EXPECT_NE(rsp.error().message().find("publication 'pub-generate' is open"), std::string::npos)
    << rsp.error().message();
  rsp = score(child, scored, 5);
  expect_error(rsp, pb::ERROR_CODE_INVALID_STATE, "score");
  EXPECT_NE(rsp.error().message().find("cannot score while publication 'pub-generate' is open"),
            std::string::npos)
    << rsp.error().message();
  for (std::size_t k = 1; k < chunks.size(); ++k)
    ASSERT_TRUE(require_ok(update_weights(child, chunk(k))).ok());
  ASSERT_TRUE(require_ok(finish_update(child, "pub-generate", 1)).ok());
  ASSERT_TRUE(require_ok(release_ipc(child, "pub-generate")).ok());
  const auto after = require_ok(generate(child, prompt, p)).generate();
  EXPECT_EQ(after.model_version(), 1u);
  EXPECT_LT(reference_delta(after, tp1_residents(weights), p), inf::parity_tolerance)
    << "generation uses the published weights";

  // Sleep level 2 drops the weights: woken storage is zero-filled, not valid.
  ASSERT_TRUE(child.sleep(2).ok());
  ASSERT_TRUE(child.wake_up({}).ok());
  rsp = generate(child, prompt, p);
  expect_error(rsp, pb::ERROR_CODE_INVALID_STATE, "generate");
  EXPECT_NE(rsp.error().message().find("not valid"), std::string::npos) << rsp.error().message();
  expect_error(score(child, scored, 5), pb::ERROR_CODE_INVALID_STATE, "score");
}

// ---------------------------------------------------------------- score and generation stats

class ScoreTest : public ::testing::TestWithParam<std::uint32_t> {};

// The SCORE command's fp32 teacher forcing reproduces the CPU engine's generated logprobs bit
// for bit (temperature 1 or 0, no filters: plain log-softmax), agrees with the unsharded
// reference forward, and the generation stats count what the decode steps did.
TEST_P(ScoreTest, ReproducesTheGeneratedLogprobsExactlyAndStatsCountTheDecodeSteps) {
  const std::uint32_t tp = GetParam();
  runtime_child child(args_for(tp));
  const auto& cfg = tiny_config();
  const std::uint32_t len = 13, max_tokens = 9;
  const std::vector<std::vector<std::int32_t>> prompts = {
    prompt_tokens(len, 1), prompt_tokens(len, 2), prompt_tokens(len, 3)};
  for (const float temperature : {1.0f, 0.0f}) {
    SCOPED_TRACE("temperature " + std::to_string(temperature));
    ASSERT_TRUE(require_ok(child.call(child.request(pb::COMMAND_RESET_PREFIX_CACHE))).ok());
    const auto gen = require_ok(generate(child, prompts, sampling(temperature, max_tokens, 1, 0, 1.0f, 5)))
                       .generate();
    ASSERT_EQ(gen.samples_size(), 3);
    std::vector<std::vector<std::int32_t>> sequences;
    std::vector<inf::scored_sequence> ref_input;
    for (const auto& s : gen.samples()) {
      auto seq = ids(s.prompt_token_ids());
      const auto out = ids(s.token_ids());
      ASSERT_EQ(out.size(), max_tokens);
      ref_input.push_back({seq, out});
      seq.insert(seq.end(), out.begin(), out.end());
      sequences.push_back(seq);
    }
    const auto scored = require_ok(score(child, sequences, len)).score();
    EXPECT_EQ(scored.model_version(), 0u);
    ASSERT_EQ(scored.sequences_size(), 3);
    const auto ref = inf::reference_logprobs(cfg, tp1_residents(checkpoint_canonical()).pointers(),
                                             ref_input, sampling(1.0f, max_tokens));
    for (int i = 0; i < 3; ++i) {
      const auto got = floats(scored.sequences(i).logprobs());
      EXPECT_EQ(got, floats(gen.samples(i).logprobs())) << "sequence " << i << ": bitwise";
      ASSERT_EQ(got.size(), ref[static_cast<std::size_t>(i)].size());
      for (std::size_t t = 0; t < got.size(); ++t)
        EXPECT_NEAR(got[t], ref[static_cast<std::size_t>(i)][t], inf::parity_tolerance);
    }

    const auto& st = gen.stats();
    EXPECT_EQ(st.prompt_tokens(), 3u * len);
    EXPECT_EQ(st.computed_prompt_tokens(), 3u * len);
    EXPECT_EQ(st.generated_tokens(), 3u * max_tokens);
    EXPECT_EQ(st.waves(), 1u);
    EXPECT_EQ(st.decode_steps(), max_tokens - 1);
    EXPECT_EQ(st.decode_tokens(), 3u * (max_tokens - 1));
    // Step k (1-based) feeds position len + k - 1 and attends len + k positions.
    std::uint64_t positions = 0;
    for (std::uint32_t k = 1; k < max_tokens; ++k)
      positions += 3 * (len + k);
    EXPECT_EQ(st.decode_kv_positions(), positions);
    EXPECT_TRUE(st.expert_loads_counted());
    const std::uint64_t per_layer_min = cfg.num_experts_per_tok;
    const std::uint64_t per_layer_max = std::min<std::uint64_t>(cfg.num_experts, 3 * cfg.num_experts_per_tok);
    EXPECT_GE(st.decode_expert_loads(), st.decode_steps() * cfg.num_hidden_layers * per_layer_min);
    EXPECT_LE(st.decode_expert_loads(), st.decode_steps() * cfg.num_hidden_layers * per_layer_max);
    const std::uint64_t kv_heads = std::max<std::uint32_t>(1, cfg.num_key_value_heads / tp);
    EXPECT_EQ(st.kv_bytes_per_position(), std::uint64_t{cfg.num_hidden_layers} * 2 * kv_heads * cfg.head_dim * 4);
    EXPECT_GT(st.prefill_seconds(), 0.0);
    EXPECT_GT(st.decode_seconds(), 0.0);
    EXPECT_GT(st.first_token_seconds(), 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, ScoreTest, ::testing::Values(1u, 2u),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

TEST(Score, BadRequestsNameTheFieldAndTheRuntimeKeepsServing) {
  runtime_child child(args_for(2));
  const auto seq = prompt_tokens(12);
  expect_error(score(child, {}, 1), pb::ERROR_CODE_INVALID_ARGUMENT, "score.sequences");
  expect_error(score(child, {seq}, 0), pb::ERROR_CODE_INVALID_ARGUMENT, "score.start");
  auto rsp = score(child, {seq, prompt_tokens(5)}, 5);
  expect_error(rsp, pb::ERROR_CODE_INVALID_ARGUMENT, "score.sequences[1].token_ids");
  EXPECT_NE(rsp.error().message().find("leaves none to score"), std::string::npos)
    << rsp.error().message();
  auto bad = seq;
  bad[3] = 256;
  rsp = score(child, {seq, bad}, 4);
  expect_error(rsp, pb::ERROR_CODE_INVALID_ARGUMENT, "score.sequences[1].token_ids[3]");
  EXPECT_NE(rsp.error().message().find("outside the vocabulary"), std::string::npos);
  bad[3] = -1;
  expect_error(score(child, {bad}, 4), pb::ERROR_CODE_INVALID_ARGUMENT,
               "score.sequences[0].token_ids[3]");
  rsp = score(child, {prompt_tokens(20000)}, 4);
  expect_error(rsp, pb::ERROR_CODE_INVALID_ARGUMENT, "score.sequences[0].token_ids");
  EXPECT_NE(rsp.error().message().find("KV blocks"), std::string::npos) << rsp.error().message();
  const auto ok = require_ok(score(child, {seq}, 4)).score();
  ASSERT_EQ(ok.sequences_size(), 1);
  EXPECT_EQ(ok.sequences(0).logprobs_size(), 8);
  for (float lp : ok.sequences(0).logprobs())
    EXPECT_LT(lp, 0.0f);
}

// Redirects this process's stderr into a temporary file while a child is spawned, so the
// child's log lines (which it writes to its inherited stderr) can be read back.
class captured_stderr {
public:
  captured_stderr() {
    char path[] = "/tmp/refit-runtime-stderr-XXXXXX";
    fd_ = ::mkstemp(path);
    if (fd_ < 0)
      throw std::runtime_error("mkstemp failed");
    path_ = path;
    saved_ = ::dup(STDERR_FILENO);
    ::dup2(fd_, STDERR_FILENO);
  }
  // Restores this process's stderr (the spawned child keeps writing to the file).
  void restore() {
    if (saved_ >= 0) {
      ::dup2(saved_, STDERR_FILENO);
      ::close(saved_);
      saved_ = -1;
    }
  }
  ~captured_stderr() {
    restore();
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  std::string text() const {
    std::ifstream in(path_);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

private:
  int fd_ = -1;
  int saved_ = -1;
  std::string path_;
};

struct generate_log {
  std::uint64_t model_version = 0;
  std::uint64_t prefix_hit_tokens = 0;
};

// The "generate: ..." log lines of the child, in order.
std::vector<generate_log> generate_logs(const std::string& text) {
  const auto field = [](const std::string& line, const std::string& key) {
    const auto at = line.find(" " + key + "=");
    if (at == std::string::npos)
      throw std::runtime_error("no " + key + " in: " + line);
    return std::stoull(line.substr(at + key.size() + 2));
  };
  std::vector<generate_log> logs;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos)
      end = text.size();
    const std::string line = text.substr(start, end - start);
    if (line.find("]: generate: ") != std::string::npos)
      logs.push_back({field(line, "model_version"), field(line, "prefix_hit_tokens")});
    start = end + 1;
  }
  return logs;
}

TEST(Generation, PrefixCacheIsReusedWithinAVersionAndNeverAcrossPublications) {
  captured_stderr log;
  runtime_child child(args_for(2));
  log.restore();
  // 40 tokens = 2 full KV blocks of 16 positions + 8; a repeat reuses the 2 full blocks.
  const std::vector<std::vector<std::int32_t>> prompt = {prompt_tokens(40, 4)};
  const auto p = sampling(0.0f, 6);

  const auto cold = require_ok(generate(child, prompt, p)).generate();
  const auto warm = require_ok(generate(child, prompt, p)).generate();
  EXPECT_EQ(ids(warm.samples(0).token_ids()), ids(cold.samples(0).token_ids()));
  const auto v0_logprobs = floats(cold.samples(0).logprobs());
  for (int t = 0; t < warm.samples(0).logprobs_size(); ++t)
    EXPECT_NEAR(warm.samples(0).logprobs(t), v0_logprobs[static_cast<std::size_t>(t)], 1e-5f);

  auto rsp = require_ok(child.call(pb::COMMAND_RESET_PREFIX_CACHE));
  EXPECT_EQ(rsp.reset_prefix_cache().entries_dropped(), 2u);
  require_ok(generate(child, prompt, p)); // recomputes and re-registers the 2 blocks

  // Publish version 1 (other weights). Committing drops the prefix cache.
  trainer_ranks trainer(2);
  const auto v1 = synthetic_canonical(1);
  const auto header = publication_header(2, 1, "pub-prefix");
  EXPECT_TRUE(publish(child, trainer, v1, header).prefix_cache_reset());
  ASSERT_TRUE(require_ok(release_ipc(child, "pub-prefix")).ok());
  rsp = require_ok(child.call(pb::COMMAND_RESET_PREFIX_CACHE));
  EXPECT_EQ(rsp.reset_prefix_cache().entries_dropped(), 0u) << "the commit emptied the cache";

  const auto tp1 = tp1_residents(v1);
  const auto fresh = require_ok(generate(child, prompt, p)).generate();
  EXPECT_EQ(fresh.model_version(), 1u);
  EXPECT_EQ(ids(fresh.samples(0).token_ids()), reference_greedy(tp1, prompt[0], 6));
  EXPECT_LT(reference_delta(fresh, tp1, p), inf::parity_tolerance)
    << "the same prompt after the publication equals a fresh computation with the new weights";
  float moved = 0.0f;
  for (int t = 0; t < fresh.samples(0).logprobs_size(); ++t)
    moved = std::max(moved, std::fabs(fresh.samples(0).logprobs(t)
                                      - v0_logprobs[static_cast<std::size_t>(t)]));
  EXPECT_GT(moved, 10 * inf::parity_tolerance) << "the new weights change the logprobs";
  const auto again = require_ok(generate(child, prompt, p)).generate();
  EXPECT_EQ(ids(again.samples(0).token_ids()), ids(fresh.samples(0).token_ids()));
  EXPECT_LT(reference_delta(again, tp1, p), inf::parity_tolerance);
  rsp = require_ok(child.call(pb::COMMAND_RESET_PREFIX_CACHE));
  EXPECT_EQ(rsp.reset_prefix_cache().entries_dropped(), 2u);

  // The child's own counters: prefix hits happened only within one weights version.
  const auto logs = generate_logs(log.text());
  ASSERT_EQ(logs.size(), 5u) << log.text();
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> expected = {
    {0, 0}, {0, 32}, {0, 0}, {1, 0}, {1, 32}};
  for (std::size_t i = 0; i < logs.size(); ++i) {
    EXPECT_EQ(logs[i].model_version, expected[i].first) << "request " << i;
    EXPECT_EQ(logs[i].prefix_hit_tokens, expected[i].second) << "request " << i;
  }
}

} // namespace
