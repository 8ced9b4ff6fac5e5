#include "runtime/child/worker.hpp"

#include <exception>
#include <stdexcept>

#include "runtime/child/command_error.hpp"
#include "runtime/model/digest.hpp"
#include "runtime/trace/trace.hpp"
#include "runtime/publication/direct_plan.hpp"

namespace refit::child {

namespace {

} // namespace

worker::worker(std::uint32_t rank, int device_index, device::spec device,
               std::shared_ptr<const model::tp_layout> layout, std::uint64_t kv_cache_bytes,
               bool exportable_weights)
  : rank_(rank),
    device_index_(device_index),
    layout_(std::move(layout)),
    kv_cache_bytes_(kv_cache_bytes),
    exportable_weights_(exportable_weights),
    resident_offsets_(publication::resident_offsets(*layout_)),
    memory_(open_device_memory(device)),
    device_uuid_(memory_->uuid()),
    thread_([this] { run(); }) {}

worker::~worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wakeup_.notify_one();
  thread_.join();
}

std::future<void> worker::post(std::function<void(worker&)> job) {
  std::packaged_task<void()> task([this, job = std::move(job)] { job(*this); });
  auto done = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(task));
  }
  wakeup_.notify_one();
  return done;
}

void worker::run() {
  trace::set_thread_track(trace::tracks::tp_worker(rank_));
  for (;;) {
    std::packaged_task<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wakeup_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty())
        break;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
  release_memory();
}

void worker::release_memory() {
  mappings_.clear();
  export_.clear();
  resident_ptrs_.clear();
  weights_.reset();
  engine_.reset();
  kv_cache_.reset();
  weights_backup_.reset();
}

void worker::require_weights_resident(const std::string& action) const {
  if (!weights_)
    throw std::logic_error("worker " + std::to_string(rank_) + " ("
                           + device::to_string(memory_->device())
                           + "): cannot " + action + ": weights are not resident");
}

void worker::allocate_weights() {
  if (weights_)
    return;
  const std::string what = "resident weights of TP rank " + std::to_string(rank_);
  weights_ = exportable_weights_
               ? memory_->alloc_exportable(publication::resident_arena_bytes(*layout_), what)
               : memory_->alloc(publication::resident_arena_bytes(*layout_), what);
  resident_ptrs_.clear();
  for (std::uint64_t offset : resident_offsets_)
    resident_ptrs_.push_back(weights_.data() + offset);
}

void worker::allocate_kv_cache() {
  if (!kv_cache_)
    kv_cache_ = memory_->alloc(kv_cache_bytes_, "KV cache of TP rank " + std::to_string(rank_));
}

void worker::load_tensor(const model::param_meta& p, const std::byte* canonical) {
  require_weights_resident("load " + p.name);
  // tp_layout::scatter's placements, copied by the device (asynchronously on CUDA devices:
  // finish_loads waits).
  for (const model::placement& pl : layout_->place(p, rank_))
    memory_->copy_rows(resident_ptrs_[pl.resident_index] + pl.dst_offset, pl.dst_stride,
                       canonical + pl.src_offset, pl.src_stride, pl.row_bytes, pl.rows);
}

void worker::finish_loads() { memory_->synchronize(); }

void worker::load_synthetic(const std::vector<model::param_meta>& params,
                            const model::synthetic_weights& w, load_progress* progress) {
  for (const auto& p : params) {
    load_tensor(p, memory_->synthetic_canonical(p, w, 0));
    if (progress)
      progress->advance(p);
  }
  finish_loads();
}

void worker::offload_weights() {
  if (!weights_)
    return; // already offloaded (or dropped)
  weights_backup_ = memory_->offload(weights_, "weights of TP rank " + std::to_string(rank_));
  export_.clear();
  resident_ptrs_.clear();
  weights_.reset();
}

void worker::discard_weights() {
  export_.clear();
  resident_ptrs_.clear();
  weights_.reset();
  weights_backup_.reset();
}

void worker::free_kv_cache() {
  engine_.reset(); // its prefix cache describes KV that is about to go
  kv_cache_.reset();
}

inference::engine& worker::generation_engine(const model::model_config& cfg,
                                            const inference::engine_options& options,
                                            const std::string& action) {
  require_weights_resident(action);
  if (!kv_cache_)
    throw std::logic_error("worker " + std::to_string(rank_) + ": cannot " + action
                           + " without a KV cache");
  if (!engine_) {
    inference::engine_options o = options;
    if (memory_->device().k == device::kind::cuda) {
      // The forward runs on this worker's GPU over its resident weights and KV arena.
      o.cuda_device = memory_->device().index;
      o.copy_kv_block = [this](std::byte* dst, const std::byte* src, std::uint64_t n) {
        memory_->copy_rows(dst, n, src, n, n, 1);
        memory_->synchronize();
      };
    }
    engine_ = std::make_unique<inference::engine>(cfg, layout_, rank_, kv_cache_.data(),
                                                  kv_cache_.size(), o);
  }
  return *engine_;
}

std::vector<inference::generation> worker::generate(const model::model_config& cfg,
                                                    const inference::engine_options& options,
                                                    inference::tp_comm& comm,
                                                    const inference::generate_input& input,
                                                    std::uint64_t weights_version,
                                                    inference::generate_stats* stats) {
  trace::span traced("generate", {{"prompts", input.prompts.size()}, {"n", input.params.n},
                                  {"max_tokens", input.params.max_tokens}});
  inference::engine& e = generation_engine(cfg, options, "generate");
  const std::vector<const std::byte*> residents(resident_ptrs_.begin(), resident_ptrs_.end());
  auto generations = e.generate(residents, comm, input, weights_version, stats);
  if (stats)
    traced.arg("generated_tokens", stats->generated_tokens);
  return generations;
}

