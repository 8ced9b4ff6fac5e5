// Control-protocol helpers shared by the parent (vLLMRuntimeProxy) and tests: command names,
// the payload/result case each command must carry, response validation, and conversions
// between the protobuf wire types and the actor-side message types (messages/types.hpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "messages/control.pb.h"
#include "messages/types.hpp"
#include "runtime/control/protocol_version.hpp"

namespace refit::protocol {

namespace pb = refit::control::v1;

// "describe", "generate", ..., "shutdown" ("unspecified" for anything else).
const char* command_name(pb::Command cmd);
// Inverse of command_name; nullopt for an unknown name.
std::optional<pb::Command> command_from_name(const std::string& name);

pb::Request::PayloadCase payload_case_for(pb::Command cmd);
pb::Response::ResultCase result_case_for(pb::Command cmd);

// A request envelope with the identity fields set; the caller fills the payload.
pb::Request make_request(std::uint64_t request_id, pb::Command cmd);

// Why a response is not an acceptable answer to (request_id, command).
struct violation {
  std::string field;   // "protocol_version", "request_id", "command", "result", "error"
  std::string message;
};

// Checks version, echoed id and command, and that exactly the right result (ok) or an
// error (not ok) is present. nullopt = acceptable (an ok=false answer is acceptable here;
// the caller maps it to a typed error).
std::optional<violation> validate_response(const pb::Response& rsp, std::uint64_t request_id,
                                           pb::Command cmd);

// ---- conversions
runtime_description from_proto(const pb::DescribeResult& x);
pb::GenerateRequest to_proto(const generate_request& x);
generate_result from_proto(const pb::GenerateResult& x);
pb::ScoreRequest to_proto(const score_request& x);
score_result from_proto(const pb::ScoreResult& x);
pb::WakeUpRequest to_proto(const wake_tags& x);
pb::InitWeightTransferRequest to_proto(const transfer_init& x);
pb::PublicationHeader to_proto(const publication_header& x);
publication_header from_proto(const pb::PublicationHeader& x);
pb::UpdateWeightsRequest to_proto(const weight_chunk& x);
weight_chunk from_proto(const pb::UpdateWeightsRequest& x);
chunk_ack from_proto(const pb::UpdateWeightsResult& x);
pb::FinishWeightUpdateRequest to_proto(const finish_request& x);
commit_result from_proto(const pb::FinishWeightUpdateResult& x);

} // namespace refit::protocol
