#include "runtime/child/weight_transfer.hpp"

#include <limits>
#include <algorithm>
#include <exception>
#include <utility>

#include "runtime/child/command_error.hpp"
#include "runtime/control/protocol_version.hpp"
#include "runtime/trace/trace.hpp"

namespace refit::child {

namespace {

constexpr const char* host_transport = "shm";
constexpr const char* cuda_transport = "cuda_ipc";

std::string quoted(const std::string& text) { return "'" + text + "'"; }

std::string shape_string(const google::protobuf::RepeatedField<std::int64_t>& shape) {
  std::string out = "[";
  for (int i = 0; i < shape.size(); ++i)
    out += (i ? ", " : "") + std::to_string(shape.Get(i));
  return out + "]";
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string wire_dtype_name(pb::DType dt) {
  const std::string& name = pb::DType_Name(dt);
  return name.empty() ? "dtype code " + std::to_string(static_cast<int>(dt)) : name;
}

command_error validation(std::string where, const std::string& message) {
  return command_error(pb::ERROR_CODE_VALIDATION, std::move(where), message);
}

command_error invalid_state(std::string where, const std::string& message) {
  return command_error(pb::ERROR_CODE_INVALID_STATE, std::move(where), message);
}

std::unordered_map<std::string, std::size_t> index_by_name(
  const std::vector<model::param_meta>& params) {
  std::unordered_map<std::string, std::size_t> index;
  index.reserve(params.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    index.emplace(params[i].name, i);
  return index;
}

} // namespace

weight_transfer::weight_transfer(const model::model_config& model,
                                 std::shared_ptr<const model::tp_layout> layout,
                                 const std::vector<std::unique_ptr<worker>>& workers)
  : expected_(model::expected_key_stream(model)),
    expected_fingerprint_(model::structural_manifest(expected_)),
    expected_index_(index_by_name(expected_)),
    layout_(std::move(layout)),
    workers_(workers) {}

const pb::PublicationHeader* weight_transfer::open_publication() const {
  if (!session_ || !session_->current || session_->current->finished)
    return nullptr;
  return &session_->current->header;
}

template <class Body>
auto weight_transfer::failing_publication_on_error(Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    if (session_ && session_->current && !session_->current->finished
        && !session_->current->failure)
      session_->current->failure = e.what();
    throw;
  }
}

// ------------------------------------------------------------------------------- init

pb::InitWeightTransferResult weight_transfer::init(const pb::InitWeightTransferRequest& request) {
  if (session_)
    throw invalid_state("init_weight_transfer",
                        "init_weight_transfer was already called (transport "
                          + quoted(session_->transport) + "); release_ipc first");
  const bool on_cuda = workers_.front()->device_kind() == device::kind::cuda;
  const char* transport = on_cuda ? cuda_transport : host_transport;
  if (request.transport() != transport)
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "init_weight_transfer.transport",
                        "transport " + quoted(request.transport()) + " is not supported: TP "
                          "workers on " + (on_cuda ? "CUDA" : "CPU") + " devices take "
                          + quoted(transport));
  if (request.buffer_bytes() == 0)
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "init_weight_transfer.buffer_bytes",
                        "buffer_bytes must be > 0");
  if (request.buffer_count() == 0)
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "init_weight_transfer.buffer_count",
                        "buffer_count must be >= 1");
  if (request.mode() != pb::PUBLICATION_MODE_PACKED && request.mode() != pb::PUBLICATION_MODE_DIRECT)
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "init_weight_transfer.mode",
                        "publication mode code " + std::to_string(static_cast<int>(request.mode()))
                          + " is neither PACKED nor DIRECT");
  if (request.mode() == pb::PUBLICATION_MODE_DIRECT) {
    for (const auto& w : workers_)
      if (!w->exportable_weights())
        throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "init_weight_transfer.mode",
                            "direct publication needs resident weights trainer ranks can open: "
                            "start refit-runtime with --publication-mode direct "
                            "(publication.mode: direct)");
    // Every worker exports its arena; a failure closes the exports made so far.
    try {
      on_all_workers(workers_, [](worker& w) { w.export_weights(); });
    } catch (...) {
      on_all_workers(workers_, [](worker& w) { w.close_export(); });
      throw;
    }
  }
  session_.emplace();
  session_->transport = request.transport();
  session_->buffer_bytes = request.buffer_bytes();
  session_->buffer_count = request.buffer_count();
  session_->mode = request.mode();

  pb::InitWeightTransferResult result;
  result.set_transport(session_->transport);
  result.set_mode(session_->mode);
  return result;
}

