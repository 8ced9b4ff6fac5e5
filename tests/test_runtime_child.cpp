// Process tests of the refit-runtime child executable: spawn the real binary, talk control
// frames over its socket, and observe state, memory (RssAnon), exit codes and faults.
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <fcntl.h>
#include <optional>
#include <poll.h>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "messages/control.pb.h"
#include "runtime/config.hpp"
#include "runtime/device.hpp"
#include "runtime/framing.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/process.hpp"
#include "runtime/protocol.hpp"
#include "runtime/protocol_version.hpp"

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
    EXPECT_EQ(w.weight_bytes_resident(), layout.resident_bytes());
    EXPECT_EQ(w.kv_cache_bytes_resident(), small_kv_bytes);
    EXPECT_EQ(w.weight_bytes_offloaded(), 0u);
    EXPECT_GT(w.device_free_bytes(), 0u);
    EXPECT_EQ(w.resident_tensor_count(), layout.residents().size());
  }
}

INSTANTIATE_TEST_SUITE_P(Tp, DescribeTest, ::testing::Values(1u, 2u),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

// ---------------------------------------------------------------------------- sleep / wake

constexpr std::uint64_t rss_slack = 8u << 20;

TEST(RuntimeChildMemory, SleepLevel1OffloadsWeightsAndWakeRestoresThem) {
  runtime_child child(args_for(2, large_kv_bytes));
  const auto layout = tiny_layout(2);
  const std::uint64_t per_worker = layout.resident_bytes() + large_kv_bytes;
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
    EXPECT_EQ(w.weight_bytes_offloaded(), layout.resident_bytes());
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
    EXPECT_EQ(w.weight_bytes_resident(), layout.resident_bytes());
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
  EXPECT_LE(asleep_rss + layout.resident_bytes() + large_kv_bytes, awake_rss + rss_slack)
    << "awake " << awake_rss << " bytes, asleep " << asleep_rss << " bytes";

  rsp = child.wake_up({});
  ASSERT_TRUE(rsp.ok()) << rsp.error().message();
  const auto& woken = rsp.wake_up().state();
  EXPECT_EQ(woken.sleep_level(), 0u);
  EXPECT_TRUE(woken.weights_awake());
  EXPECT_TRUE(woken.kv_cache_awake());
  EXPECT_FALSE(woken.weights_valid());
  EXPECT_EQ(woken.workers(0).weight_bytes_resident(), layout.resident_bytes());
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

TEST(RuntimeChildProtocol, UnbuiltCommandsAreUnsupported) {
  runtime_child child(args_for(1));
  for (pb::Command command :
       {pb::COMMAND_GENERATE, pb::COMMAND_INIT_WEIGHT_TRANSFER, pb::COMMAND_START_WEIGHT_UPDATE,
        pb::COMMAND_UPDATE_WEIGHTS, pb::COMMAND_FINISH_WEIGHT_UPDATE, pb::COMMAND_RELEASE_IPC}) {
    const std::string name = refit::protocol::command_name(command);
    SCOPED_TRACE(name);
    auto req = child.request(command);
    auto rsp = child.call(req);
    EXPECT_EQ(rsp.request_id(), req.request_id());
    EXPECT_EQ(rsp.command(), command);
    expect_error(rsp, pb::ERROR_CODE_UNSUPPORTED, name);
    EXPECT_NE(rsp.error().message().find(name + " is not supported"), std::string::npos)
      << rsp.error().message();
  }
}

TEST(RuntimeChildProtocol, RejectsAnotherProtocolVersion) {
  runtime_child child(args_for(1));
  auto req = child.request(pb::COMMAND_DESCRIBE);
  req.set_protocol_version(2);
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

} // namespace
