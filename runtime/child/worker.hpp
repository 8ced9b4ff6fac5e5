// One TP worker of refit-runtime: a thread with its own job queue that owns one device's
// memory: the resident weights (one region sliced into the resident tensors of the TP
// layout), the KV cache, the host backup that sleep level 1 parks weights in, and the
// read-only mappings of the producer buffers a weight transfer publishes through.
//
// The server posts jobs with post(); every other member function runs on the worker's own
// thread, from inside such a job (so a CUDA build can keep each worker bound to its device).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/child/device_memory.hpp"
#include "runtime/child/load_progress.hpp"
#include "runtime/device/device.hpp"
#include "runtime/inference/generator.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"
#include "runtime/publication/host_buffer.hpp"

namespace refit::child {

// What a worker holds right now (the per-worker part of DescribeResult).
struct worker_report {
  std::uint32_t rank = 0;
  int device_index = 0;
  std::string device_uuid;
  bool weights_resident = false;
  bool kv_cache_resident = false;
  std::uint64_t weight_bytes_resident = 0;
  std::uint64_t kv_cache_bytes_resident = 0;
  std::uint64_t weight_bytes_offloaded = 0;
  std::uint64_t device_free_bytes = 0;
  std::uint64_t resident_tensors = 0; // tensors in resident weight storage (0 if not resident)
  std::uint32_t producer_buffers_open = 0;
  std::uint64_t producer_buffers_opened = 0;
  std::string resident_export;            // direct transfer initialized: the arena's handle
  std::uint64_t resident_export_bytes = 0;
};

// How wake_weights found or made the weight storage.
enum class weights_wake { already_resident, restored_from_host, zero_filled };

class worker {
public:
  // Worker `rank` on `device` (position `device_index` in the runtime's device list).
  // `exportable_weights`: resident weights in memory other processes can open for direct
  // publication (device_memory::alloc_exportable).
  worker(std::uint32_t rank, int device_index, device::spec device,
         std::shared_ptr<const model::tp_layout> layout, std::uint64_t kv_cache_bytes,
         bool exportable_weights = false);
  // Runs the queued jobs, frees all memory on the worker thread, joins it.
  ~worker();
  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;

  // Queues `job` for the worker thread; the future carries its completion or exception.
  std::future<void> post(std::function<void(worker&)> job);

  std::uint32_t rank() const { return rank_; }
  // Physical identity of the worker's device (fixed at construction; any thread).
  const std::string& device_uuid() const { return device_uuid_; }
  device::kind device_kind() const { return memory_->device().k; }

  // ---- worker thread only ----
  // Allocates zero-filled weight storage unless it is resident.
  void allocate_weights();
  // Allocates the KV cache unless it is resident.
  void allocate_kv_cache();
  // Scatters canonical tensor `p` (bytes `canonical`) into this rank's resident tensors.
  void load_tensor(const model::param_meta& p, const std::byte* canonical);
  // Sleep level 1: copies resident weights to a host backup and frees them.
  void offload_weights();
  // Sleep level 2: frees resident weights and drops any host backup.
  void discard_weights();
  void free_kv_cache();
  // Wake: allocates weight storage if needed; a host backup is copied back and dropped.
  weights_wake wake_weights();
  worker_report report() const;
  // Resident tensors held now (0 while the weights are not resident).
  std::uint64_t resident_tensor_count() const;
  // Element digest (16 hex digits) of each resident tensor, in layout order (weights must be
  // resident); computed where the weights live (on the device for CUDA workers).
  std::vector<std::string> resident_digests() const;