// ------------------------------------------------------------------------------- start

pb::StartWeightUpdateResult weight_transfer::start(const pb::StartWeightUpdateRequest& request,
                                                   std::uint64_t committed_version) {
  return failing_publication_on_error([&] {
    if (!session_)
      throw invalid_state("start_weight_update",
                          "start_weight_update needs init_weight_transfer first");
    if (const auto& current = session_->current) {
      const std::string id = quoted(current->header.publication_id());
      if (current->failure)
        throw invalid_state("start_weight_update",
                            "publication " + id + " failed: " + *current->failure);
      if (current->finished)
        throw invalid_state("start_weight_update",
                            "publication " + id
                              + " is finished; release_ipc and init_weight_transfer before "
                                "the next publication");
      throw invalid_state("start_weight_update",
                          "start_weight_update was already called for publication " + id
                            + " (one start/finish pair wraps a whole publication)");
    }
    const pb::PublicationHeader& header = request.header();
    publication& pub = session_->current.emplace();
    pub.header = header;
    pub.arrived_in_chunk.assign(expected_.size(), std::nullopt);
    validate_header(header, committed_version);

    pb::StartWeightUpdateResult result;
    result.set_publication_id(header.publication_id());
    return result;
  });
}

void weight_transfer::validate_header(const pb::PublicationHeader& header,
                                      std::uint64_t committed_version) const {
  if (header.protocol_version() != wire::protocol_version)
    throw validation("header.protocol_version",
                     "protocol version " + std::to_string(header.protocol_version())
                       + " is not this runtime's " + std::to_string(wire::protocol_version));
  if (header.mode() != session_->mode)
    throw validation("header.mode", "publication mode " + pb::PublicationMode_Name(header.mode())
                                      + " is not the initialized "
                                      + pb::PublicationMode_Name(session_->mode));
  if (header.transport() != session_->transport)
    throw validation("header.transport", "transport " + quoted(header.transport())
                                           + " is not the initialized "
                                           + quoted(session_->transport));
  if (header.publication_id().empty())
    throw validation("header.publication_id", "publication_id is empty");
  if (header.model_version() <= committed_version)
    throw validation("header.model_version",
                     "model version " + std::to_string(header.model_version())
                       + " does not exceed the committed version "
                       + std::to_string(committed_version));
  const auto tp = static_cast<std::uint32_t>(workers_.size());
  if (header.tp_world_size() != tp)
    throw validation("header.tp_world_size",
                     "tp_world_size " + std::to_string(header.tp_world_size())
                       + " is not this runtime's TP world size " + std::to_string(tp));
  if (header.device_uuids_size() != static_cast<int>(tp))
    throw validation("header.device_uuids",
                     std::to_string(header.device_uuids_size()) + " device UUIDs for "
                       + std::to_string(tp) + " TP workers");
  for (std::uint32_t rank = 0; rank < tp; ++rank) {
    const std::string& listed = header.device_uuids(static_cast<int>(rank));
    if (listed != workers_[rank]->device_uuid())
      throw validation("header.device_uuids",
                       "device_uuids[" + std::to_string(rank) + "] is " + quoted(listed)
                         + " but TP worker " + std::to_string(rank) + " runs on "
                         + quoted(workers_[rank]->device_uuid()));
  }
  // Host transport: worker r maps only memfds of trainer rank r's process.
  if (header.transport() == "shm") {
    if (header.producer_pids_size() != static_cast<int>(tp))
      throw validation("header.producer_pids",
                       std::to_string(header.producer_pids_size()) + " producer pids for "
                         + std::to_string(tp) + " TP workers");
    for (int r = 0; r < header.producer_pids_size(); ++r)
      if (header.producer_pids(r) == 0 || header.producer_pids(r) > 0x7fffffffu)
        throw validation("header.producer_pids",
                         "producer_pids[" + std::to_string(r) + "] is "
                           + std::to_string(header.producer_pids(r)) + ", not a process id");
  }
  if (header.manifest_fingerprint() != expected_fingerprint_)
    throw validation("header.manifest_fingerprint",
                     "manifest fingerprint " + quoted(header.manifest_fingerprint())
                       + " is not the fingerprint " + quoted(expected_fingerprint_)
                       + " of this runtime's qwen3_moe key stream");
  if (header.expected_tensor_count() != expected_.size())
    throw validation("header.expected_tensor_count",
                     "expected_tensor_count " + std::to_string(header.expected_tensor_count())
                       + " is not the " + std::to_string(expected_.size())
                       + " tensors of this runtime's qwen3_moe key stream");
}

