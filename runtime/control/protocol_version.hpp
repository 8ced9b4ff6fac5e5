// Version of the control protocol in messages/control.proto. The parent sends it in every
// Request; refit-runtime echoes it and answers ERROR_CODE_PROTOCOL_VERSION to any other.
#pragma once

#include <cstdint>

namespace refit::wire {

inline constexpr std::uint32_t protocol_version = 4; // 2: header.producer_pids
                                                     // 3: GenerateResult.stats, SCORE
                                                     // 4: publication mode (direct), resident exports
// Version of the refit wire protocol between trainer processes and the coordinator (the
// join handshake and every message of messages/net_types.hpp that crosses CAF's network
// layer). A hello or join with another version is refused with errc::protocol_mismatch.
// Bump it whenever a message that crosses processes changes shape or meaning.
// 2: the serve handshake before BASP; hello/join tokens only with TLS.
// 3: rank_info.weight_source, publication_spec.tp / verify, rank_report.digest_terms
//    (registered tensors); the registry's generate / sleep / wake.
// 4: the registry's collective_id (NCCL unique ids of trainer processes on GPUs).
// 5: generate_result.stats.
// 6: publication_spec, rank_report and publication_result carry the direct mode.
// 7: generation_stats: max_live_samples, CUDA-graph replays / captures, peak workspace.
inline constexpr std::uint32_t serve_protocol_version = 7;
} // namespace refit::wire
