// vLLMRuntimeProxy: owns the spawned refit-runtime process (own process group, TP device list
// from config) and its versioned protobuf control channel. See interfaces.hpp for the
// contract. Blocking work (spawn, frame I/O, kill/reap) runs on the proc::runtime_channel
// thread the proxy owns; the actor itself only validates and routes.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/interfaces.hpp"
#include "runtime/config/config.hpp"
#include "runtime/control/runtime_channel.hpp"

namespace refit {

struct runtime_proxy_options {
  config::runtime_config runtime;
  model::model_config model;
  std::uint64_t seed = 0;            // checkpoint weights of the runtime (version 0)
  float init_scale = 0.02f;          // ... and their scale
  std::string model_path;            // a Hugging Face model directory ("" = synthetic weights)
  std::string publication_mode = "packed"; // publication.mode: direct => exportable residents
  std::string executable_path;       // resolved path of refit-runtime
  std::vector<std::string> scrub_env; // environment variables the runtime must not inherit
};

// Builds the refit-runtime command line for `opts` (exposed for tests and docs).
std::vector<std::string> runtime_arguments(const runtime_proxy_options& opts);

// A blocking-thread event, as a message to the proxy.
struct channel_message {
  std::uint8_t kind = 0;
  std::uint64_t request_id = 0;
  std::int32_t pid = -1;
  std::uint8_t code = 0;
  std::string payload;
  std::string detail;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, channel_message& x) {
  return f(caf::meta::type_name("channel_message"), x.kind, x.request_id, x.pid, x.code,
           x.payload, x.detail);
}

using runtime_proxy_impl
  = runtime_proxy_actor::extend<caf::reacts_to<io_done_atom, channel_message>>;

struct runtime_proxy_state {
  static inline const char* name = "vLLMRuntimeProxy";

  enum class phase : std::uint8_t { running, broken, stopping };

  struct call {
    std::uint64_t id = 0;
    std::uint32_t command = 0;          // control::v1::Command
    std::string bytes;                  // serialized Request
    std::chrono::milliseconds timeout{0};
    std::function<void(const std::string& response_bytes)> on_ok; // validated ok response
    std::function<void(const caf::error&)> on_error;
    std::int64_t trace_start_ns = 0;    // --trace: when it went on the wire (trace::start)
  };

  runtime_proxy_options opts;
  phase ph = phase::running;
  std::deque<call> queue;              // waiting; one request on the wire at a time
  std::optional<call> inflight;
  std::uint64_t next_id = 1;
  std::int32_t pid = -1;
  caf::error failure;                  // why the proxy is going away
  std::vector<std::function<void()>> after_reap; // replies owed once the group is gone
  std::unique_ptr<proc::runtime_channel> channel; // last member: joined first on destruction

  ~runtime_proxy_state();
};

runtime_proxy_impl::behavior_type
runtime_proxy(runtime_proxy_impl::stateful_pointer<runtime_proxy_state> self,
              runtime_proxy_options opts);

} // namespace refit