weight_transfer::publication& weight_transfer::require_open(const std::string& command,
                                                            const std::string& publication_id) {
  if (!session_ || !session_->current)
    throw invalid_state(command, command + " needs an open publication (init_weight_transfer, "
                                             "then start_weight_update)");
  publication& pub = *session_->current;
  const std::string id = quoted(pub.header.publication_id());
  if (pub.failure)
    throw invalid_state(command, "publication " + id + " failed: " + *pub.failure);
  if (pub.finished)
    throw invalid_state(command, "publication " + id + " is already finished");
  if (publication_id != pub.header.publication_id())
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, command + ".publication_id",
                        "publication " + quoted(publication_id)
                          + " is not the open publication " + id);
  return pub;
}

// ------------------------------------------------------------------------------- update

pb::UpdateWeightsResult weight_transfer::update(const pb::UpdateWeightsRequest& request) {
  return failing_publication_on_error([&] {
    publication& pub = require_open("update_weights", request.publication_id());
    validate_chunk_order(pub, request);
    if (session_->mode == pb::PUBLICATION_MODE_DIRECT) {
      // The trainer ranks wrote this chunk's placements into the exported arenas before the
      // chunk was sent (the materialize gate passed): nothing to copy, only to account for.
      if (request.handles_size() != 0)
        throw validation("update_weights.handles",
                         std::to_string(request.handles_size())
                           + " buffer handles in a direct publication (its chunks carry none)");
      claim_tensors(pub, request);
    } else {
      validate_handles(request);
      const std::vector<packed_tensor> tensors = claim_tensors(pub, request);
      on_all_workers(workers_, [&](worker& w) { load_chunk(w, request, tensors); });
    }
    ++pub.next_chunk;
    if (request.is_last())
      pub.last_chunk = request.chunk_index();

    pb::UpdateWeightsResult result;
    result.set_chunk_index(request.chunk_index());
    result.set_tensors_loaded(static_cast<std::uint64_t>(request.tensors_size()));
    return result;
  });
}

void weight_transfer::validate_chunk_order(const publication& pub,
                                           const pb::UpdateWeightsRequest& request) const {
  if (pub.last_chunk)
    throw validation("update_weights.chunk_index",
                     "chunk " + std::to_string(request.chunk_index())
                       + " arrived after chunk " + std::to_string(*pub.last_chunk)
                       + ", which was marked is_last");
  if (request.chunk_index() != pub.next_chunk)
    throw validation("update_weights.chunk_index",
                     "chunk " + std::to_string(request.chunk_index()) + " arrived, expected chunk "
                       + std::to_string(pub.next_chunk));
  if (request.is_first() != (request.chunk_index() == 0))
    throw validation("update_weights.is_first",
                     std::string("is_first is ") + (request.is_first() ? "true" : "false")
                       + " on chunk " + std::to_string(request.chunk_index())
                       + " (it must be true exactly on chunk 0)");
}

void weight_transfer::validate_handles(const pb::UpdateWeightsRequest& request) const {
  for (int i = 0; i < request.handles_size(); ++i) {
    const pb::BufferHandle& handle = request.handles(i);
    const std::string where = "update_weights.handles[" + std::to_string(i) + "]";
    if (handle.buffer_index() >= session_->buffer_count)
      throw validation(where + ".buffer_index",
                       "buffer_index " + std::to_string(handle.buffer_index())
                         + " is out of range: init_weight_transfer announced "
                         + std::to_string(session_->buffer_count) + " buffers");
    if (handle.size() == 0 || handle.size() > session_->buffer_bytes)
      throw validation(where + ".size",
                       "buffer size " + std::to_string(handle.size())
                         + " is outside 1.." + std::to_string(session_->buffer_bytes)
                         + " (buffer_bytes announced by init_weight_transfer)");
    for (int j = 0; j < i; ++j)
      if (request.handles(j).device_uuid() == handle.device_uuid())
        throw validation("update_weights.handles",
                         "handles[" + std::to_string(j) + "] and handles[" + std::to_string(i)
                           + "] are both for device " + quoted(handle.device_uuid()));
  }
}