std::vector<std::vector<float>> worker::score(const model::model_config& cfg,
                                              const inference::engine_options& options,
                                              inference::tp_comm& comm,
                                              const std::vector<std::vector<std::int32_t>>& sequences,
                                              std::uint32_t start) {
  inference::engine& e = generation_engine(cfg, options, "score");
  const std::vector<const std::byte*> residents(resident_ptrs_.begin(), resident_ptrs_.end());
  return e.score(residents, comm, sequences, start);
}

std::uint64_t worker::reset_prefix_cache() {
  return engine_ ? engine_->reset_prefix_cache() : 0;
}

weights_wake worker::wake_weights() {
  if (weights_)
    return weights_wake::already_resident;
  allocate_weights();
  if (!weights_backup_)
    return weights_wake::zero_filled;
  try {
    memory_->restore(weights_backup_, weights_);
  } catch (...) {
    // Keep the backup as the only copy; storage with half-restored bytes must not stay.
    resident_ptrs_.clear();
    weights_.reset();
    throw;
  }
  weights_backup_.reset();
  return weights_wake::restored_from_host;
}

worker_report worker::report() const {
  worker_report r;
  r.rank = rank_;
  r.device_index = device_index_;
  r.device_uuid = device_uuid_;
  r.weights_resident = static_cast<bool>(weights_);
  r.kv_cache_resident = static_cast<bool>(kv_cache_);
  r.weight_bytes_resident = weights_.size();
  r.kv_cache_bytes_resident = kv_cache_.size();
  r.weight_bytes_offloaded = weights_backup_.size();
  r.device_free_bytes = memory_->free_bytes();
  r.resident_tensors = weights_ ? resident_ptrs_.size() : 0;
  r.producer_buffers_open = static_cast<std::uint32_t>(mappings_.size());
  r.producer_buffers_opened = mappings_opened_;
  r.resident_export = export_;
  r.resident_export_bytes = export_.empty() ? 0 : weights_.size();
  return r;
}

std::uint64_t worker::resident_tensor_count() const {
  return weights_ ? resident_ptrs_.size() : 0;
}

std::vector<std::string> worker::resident_digests() const {
  require_weights_resident("digest the resident tensors");
  const auto& residents = layout_->residents();
  std::vector<digest_input> tensors;
  tensors.reserve(residents.size());
  for (std::size_t i = 0; i < residents.size(); ++i)
    tensors.push_back({resident_ptrs_[i], residents[i].nbytes, model::dtype_size(residents[i].dt)});
  std::vector<std::string> out;
  out.reserve(residents.size());
  for (std::uint64_t d : memory_->digests(tensors))
    out.push_back(model::digest_hex(d));
  return out;
}

const producer_view* worker::find_mapping(const std::string& handle) const {
  auto found = mappings_.find(handle);
  return found == mappings_.end() ? nullptr : found->second.get();
}

const producer_view& worker::map_buffer(const std::string& handle, std::uint64_t size,
                                        int producer_pid) {
  if (mappings_.count(handle) != 0)
    throw std::logic_error("worker " + std::to_string(rank_) + ": buffer " + handle
                           + " is mapped already");
  auto& view = *mappings_.emplace(handle, memory_->open_producer(handle, size, producer_pid)).first->second;
  ++mappings_opened_;
  return view;
}

std::uint32_t worker::unmap_buffers() {
  const auto count = static_cast<std::uint32_t>(mappings_.size());
  mappings_.clear();
  return count;
}

const std::string& worker::export_weights() {
  require_weights_resident("export the resident weights");
  if (!exportable_weights_)
    throw std::logic_error("worker " + std::to_string(rank_) + " ("
                           + device::to_string(memory_->device())
                           + "): resident weights are private memory; direct publication "
                             "needs refit-runtime started with --publication-mode direct");
  // Copies still queued on this worker's stream must not race the writers.
  memory_->synchronize();
  export_ = memory_->export_handle(weights_);
  return export_;
}

std::uint32_t worker::close_export() {
  const std::uint32_t was = export_.empty() ? 0 : 1;
  export_.clear();
  return was;
}

worker_failure::worker_failure(std::uint32_t rank, const std::string& message)
  : std::runtime_error("TP worker " + std::to_string(rank) + ": " + message),
    where("worker[" + std::to_string(rank) + "]") {}

void on_all_workers(const std::vector<std::unique_ptr<worker>>& workers,
                    const std::function<void(worker&)>& job) {
  std::vector<std::future<void>> done;
  done.reserve(workers.size());
  for (const auto& w : workers)
    done.push_back(w->post(job));
  std::exception_ptr first_failure;
  std::uint32_t failed_rank = 0;
  for (std::uint32_t rank = 0; rank < done.size(); ++rank) {
    try {
      done[rank].get();
    } catch (...) {
      if (!first_failure) {
        first_failure = std::current_exception();
        failed_rank = rank;
      }
    }
  }
  if (!first_failure)
    return;
  try {
    std::rethrow_exception(first_failure);
  } catch (const command_error&) {
    throw;
  } catch (const std::exception& e) {
    throw worker_failure(failed_rank, e.what());
  } catch (...) {
    throw worker_failure(failed_rank, "unknown exception");
  }
}

} // namespace refit::child
