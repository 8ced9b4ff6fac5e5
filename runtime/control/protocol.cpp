#include "runtime/control/protocol.hpp"

#include <array>
#include <utility>

namespace refit::protocol {

namespace {

struct command_row {
  pb::Command cmd;
  const char* name;
  pb::Request::PayloadCase payload;
  pb::Response::ResultCase result;
};

// One row per command: the single source of truth for names and oneof cases.
constexpr std::array<command_row, 12> command_table{{
  {pb::COMMAND_DESCRIBE, "describe", pb::Request::kDescribe, pb::Response::kDescribe},
  {pb::COMMAND_GENERATE, "generate", pb::Request::kGenerate, pb::Response::kGenerate},
  {pb::COMMAND_SLEEP, "sleep", pb::Request::kSleep, pb::Response::kSleep},
  {pb::COMMAND_WAKE_UP, "wake_up", pb::Request::kWakeUp, pb::Response::kWakeUp},
  {pb::COMMAND_INIT_WEIGHT_TRANSFER, "init_weight_transfer", pb::Request::kInitWeightTransfer,
   pb::Response::kInitWeightTransfer},
  {pb::COMMAND_START_WEIGHT_UPDATE, "start_weight_update", pb::Request::kStartWeightUpdate,
   pb::Response::kStartWeightUpdate},
  {pb::COMMAND_UPDATE_WEIGHTS, "update_weights", pb::Request::kUpdateWeights,
   pb::Response::kUpdateWeights},
  {pb::COMMAND_FINISH_WEIGHT_UPDATE, "finish_weight_update", pb::Request::kFinishWeightUpdate,
   pb::Response::kFinishWeightUpdate},
  {pb::COMMAND_RELEASE_IPC, "release_ipc", pb::Request::kReleaseIpc, pb::Response::kReleaseIpc},
  {pb::COMMAND_RESET_PREFIX_CACHE, "reset_prefix_cache", pb::Request::kResetPrefixCache,
   pb::Response::kResetPrefixCache},
  {pb::COMMAND_SHUTDOWN, "shutdown", pb::Request::kShutdown, pb::Response::kShutdown},
  {pb::COMMAND_SCORE, "score", pb::Request::kScore, pb::Response::kScore},
}};

const command_row* find_row(pb::Command cmd) {
  for (const auto& row : command_table)
    if (row.cmd == cmd)
      return &row;
  return nullptr;
}

} // namespace

const char* command_name(pb::Command cmd) {
  auto* row = find_row(cmd);
  return row ? row->name : "unspecified";
}

std::optional<pb::Command> command_from_name(const std::string& name) {
  for (const auto& row : command_table)
    if (name == row.name)
      return row.cmd;
  return std::nullopt;
}

pb::Request::PayloadCase payload_case_for(pb::Command cmd) {
  auto* row = find_row(cmd);
  return row ? row->payload : pb::Request::PAYLOAD_NOT_SET;
}

pb::Response::ResultCase result_case_for(pb::Command cmd) {
  auto* row = find_row(cmd);
  return row ? row->result : pb::Response::RESULT_NOT_SET;
}

pb::Request make_request(std::uint64_t request_id, pb::Command cmd) {
  pb::Request req;
  req.set_protocol_version(wire::protocol_version);
  req.set_request_id(request_id);
  req.set_command(cmd);
  return req;
}

std::optional<violation> validate_response(const pb::Response& rsp, std::uint64_t request_id,
                                           pb::Command cmd) {
  if (rsp.protocol_version() != wire::protocol_version)
    return violation{"protocol_version", "response has protocol version "
                                           + std::to_string(rsp.protocol_version())
                                           + ", expected " + std::to_string(wire::protocol_version)};
  if (rsp.request_id() != request_id)
    return violation{"request_id", "response echoes request id "
                                     + std::to_string(rsp.request_id()) + ", expected "
                                     + std::to_string(request_id)};
  if (rsp.command() != cmd)
    return violation{"command", std::string("response echoes command '")
                                  + command_name(rsp.command()) + "', expected '"
                                  + command_name(cmd) + "'"};
  if (rsp.ok()) {
    if (rsp.has_error())
      return violation{"error", "response is ok but carries an error"};
    auto expected = result_case_for(cmd);
    if (rsp.result_case() != expected)
      return violation{"result", std::string("ok response to '") + command_name(cmd)
                                   + "' carries result field #"
                                   + std::to_string(static_cast<int>(rsp.result_case()))
                                   + ", expected field #"
                                   + std::to_string(static_cast<int>(expected))};
    return std::nullopt;
  }
  if (!rsp.has_error())
    return violation{"error", "failed response carries no error"};
  if (rsp.result_case() != pb::Response::RESULT_NOT_SET)
    return violation{"result", "failed response also carries a result"};
  return std::nullopt;
}

// ------------------------------------------------------------------------- conversions

runtime_description from_proto(const pb::DescribeResult& x) {
  runtime_description d;
  d.runtime_kind = x.runtime_kind();
  d.runtime_version = x.runtime_version();
  d.tp_world_size = x.tp_world_size();
  for (const auto& w : x.workers()) {
    worker_info wi;
    wi.rank = w.rank();
    wi.device_index = w.device_index();
    wi.device_uuid = w.device_uuid();
    wi.weight_bytes_resident = w.weight_bytes_resident();
    wi.kv_cache_bytes_resident = w.kv_cache_bytes_resident();
    wi.weight_bytes_offloaded = w.weight_bytes_offloaded();
    wi.device_free_bytes = w.device_free_bytes();
    wi.resident_tensor_count = w.resident_tensor_count();
    wi.producer_buffers_open = w.producer_buffers_open();
    wi.producer_buffers_opened = w.producer_buffers_opened();
    wi.resident_export = w.resident_export();
    wi.resident_export_bytes = w.resident_export_bytes();
    d.workers.push_back(std::move(wi));
  }
  d.sleep_level = x.sleep_level();
  d.weights_awake = x.weights_awake();
  d.kv_cache_awake = x.kv_cache_awake();
  d.model_version = x.model_version();
  d.weights_valid = x.weights_valid();
  d.pid = x.pid();
  d.checkpoint_path = x.checkpoint().path();
  d.checkpoint_tensors = x.checkpoint().tensors();
  d.checkpoint_bytes = x.checkpoint().bytes();
  d.checkpoint_fingerprint = x.checkpoint().fingerprint();
  return d;
}

pb::GenerateRequest to_proto(const generate_request& x) {
  pb::GenerateRequest out;
  for (const auto& prompt : x.prompts)
    out.add_prompts()->mutable_token_ids()->Add(prompt.begin(), prompt.end());
  auto* p = out.mutable_params();
  p->set_n(x.params.n);
  p->set_max_tokens(x.params.max_tokens);
  p->set_temperature(x.params.temperature);
  p->set_top_k(x.params.top_k);
  p->set_top_p(x.params.top_p);
  p->set_seed(x.params.seed);
  p->mutable_stop_token_ids()->Add(x.params.stop_token_ids.begin(),
                                   x.params.stop_token_ids.end());
  p->set_max_prompt_length(x.params.max_prompt_length);
  return out;
}

generate_result from_proto(const pb::GenerateResult& x) {
  generate_result out;
  out.model_version = x.model_version();
  for (const auto& s : x.samples()) {
    sample o;
    o.prompt_index = s.prompt_index();
    o.prompt_token_ids.assign(s.prompt_token_ids().begin(), s.prompt_token_ids().end());
    o.token_ids.assign(s.token_ids().begin(), s.token_ids().end());
    o.logprobs.assign(s.logprobs().begin(), s.logprobs().end());
    o.finish_reason = s.finish_reason();
    o.prompt_truncated = s.prompt_truncated();
    o.model_version = x.model_version();
    out.samples.push_back(std::move(o));
  }
  const pb::GenerateStats& st = x.stats();
  generation_stats& g = out.stats;
  g.prompt_tokens = st.prompt_tokens();
  g.computed_prompt_tokens = st.computed_prompt_tokens();
  g.prefix_hit_tokens = st.prefix_hit_tokens();
  g.generated_tokens = st.generated_tokens();
  g.waves = st.waves();
  g.forward_passes = st.forward_passes();
  g.prefill_seconds = st.prefill_seconds();
  g.decode_seconds = st.decode_seconds();
  g.first_token_seconds = st.first_token_seconds();
  g.decode_steps = st.decode_steps();
  g.decode_tokens = st.decode_tokens();
  g.decode_kv_positions = st.decode_kv_positions();
  g.decode_expert_loads = st.decode_expert_loads();
  g.expert_loads_counted = st.expert_loads_counted();
  g.kv_bytes_per_position = st.kv_bytes_per_position();
  g.max_live_samples = st.max_live_samples();
  g.graph_replays = st.graph_replays();
  g.graph_captures = st.graph_captures();
  g.peak_workspace_bytes = st.peak_workspace_bytes();
  g.decode_steps_ahead = st.decode_steps_ahead();
  g.decode_rows_dropped = st.decode_rows_dropped();
  g.preload_gemms = st.preload_gemms();
  return out;
}

pb::ScoreRequest to_proto(const score_request& x) {
  pb::ScoreRequest out;
  for (const auto& seq : x.sequences)
    out.add_sequences()->mutable_token_ids()->Add(seq.begin(), seq.end());
  out.set_start(x.start);
  return out;
}

score_result from_proto(const pb::ScoreResult& x) {
  score_result out;
  out.model_version = x.model_version();
  for (const auto& s : x.sequences())
    out.logprobs.emplace_back(s.logprobs().begin(), s.logprobs().end());
  return out;
}

pb::WakeUpRequest to_proto(const wake_tags& x) {
  pb::WakeUpRequest out;
  // Both tags = "all": sent as an empty list, exactly like wake_up() without tags.
  if (x.weights && x.kv_cache)
    return out;
  if (x.weights)
    out.add_tags(pb::WAKE_TAG_WEIGHTS);
  if (x.kv_cache)
    out.add_tags(pb::WAKE_TAG_KV_CACHE);
  return out;
}

pb::InitWeightTransferRequest to_proto(const transfer_init& x) {
  pb::InitWeightTransferRequest out;
  out.set_transport(x.transport);
  out.set_buffer_bytes(x.buffer_bytes);
  out.set_buffer_count(x.buffer_count);
  out.set_mode(x.mode == "direct" ? pb::PUBLICATION_MODE_DIRECT : pb::PUBLICATION_MODE_PACKED);
  return out;
}

pb::PublicationHeader to_proto(const publication_header& x) {
  pb::PublicationHeader out;
  out.set_protocol_version(x.protocol_version);
  out.set_transport(x.transport);
  out.set_publication_id(x.publication_id);
  out.set_model_version(x.model_version);
  out.set_tp_world_size(x.tp_world_size);
  out.set_manifest_fingerprint(x.manifest_fingerprint);
  for (const auto& u : x.device_uuids)
    out.add_device_uuids(u);
  out.set_expected_tensor_count(x.expected_tensor_count);
  out.set_verify(x.verify);
  for (auto pid : x.producer_pids)
    out.add_producer_pids(pid);
  out.set_mode(x.mode == "direct" ? pb::PUBLICATION_MODE_DIRECT : pb::PUBLICATION_MODE_PACKED);
  return out;
}

publication_header from_proto(const pb::PublicationHeader& x) {
  publication_header out;
  out.protocol_version = x.protocol_version();
  out.transport = x.transport();
  out.publication_id = x.publication_id();
  out.model_version = x.model_version();
  out.tp_world_size = x.tp_world_size();
  out.manifest_fingerprint = x.manifest_fingerprint();
  out.device_uuids.assign(x.device_uuids().begin(), x.device_uuids().end());
  out.expected_tensor_count = x.expected_tensor_count();
  out.verify = x.verify();
  out.producer_pids.assign(x.producer_pids().begin(), x.producer_pids().end());
  out.mode = x.mode() == pb::PUBLICATION_MODE_DIRECT ? "direct" : "packed";
  return out;
}

pb::UpdateWeightsRequest to_proto(const weight_chunk& x) {
  pb::UpdateWeightsRequest out;
  out.set_publication_id(x.publication_id);
  out.set_chunk_index(x.chunk_index);
  out.set_is_first(x.is_first);
  out.set_is_last(x.is_last);
  for (const auto& t : x.tensors) {
    auto* m = out.add_tensors();
    m->set_name(t.name);
    m->mutable_shape()->Add(t.shape.begin(), t.shape.end());
    m->set_dtype(static_cast<pb::DType>(t.dtype));
    m->set_offset(t.offset);
    m->set_nbytes(t.nbytes);
  }
  for (const auto& h : x.handles) {
    auto* b = out.add_handles();
    b->set_device_uuid(h.device_uuid);
    b->set_buffer_index(h.buffer_index);
    b->set_handle(h.handle);
    b->set_size(h.size);
  }
  return out;
}

weight_chunk from_proto(const pb::UpdateWeightsRequest& x) {
  weight_chunk out;
  out.publication_id = x.publication_id();
  out.chunk_index = x.chunk_index();
  out.is_first = x.is_first();
  out.is_last = x.is_last();
  for (const auto& m : x.tensors()) {
    tensor_meta t;
    t.name = m.name();
    t.shape.assign(m.shape().begin(), m.shape().end());
    t.dtype = static_cast<std::uint8_t>(m.dtype());
    t.offset = m.offset();
    t.nbytes = m.nbytes();
    out.tensors.push_back(std::move(t));
  }
  for (const auto& b : x.handles()) {
    buffer_handle h;
    h.device_uuid = b.device_uuid();
    h.buffer_index = b.buffer_index();
    h.handle = b.handle();
    h.size = b.size();
    out.handles.push_back(std::move(h));
  }
  return out;
}

chunk_ack from_proto(const pb::UpdateWeightsResult& x) {
  return chunk_ack{x.chunk_index(), x.tensors_loaded()};
}

pb::FinishWeightUpdateRequest to_proto(const finish_request& x) {
  pb::FinishWeightUpdateRequest out;
  out.set_publication_id(x.publication_id);
  out.set_model_version(x.model_version);
  return out;
}

commit_result from_proto(const pb::FinishWeightUpdateResult& x) {
  commit_result out;
  out.publication_id = x.publication_id();
  out.model_version = x.model_version();
  out.prefix_cache_reset = x.prefix_cache_reset();
  for (const auto& r : x.receipts()) {
    receipt o;
    o.publication_id = r.publication_id();
    o.model_version = r.model_version();
    o.tp_world_size = r.tp_world_size();
    o.manifest_fingerprint = r.manifest_fingerprint();
    o.tp_rank = r.tp_rank();
    o.device_uuid = r.device_uuid();
    o.resident_tensor_count = r.resident_tensor_count();
    for (const auto& c : r.checksums())
      o.checksums.push_back(tensor_checksum{c.name(), c.digest()});
    out.receipts.push_back(std::move(o));
  }
  return out;
}

} // namespace refit::protocol