std::vector<weight_transfer::packed_tensor> weight_transfer::claim_tensors(
  publication& pub, const pb::UpdateWeightsRequest& request) {
  std::vector<packed_tensor> tensors;
  tensors.reserve(static_cast<std::size_t>(request.tensors_size()));
  for (const pb::TensorMeta& meta : request.tensors()) {
    const std::string& name = meta.name();
    auto found = expected_index_.find(name);
    if (found == expected_index_.end())
      throw validation(name, "unexpected tensor: not one of the "
                               + std::to_string(expected_.size())
                               + " tensors of this runtime's qwen3_moe key stream");
    const std::size_t index = found->second;
    const model::param_meta& plan = expected_[index];
    if (const auto& earlier = pub.arrived_in_chunk[index])
      throw validation(name, "duplicate tensor: already loaded in chunk "
                               + std::to_string(*earlier) + " of publication "
                               + quoted(pub.header.publication_id()));
    if (!std::equal(meta.shape().begin(), meta.shape().end(), plan.shape.begin(),
                    plan.shape.end()))
      throw validation(name, "shape " + shape_string(meta.shape()) + " does not match the plan "
                               + shape_string(plan.shape));
    if (static_cast<int>(meta.dtype()) != static_cast<int>(plan.dt))
      throw validation(name, "dtype " + wire_dtype_name(meta.dtype())
                               + " does not match the plan " + model::dtype_name(plan.dt));
    if (meta.nbytes() != plan.nbytes())
      throw validation(name, "nbytes " + std::to_string(meta.nbytes())
                               + " does not match the plan's " + std::to_string(plan.nbytes()));
    pub.arrived_in_chunk[index] = request.chunk_index();
    ++pub.arrived;
    tensors.push_back({&plan, meta.offset()});
  }
  return tensors;
}

void weight_transfer::load_chunk(worker& w, const pb::UpdateWeightsRequest& request,
                                 const std::vector<packed_tensor>& tensors) const {
  // On this TP worker's track: map (first use of a buffer), copy into the resident layout, sync.
  trace::span traced("load", {{"chunk", request.chunk_index()}, {"tensors", tensors.size()}});
  const std::string& uuid = w.device_uuid();
  const pb::BufferHandle* own = nullptr;
  for (const pb::BufferHandle& handle : request.handles())
    if (handle.device_uuid() == uuid)
      own = &handle;
  if (own == nullptr)
    throw validation("update_weights.handles",
                     "no buffer handle for device " + uuid + " (TP worker "
                       + std::to_string(w.rank()) + ") in chunk "
                       + std::to_string(request.chunk_index()));
  const std::string buffer = "buffer " + quoted(own->handle()) + " of device " + uuid;

  for (const packed_tensor& t : tensors) {
    const std::uint64_t nbytes = t.param->nbytes();
    if (t.offset > own->size() || nbytes > own->size() - t.offset) {
      // offset + nbytes may not fit in 64 bits: the end is printed only when it does.
      const bool fits = t.offset <= std::numeric_limits<std::uint64_t>::max() - nbytes;
      throw validation(t.param->name,
                       (fits ? "bytes [" + std::to_string(t.offset) + ", "
                                 + std::to_string(t.offset + nbytes) + ")"
                             : std::to_string(nbytes) + " bytes at offset "
                                 + std::to_string(t.offset))
                         + " lie beyond the " + std::to_string(own->size()) + "-byte " + buffer);
    }
  }

  const producer_view* mapping = w.find_mapping(own->handle());
  if (mapping != nullptr && mapping->size() != own->size())
    throw validation("update_weights.handles",
                     buffer + " was mapped with " + std::to_string(mapping->size())
                       + " bytes, chunk " + std::to_string(request.chunk_index()) + " says "
                       + std::to_string(own->size()));
  if (mapping == nullptr) {
    if (w.mapped_buffer_count() >= session_->buffer_count)
      throw validation("update_weights.handles",
                       buffer + " would be mapping number "
                         + std::to_string(w.mapped_buffer_count() + 1)
                         + " of this transfer, but init_weight_transfer announced "
                         + std::to_string(session_->buffer_count) + " buffers");
    const auto& header = session_->current->header;
    const int producer_pid = header.producer_pids_size() > static_cast<int>(w.rank())
                               ? static_cast<int>(header.producer_pids(static_cast<int>(w.rank())))
                               : 0;
    try {
      trace::span mapped("map buffer", {{"chunk", request.chunk_index()}, {"bytes", own->size()}});
      mapping = &w.map_buffer(own->handle(), own->size(), producer_pid);
    } catch (const std::runtime_error& e) {
      // A handle that cannot be mapped as trainer rank r's sealed buffer is bad input from
      // the producer side: a validation error (the publication fails), never a crash.
      throw validation("update_weights.handles",
                       "TP worker " + std::to_string(w.rank()) + ": " + e.what());
    }
  }
  {
    trace::span copy("copy", {{"chunk", request.chunk_index()}});
    std::uint64_t bytes = 0;
    for (const packed_tensor& t : tensors) {
      w.load_tensor(*t.param, mapping->data() + t.offset);
      bytes += t.param->nbytes();
    }
    copy.arg("bytes", bytes);
  }
  // The answer to update_weights tells the producer it may rewrite this buffer: every copy
  // out of it must have finished (on CUDA: the worker's stream, ordered by an event).
  trace::span sync("sync", {{"chunk", request.chunk_index()}});
  w.finish_loads();
}

