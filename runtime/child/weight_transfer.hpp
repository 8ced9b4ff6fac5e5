// Weight publication into refit-runtime over the host ("shm") transport, vLLM WTE-style:
//
//   init_weight_transfer -> start_weight_update -> update_weights (once per packed chunk)
//   -> finish_weight_update -> release_ipc
//
// One start/finish pair wraps the whole publication. start validates the header against the
// runtime's own identity and its independently planned qwen3_moe key stream; every chunk's
// tensors are checked against that plan, and each TP worker picks the buffer handle keyed by
// its own device UUID, maps it read-only (once per transfer) and scatters the canonical HF
// tensors into its resident TP layout. finish requires every planned tensor, collects one
// receipt per worker (with resident SHA-256 checksums when the header asks to verify) and
// validates them; the caller then commits. The mappings stay until release_ipc.
//
// Any error during start, update or finish leaves the publication open but failed: every
// later command for it answers INVALID_STATE, since storage may be half-written (the parent
// poisons and kills the runtime).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "messages/control.pb.h"
#include "runtime/child/worker.hpp"
#include "runtime/model/qwen3_moe.hpp"

namespace refit::child {

namespace pb = refit::control::v1;

class weight_transfer {
public:
  // `workers` (one per TP rank, in rank order) must outlive this object.
  weight_transfer(const model::model_config& model, std::shared_ptr<const model::tp_layout> layout,
                  const std::vector<std::unique_ptr<worker>>& workers);

  // The header of the publication between start and finish (also after it failed), or
  // nullptr: while one is open, resident storage is being written.
  const pb::PublicationHeader* open_publication() const;
  // Direct mode: the workers' resident arenas are exported (init_weight_transfer with
  // PUBLICATION_MODE_DIRECT until release_ipc); trainer ranks may be writing them.
  bool exported() const { return session_ && session_->mode == pb::PUBLICATION_MODE_DIRECT; }

  // The caller checks that the weights are awake. Every command throws command_error.
  pb::InitWeightTransferResult init(const pb::InitWeightTransferRequest& request);
  // `committed_version`: the runtime's model version, which the header's must exceed.
  pb::StartWeightUpdateResult start(const pb::StartWeightUpdateRequest& request,
                                    std::uint64_t committed_version);
  pb::UpdateWeightsResult update(const pb::UpdateWeightsRequest& request);
  // Returns the validated receipts; the caller commits the version and resets the cache.
  pb::FinishWeightUpdateResult finish(const pb::FinishWeightUpdateRequest& request);
  pb::ReleaseIpcResult release(const pb::ReleaseIpcRequest& request);

private:
  struct publication {
    pb::PublicationHeader header;
    // Per planned tensor: the chunk it arrived in, if it did.
    std::vector<std::optional<std::uint32_t>> arrived_in_chunk;
    std::uint64_t arrived = 0;
    std::uint32_t next_chunk = 0;
    std::optional<std::uint32_t> last_chunk;
    bool finished = false;
    std::optional<std::string> failure;
  };
  // What init_weight_transfer set up; lives until release_ipc.
  struct session {
    std::string transport;
    std::uint64_t buffer_bytes = 0;
    std::uint32_t buffer_count = 0;
    pb::PublicationMode mode = pb::PUBLICATION_MODE_PACKED;
    std::optional<publication> current;
  };
  // A planned tensor of a chunk and where its canonical bytes lie in the packed buffer.
  struct packed_tensor {
    const model::param_meta* param = nullptr;
    std::uint64_t offset = 0;
  };

  // Runs `body`; an exception while a publication is open marks it failed.
  template <class Body>
  auto failing_publication_on_error(Body&& body);
  // The open publication `publication_id` that `command` may act on.
  publication& require_open(const std::string& command, const std::string& publication_id);
  void validate_header(const pb::PublicationHeader& header, std::uint64_t committed_version) const;
  void validate_chunk_order(const publication& pub, const pb::UpdateWeightsRequest& request) const;
  void validate_handles(const pb::UpdateWeightsRequest& request) const;
  // Checks every tensor against the plan and records its arrival.
  std::vector<packed_tensor> claim_tensors(publication& pub,
                                           const pb::UpdateWeightsRequest& request);
  // Worker thread: picks this worker's buffer, maps it once, scatters `tensors` from it.
  void load_chunk(worker& w, const pb::UpdateWeightsRequest& request,
                  const std::vector<packed_tensor>& tensors) const;
  // Worker thread: the worker's receipt for `header`.
  pb::Receipt receipt_of(const worker& w, const pb::PublicationHeader& header) const;
  void validate_receipts(const std::vector<pb::Receipt>& receipts,
                         const pb::PublicationHeader& header) const;

  const std::vector<model::param_meta> expected_;
  const std::string expected_fingerprint_;
  std::unordered_map<std::string, std::size_t> expected_index_; // name -> index in expected_
  const std::shared_ptr<const model::tp_layout> layout_;
  const std::vector<std::unique_ptr<worker>>& workers_;
  std::optional<session> session_;
};

} // namespace refit::child