  // This rank's part of a generate request (inference::engine::generate; every worker runs
  // it at once, connected by `comm`). Needs resident weights and KV cache. The engine (KV
  // blocks and prefix cache over the KV region) is created on first use and dropped with the
  // KV cache.
  std::vector<inference::generation> generate(const model::model_config& cfg,
                                              const inference::engine_options& options,
                                              inference::tp_comm& comm,
                                              const inference::generate_input& input,
                                              std::uint64_t weights_version,
                                              inference::generate_stats* stats);
  // This rank's part of a score request (inference::engine::score, the fp32 reference
  // forward; every worker at once over `comm`). Same needs as generate.
  std::vector<std::vector<float>> score(const model::model_config& cfg,
                                        const inference::engine_options& options,
                                        inference::tp_comm& comm,
                                        const std::vector<std::vector<std::int32_t>>& sequences,
                                        std::uint32_t start);
  // Drops the prefix cache; returns the entries dropped (0 without a KV cache).
  std::uint64_t reset_prefix_cache();

  // The view of producer buffer `handle`, or nullptr if this worker has not opened it.
  const producer_view* find_mapping(const std::string& handle) const;
  // Opens `size` bytes of producer buffer `handle` read-only and keeps it open until
  // unmap_buffers (a buffer is opened once per transfer). Throws if it is open already.
  const producer_view& map_buffer(const std::string& handle, std::uint64_t size, int producer_pid);
  // Waits for every load_tensor copy issued so far (the producer may then rewrite the buffer).
  void finish_loads();
  // Loads every tensor of `params` from synthetic weights `w` (step 0), generated on this
  // worker's device; returns when the copies finished.
  void load_synthetic(const std::vector<model::param_meta>& params,
                      const model::synthetic_weights& w, load_progress* progress);
  std::size_t mapped_buffer_count() const { return mappings_.size(); }
  // Unmaps every producer buffer; returns how many were mapped.
  std::uint32_t unmap_buffers();
  // Direct publication: the handle of the resident weight arena (weights must be resident
  // and exportable; throws std::logic_error naming why not). Advertised in report() until
  // close_export, which returns 1 if it was exported.
  const std::string& export_weights();
  std::uint32_t close_export();
  bool exportable_weights() const { return exportable_weights_; }
  // Byte offset of every resident tensor inside the arena (publication::resident_offsets).
  const std::vector<std::uint64_t>& resident_offsets() const { return resident_offsets_; }

private:
  void run();
  void release_memory();
  void require_weights_resident(const std::string& action) const;
  // The engine over the KV cache (created on first use); needs resident weights and KV.
  inference::engine& generation_engine(const model::model_config& cfg,
                                       const inference::engine_options& options,
                                       const std::string& action);

  const std::uint32_t rank_;
  const int device_index_;
  const std::shared_ptr<const model::tp_layout> layout_;
  const std::uint64_t kv_cache_bytes_;
  const bool exportable_weights_;
  const std::vector<std::uint64_t> resident_offsets_; // byte offset of each resident tensor
  const std::unique_ptr<device_memory> memory_;
  const std::string device_uuid_;

  device_buffer weights_;
  std::vector<std::byte*> resident_ptrs_; // into weights_, one per resident tensor
  device_buffer kv_cache_;
  std::unique_ptr<inference::engine> engine_; // over kv_cache_; reset before it
  host_backup weights_backup_;
  std::map<std::string, std::unique_ptr<producer_view>> mappings_; // by handle string
  std::uint64_t mappings_opened_ = 0;
  std::string export_; // the arena's handle while exported

  std::mutex mutex_;
  std::condition_variable wakeup_;
  std::deque<std::packaged_task<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_; // last: starts after everything above is initialized
};

// A worker job that threw something other than a command_error; `where` is "worker[rank]".
struct worker_failure : std::runtime_error {
  worker_failure(std::uint32_t rank, const std::string& message);
  std::string where;
};

// Runs `job` on every worker in parallel and waits for all of them, even after a failure, so
// no job outlives the call. Then rethrows the failure of the lowest failing rank: a
// command_error unchanged, anything else as a worker_failure.
void on_all_workers(const std::vector<std::unique_ptr<worker>>& workers,
                    const std::function<void(worker&)>& job);

} // namespace refit::child