// ------------------------------------------------------------------------------- finish

pb::FinishWeightUpdateResult weight_transfer::finish(
  const pb::FinishWeightUpdateRequest& request) {
  return failing_publication_on_error([&] {
    publication& pub = require_open("finish_weight_update", request.publication_id());
    const pb::PublicationHeader& header = pub.header;
    if (request.model_version() != header.model_version())
      throw validation("finish_weight_update.model_version",
                       "model version " + std::to_string(request.model_version())
                         + " is not the version " + std::to_string(header.model_version())
                         + " that publication " + quoted(header.publication_id())
                         + " started with");
    if (pub.arrived != expected_.size()) {
      std::size_t first_missing = 0;
      while (pub.arrived_in_chunk[first_missing])
        ++first_missing;
      throw validation(expected_[first_missing].name,
                       std::to_string(expected_.size() - pub.arrived) + " of "
                         + std::to_string(expected_.size())
                         + " planned tensors never arrived (first missing: "
                         + expected_[first_missing].name + ")");
    }

    std::vector<pb::Receipt> receipts(workers_.size());
    on_all_workers(workers_, [&](worker& w) {
      trace::span traced("receipt", {{"verify", header.verify()}});
      receipts[w.rank()] = receipt_of(w, header);
    });
    validate_receipts(receipts, header);
    pub.finished = true;

    pb::FinishWeightUpdateResult result;
    result.set_publication_id(header.publication_id());
    result.set_model_version(header.model_version());
    for (auto& receipt : receipts)
      *result.add_receipts() = std::move(receipt);
    return result;
  });
}

pb::Receipt weight_transfer::receipt_of(const worker& w,
                                        const pb::PublicationHeader& header) const {
  pb::Receipt receipt;
  receipt.set_publication_id(header.publication_id());
  receipt.set_model_version(header.model_version());
  receipt.set_tp_world_size(header.tp_world_size());
  receipt.set_manifest_fingerprint(header.manifest_fingerprint());
  receipt.set_tp_rank(w.rank());
  receipt.set_device_uuid(w.device_uuid());
  receipt.set_resident_tensor_count(w.resident_tensor_count());
  if (header.verify()) {
    const std::vector<std::string> digests = w.resident_digests();
    const auto& residents = layout_->residents();
    for (std::size_t i = 0; i < residents.size(); ++i) {
      pb::TensorChecksum* checksum = receipt.add_checksums();
      checksum->set_name(residents[i].name);
      checksum->set_digest(digests[i]);
    }
  }
  return receipt;
}

