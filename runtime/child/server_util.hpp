// Internal to refit-runtime's control server (server.cpp, commands.cpp, faults.cpp): constants
// and the small helpers that build responses and translate generation requests.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/child/server.hpp"
#include "runtime/control/protocol.hpp"
#include "runtime/control/protocol_version.hpp"

namespace refit::child::detail {

inline std::string command_name(pb::Command command) { return protocol::command_name(command); }

constexpr const char* runtime_kind = "refit-runtime";
constexpr const char* runtime_version = "0.1.0";
constexpr std::uint32_t wrong_protocol_version = 99;
constexpr int fault_exit_code = 3;
constexpr auto write_timeout = std::chrono::seconds(30);
// Generation: KV block (prefix-cache granularity) and how long a TP worker waits for the
// others inside one collective before the group is aborted.
constexpr std::uint32_t kv_block_size = 16;
constexpr auto collective_timeout = std::chrono::seconds(120);

inline inference::engine_options generation_options(const server_options& server) {
  inference::engine_options o;
  o.block_size = kv_block_size;
  o.compute_threads = 1; // one core per TP worker thread
  o.compute_dtype = server.compute_dtype;
  o.max_batch = server.max_batch;
  return o;
}

inline inference::generate_input to_input(const pb::GenerateRequest& request) {
  inference::generate_input in;
  for (const auto& prompt : request.prompts())
    in.prompts.emplace_back(prompt.token_ids().begin(), prompt.token_ids().end());
  const auto& p = request.params();
  in.params.n = p.n();
  in.params.max_tokens = p.max_tokens();
  in.params.temperature = p.temperature();
  in.params.top_k = p.top_k();
  in.params.top_p = p.top_p();
  in.params.seed = p.seed();
  in.params.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  in.params.max_prompt_length = p.max_prompt_length();
  return in;
}

inline pb::GenerateStats to_proto(const inference::generate_stats& st) {
  pb::GenerateStats out;
  out.set_prompt_tokens(st.prompt_tokens);
  out.set_computed_prompt_tokens(st.computed_prompt_tokens);
  out.set_prefix_hit_tokens(st.prefix_hit_tokens);
  out.set_generated_tokens(st.generated_tokens);
  out.set_waves(st.waves);
  out.set_forward_passes(st.forward_passes);
  out.set_prefill_seconds(st.prefill_seconds);
  out.set_decode_seconds(st.decode_seconds);
  out.set_first_token_seconds(st.first_token_seconds);
  out.set_decode_steps(st.decode_steps);
  out.set_decode_tokens(st.decode_tokens);
  out.set_decode_kv_positions(st.decode_kv_positions);
  out.set_decode_expert_loads(st.decode_expert_loads);
  out.set_expert_loads_counted(st.expert_loads_counted);
  out.set_kv_bytes_per_position(st.kv_bytes_per_position);
  out.set_max_live_samples(st.max_live_samples);
  out.set_graph_replays(st.graph_replays);
  out.set_graph_captures(st.graph_captures);
  out.set_peak_workspace_bytes(st.peak_workspace_bytes);
  out.set_decode_steps_ahead(st.decode_steps_ahead);
  out.set_decode_rows_dropped(st.decode_rows_dropped);
  out.set_preload_gemms(st.preload_gemms);
  return out;
}

// Where two ranks' samples first differ ("" when identical).
inline std::string first_difference(const std::vector<inference::generation>& a,
                             const std::vector<inference::generation>& b) {
  if (a.size() != b.size())
    return std::to_string(a.size()) + " vs " + std::to_string(b.size()) + " samples";
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i])
      return "sample " + std::to_string(i) + " (prompt " + std::to_string(a[i].prompt_index)
             + ") differs";
  return {};
}

inline std::string payload_name(pb::Request::PayloadCase payload) {
  if (payload == pb::Request::PAYLOAD_NOT_SET)
    return "none";
  return pb::Request::descriptor()->FindFieldByNumber(payload)->name();
}

// Sets the (empty) result case that belongs to `command`; used by faults, which answer
// without running the command.
inline void set_empty_result(pb::Response& response, pb::Command command) {
  const auto* field = pb::Response::descriptor()->FindFieldByNumber(
    protocol::result_case_for(command));
  response.GetReflection()->MutableMessage(&response, field);
}

// A command other than `command` (for the wrong_command / wrong_result faults).
inline pb::Command other_command(pb::Command command) {
  return command == pb::COMMAND_DESCRIBE ? pb::COMMAND_SHUTDOWN : pb::COMMAND_DESCRIBE;
}

inline pb::Response envelope(std::uint64_t request_id, pb::Command command) {
  pb::Response response;
  response.set_protocol_version(wire::protocol_version);
  response.set_request_id(request_id);
  response.set_command(command);
  return response;
}

inline void set_error(pb::Response& response, pb::ErrorCode code, const std::string& where,
               const std::string& message) {
  response.clear_result();
  response.set_ok(false);
  auto* error = response.mutable_error();
  error->set_code(code);
  error->set_where(where);
  error->set_message(message);
}

} // namespace refit::child::detail
