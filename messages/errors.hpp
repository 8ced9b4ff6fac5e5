// refit's error codes (CAF error category "refit"). Every failure an actor reports is one of
// these, with a context message that says what was wrong and where (see make_refit_error).
#pragma once

#include <cstdint>
#include <string>

#include <caf/error.hpp>
#include <caf/make_message.hpp>

namespace refit {

enum class errc : std::uint8_t {
  none = 0,
  // Answers of the runtime (mirrors control.proto ErrorCode).
  runtime_unsupported = 1,
  runtime_invalid_argument,
  runtime_invalid_state,
  runtime_protocol_version,
  runtime_malformed,
  runtime_internal,
  runtime_validation,
  runtime_injected,
  // Channel / process failures: the runtime is BROKEN afterwards.
  protocol_error = 20,     // invalid frame or a response that does not match its request
  runtime_timeout,         // no answer within the command's timeout
  runtime_exited,          // EOF / the child process died
  spawn_failed,            // the runtime could not be started
  // Refusals and state errors of the rollout API (nothing was sent to the runtime).
  not_attached = 40,       // no runtime attached (restarting or never started)
  broken,                  // the connection is BROKEN; the runtime is being replaced
  busy,                    // another request is in flight (one at a time)
  asleep,                  // generate while weights or KV cache are not awake
  update_open,             // generate/sleep while a weight update is open
  needs_publication,       // weights invalid (fresh runtime or sleep level 2) until a commit
  invalid_argument,
  invalid_state,
  validation_failed,       // a child answer failed parent-side validation
  poisoned,                // the runtime was poisoned on purpose after a failed publication
  restart_limit,           // the supervisor exhausted its restart budget
  shutting_down,
  // Weight publication (SyncCoordinator / ConsensusGate / TrainerRank).
  preflight_failed = 60,   // topology, buffer or memory check failed before any materialization
  gate_failed,             // a rank failed or missed a phase; every rank got the same failure
  manifest_mismatch,       // a rank's actual manifest differs from the expected plan
  verification_failed,     // byte-exact checksums differ from the trainer's weights
  // Multi-process deployment (refit-coordinator serve, trainer processes over CAF's network).
  unauthorized = 70,       // hello/join/status without the right shared secret
  protocol_mismatch,       // the peer speaks another refit wire protocol (version or interface)
  join_refused,            // rank out of range or already joined, another world size or model
  rank_lost,               // a trainer rank's process left while a publish was waiting or running
  coordinator_lost,        // the coordinator went away (process died, connection lost)
  coordinator_unreachable, // no coordinator answered at the configured address in time
  barrier_timeout,         // not every rank called publish(v) within serve.publish_barrier_ms
};

const char* to_string(errc code);

// Builds an error whose context is (where, message): `where` names the config key, frame
// field, command or tensor the error is about.
caf::error make_refit_error(errc code, std::string where, std::string message);

// "refit.<code> at <where>: <message>" for logs and CLI output.
std::string render(const caf::error& err);

// The `where` / message parts of a refit error (empty if absent).
std::string error_where(const caf::error& err);
std::string error_message(const caf::error& err);

} // namespace refit

CAF_ERROR_CODE_ENUM(refit::errc, "refit")