void weight_transfer::validate_receipts(const std::vector<pb::Receipt>& receipts,
                                        const pb::PublicationHeader& header) const {
  if (receipts.size() != workers_.size())
    throw validation("receipts", std::to_string(receipts.size()) + " receipts for "
                                   + std::to_string(workers_.size()) + " TP workers");
  const auto& residents = layout_->residents();
  for (std::uint32_t rank = 0; rank < receipts.size(); ++rank) {
    const pb::Receipt& receipt = receipts[rank];
    const std::string where = "receipts[" + std::to_string(rank) + "]";
    const auto mismatch = [&](const std::string& field, const std::string& got,
                              const std::string& expected) {
      return validation(where + "." + field, "receipt of TP worker " + std::to_string(rank)
                                               + " has " + field + " " + quoted(got)
                                               + ", expected " + quoted(expected));
    };
    if (receipt.publication_id() != header.publication_id())
      throw mismatch("publication_id", receipt.publication_id(), header.publication_id());
    if (receipt.model_version() != header.model_version())
      throw mismatch("model_version", std::to_string(receipt.model_version()),
                     std::to_string(header.model_version()));
    if (receipt.tp_world_size() != header.tp_world_size())
      throw mismatch("tp_world_size", std::to_string(receipt.tp_world_size()),
                     std::to_string(header.tp_world_size()));
    if (receipt.manifest_fingerprint() != header.manifest_fingerprint())
      throw mismatch("manifest_fingerprint", receipt.manifest_fingerprint(),
                     header.manifest_fingerprint());
    if (receipt.tp_rank() != rank)
      throw mismatch("tp_rank", std::to_string(receipt.tp_rank()), std::to_string(rank));
    if (receipt.device_uuid() != header.device_uuids(static_cast<int>(rank)))
      throw mismatch("device_uuid", receipt.device_uuid(),
                     header.device_uuids(static_cast<int>(rank)));
    if (receipt.resident_tensor_count() != residents.size())
      throw mismatch("resident_tensor_count", std::to_string(receipt.resident_tensor_count()),
                     std::to_string(residents.size()));
    const std::size_t expected_checksums = header.verify() ? residents.size() : 0;
    if (static_cast<std::size_t>(receipt.checksums_size()) != expected_checksums)
      throw mismatch("checksums", std::to_string(receipt.checksums_size()) + " checksums",
                     std::to_string(expected_checksums) + " checksums");
    for (std::size_t i = 0; i < expected_checksums; ++i) {
      const pb::TensorChecksum& checksum = receipt.checksums(static_cast<int>(i));
      if (checksum.name() != residents[i].name || checksum.digest().size() != 16)
        throw mismatch("checksums[" + std::to_string(i) + "]",
                       checksum.name() + " digest " + checksum.digest(),
                       residents[i].name + " with a 16-digit hex element digest");
    }
  }
}

// ------------------------------------------------------------------------------- release

pb::ReleaseIpcResult weight_transfer::release(const pb::ReleaseIpcRequest& request) {
  if (!session_)
    throw invalid_state("release_ipc", "release_ipc without init_weight_transfer: nothing to "
                                       "release");
  if (const auto& current = session_->current) {
    const std::string id = quoted(current->header.publication_id());
    if (current->failure)
      throw invalid_state("release_ipc", "publication " + id + " failed: " + *current->failure);
    if (!current->finished)
      throw invalid_state("release_ipc",
                          "publication " + id + " is still open; finish_weight_update first");
    if (request.publication_id() != current->header.publication_id())
      throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "release_ipc.publication_id",
                          "publication " + quoted(request.publication_id())
                            + " is not the finished publication " + id);
  }
  std::vector<std::uint32_t> closed(workers_.size());
  on_all_workers(workers_, [&closed](worker& w) {
    trace::span traced("unmap");
    closed[w.rank()] = w.unmap_buffers() + w.close_export();
  });
  session_.reset();

  pb::ReleaseIpcResult result;
  std::uint32_t total = 0;
  for (std::uint32_t n : closed)
    total += n;
  result.set_buffers_closed(total);
  return result;
}

} // namespace refit::child
