// refit-runtime's command handlers: describe, sleep / wake_up, the prefix cache, generation and
// the weight-update phases (the transfer itself is weight_transfer.cpp).
#include "runtime/child/server.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <stdexcept>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

#include "runtime/child/command_error.hpp"
#include "runtime/child/server_util.hpp"
#include "runtime/control/framing.hpp"
#include "runtime/control/protocol.hpp"
#include "runtime/control/protocol_version.hpp"


namespace refit::child {

using namespace detail;

std::vector<worker_report> server::worker_reports() {
  std::vector<worker_report> reports(workers_.size());
  on_all_workers(workers_, [&reports](worker& w) { reports[w.rank()] = w.report(); });
  return reports;
}

void server::require_weights_awake(const std::string& command) {
  for (const auto& r : worker_reports())
    if (!r.weights_resident)
      throw command_error(pb::ERROR_CODE_INVALID_STATE, command,
                          command + " needs resident weights, but TP worker "
                            + std::to_string(r.rank) + " has none (sleep level "
                            + std::to_string(sleep_level_) + "); wake_up the weights first");
}

pb::DescribeResult server::describe() {
  const std::vector<worker_report> reports = worker_reports();

  pb::DescribeResult result;
  result.set_runtime_kind(runtime_kind);
  result.set_runtime_version(runtime_version);
  result.set_tp_world_size(static_cast<std::uint32_t>(workers_.size()));
  bool weights_awake = true;
  bool kv_cache_awake = true;
  for (const auto& r : reports) {
    auto* info = result.add_workers();
    info->set_rank(r.rank);
    info->set_device_index(r.device_index);
    info->set_device_uuid(r.device_uuid);
    info->set_weight_bytes_resident(r.weight_bytes_resident);
    info->set_kv_cache_bytes_resident(r.kv_cache_bytes_resident);
    info->set_weight_bytes_offloaded(r.weight_bytes_offloaded);
    info->set_device_free_bytes(r.device_free_bytes);
    info->set_resident_tensor_count(weights_valid_ ? r.resident_tensors : 0);
    info->set_producer_buffers_open(r.producer_buffers_open);
    info->set_producer_buffers_opened(r.producer_buffers_opened);
    info->set_resident_export(r.resident_export);
    info->set_resident_export_bytes(r.resident_export_bytes);
    weights_awake = weights_awake && r.weights_resident;
    kv_cache_awake = kv_cache_awake && r.kv_cache_resident;
  }
  result.set_sleep_level(sleep_level_);
  result.set_weights_awake(weights_awake);
  result.set_kv_cache_awake(kv_cache_awake);
  result.set_model_version(model_version_);
  result.set_weights_valid(weights_valid_);
  result.set_pid(static_cast<std::uint32_t>(::getpid()));
  auto* ckpt = result.mutable_checkpoint();
  ckpt->set_path(checkpoint_.path);
  ckpt->set_tensors(checkpoint_.tensors);
  ckpt->set_bytes(checkpoint_.bytes);
  ckpt->set_fingerprint(checkpoint_.fingerprint);
  ckpt->set_load_seconds(checkpoint_.load_seconds);
  return result;
}

pb::MemoryResult server::sleep(const pb::SleepRequest& request) {
  if (transfer_.exported())
    throw command_error(pb::ERROR_CODE_INVALID_STATE, "sleep",
                        "cannot sleep while the resident weights are exported for a direct "
                        "publication; release_ipc first");
  if (const pb::PublicationHeader* open = transfer_.open_publication())
    throw command_error(pb::ERROR_CODE_INVALID_STATE, "sleep",
                        "cannot sleep while publication '" + open->publication_id()
                          + "' is open (its weights are being written); finish_weight_update "
                            "first");
  const std::uint32_t level = request.level();
  if (level == 1) {
    on_all_workers(workers_, [](worker& w) {
      w.offload_weights();
      w.free_kv_cache();
    });
  } else if (level == 2) {
    weights_valid_ = false;
    on_all_workers(workers_, [](worker& w) {
      w.discard_weights();
      w.free_kv_cache();
    });
  } else {
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "sleep.level",
                        "sleep level " + std::to_string(level)
                          + " is not supported (1: offload weights to host and drop the KV "
                            "cache, 2: drop weights and KV cache)");
  }
  sleep_level_ = level;
  pb::MemoryResult result;
  *result.mutable_state() = describe();
  return result;
}

pb::MemoryResult server::wake_up(const pb::WakeUpRequest& request) {
  bool wake_weights = request.tags().empty();
  bool wake_kv_cache = request.tags().empty();
  for (int i = 0; i < request.tags_size(); ++i) {
    switch (request.tags(i)) {
      case pb::WAKE_TAG_WEIGHTS: wake_weights = true; break;
      case pb::WAKE_TAG_KV_CACHE: wake_kv_cache = true; break;
      default:
        throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT,
                            "wake_up.tags[" + std::to_string(i) + "]",
                            "wake tag " + std::to_string(request.tags(i))
                              + " is neither WAKE_TAG_WEIGHTS nor WAKE_TAG_KV_CACHE");
    }
  }
  if (wake_weights) {
    std::vector<weights_wake> outcomes(workers_.size());
    on_all_workers(workers_, [&outcomes](worker& w) { outcomes[w.rank()] = w.wake_weights(); });
    // Storage without a host backup is zero-filled: only a publication can make it valid.
    if (std::find(outcomes.begin(), outcomes.end(), weights_wake::zero_filled) != outcomes.end())
      weights_valid_ = false;
  }
  if (wake_kv_cache)
    on_all_workers(workers_, [](worker& w) { w.allocate_kv_cache(); });

  pb::MemoryResult result;
  *result.mutable_state() = describe();
  if (result.state().weights_awake() && result.state().kv_cache_awake()) {
    sleep_level_ = 0;
    result.mutable_state()->set_sleep_level(0);
  }
  return result;
}

pb::ResetPrefixCacheResult server::reset_prefix_cache() {
  std::vector<std::uint64_t> dropped(workers_.size());
  on_all_workers(workers_, [&dropped](worker& w) { dropped[w.rank()] = w.reset_prefix_cache(); });
  pb::ResetPrefixCacheResult result;
  result.set_entries_dropped(dropped.empty() ? 0 : dropped[0]);
  return result;
}

void server::require_generation_state(const std::string& command) {
  if (const pb::PublicationHeader* open = transfer_.open_publication())
    throw command_error(pb::ERROR_CODE_INVALID_STATE, command,
                        "cannot " + command + " while publication '" + open->publication_id()
                          + "' is open (its weights are being written); finish_weight_update "
                            "first");
  for (const auto& r : worker_reports()) {
    if (!r.weights_resident)
      throw command_error(pb::ERROR_CODE_INVALID_STATE, command,
                          command + " needs resident weights, but TP worker " + std::to_string(r.rank)
                            + " has none (sleep level " + std::to_string(sleep_level_)
                            + "); wake_up the weights first");
    if (!r.kv_cache_resident)
      throw command_error(pb::ERROR_CODE_INVALID_STATE, command,
                          command + " needs the KV cache, but TP worker " + std::to_string(r.rank)
                            + " has none (sleep level " + std::to_string(sleep_level_)
                            + "); wake_up the KV cache first");
  }
  if (!weights_valid_)
    throw command_error(pb::ERROR_CODE_INVALID_STATE, command,
                        "the resident weights are not valid (dropped by sleep level 2 or left "
                        "half-written by a publication); publish weights first");
}

void server::run_on_workers(const std::string& command, const std::function<void(worker&)>& fn,
                            const std::function<void()>& on_failure) {
  std::vector<std::future<void>> done;
  for (const auto& w : workers_)
    done.push_back(w->post([&](worker& self) {
      try {
        fn(self);
      } catch (const std::exception& e) {
        comm_->abort("TP worker " + std::to_string(self.rank()) + " failed: " + e.what());
        throw;
      } catch (...) {
        comm_->abort("TP worker " + std::to_string(self.rank()) + " failed");
        throw;
      }
    }));
  // Wait for every worker; the cause is the first failure that is not a consequence (a
  // collective aborted because another worker failed).
  std::exception_ptr cause;
  std::uint32_t cause_rank = 0;
  bool cause_is_abort = false;
  for (std::uint32_t rank = 0; rank < done.size(); ++rank) {
    try {
      done[rank].get();
    } catch (const inference::comm_error&) {
      if (!cause) {
        cause = std::current_exception();
        cause_rank = rank;
        cause_is_abort = true;
      }
    } catch (...) {
      if (!cause || cause_is_abort) {
        cause = std::current_exception();
        cause_rank = rank;
        cause_is_abort = false;
      }
    }
  }
  comm_->reset();
  if (!cause)
    return;
  if (on_failure)
    on_failure();
  try {
    std::rethrow_exception(cause);
  } catch (const inference::request_error& e) {
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, command + "." + e.where, e.what());
  } catch (const command_error&) {
    throw;
  } catch (const std::exception& e) {
    throw worker_failure(cause_rank, e.what());
  } catch (...) {
    throw worker_failure(cause_rank, "unknown exception");
  }
}

pb::GenerateResult server::generate(const pb::GenerateRequest& request) {
  require_generation_state("generate");

  const inference::generate_input input = to_input(request);
  const inference::engine_options options = generation_options(options_);
  try {
    inference::plan_request(options_.model,
                            inference::engine_kv_geometry(options_.model, layout_->tp(), options),
                            options_.kv_cache_bytes, input);
  } catch (const inference::request_error& e) {
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "generate." + e.where, e.what());
  }

  const auto start = std::chrono::steady_clock::now();
  const std::size_t tp = workers_.size();
  std::vector<std::vector<inference::generation>> results(tp);
  std::vector<inference::generate_stats> stats(tp);
  // Ranks may have stopped at different points: keep their prefix caches identical.
  run_on_workers(
    "generate",
    [&](worker& self) {
      results[self.rank()] = self.generate(options_.model, options, *comm_, input, model_version_,
                                           &stats[self.rank()]);
    },
    [this] { reset_prefix_cache(); });

  for (std::uint32_t rank = 1; rank < tp; ++rank) {
    const std::string mismatch = first_difference(results[0], results[rank]);
    if (!mismatch.empty()) {
      reset_prefix_cache();
      throw command_error(pb::ERROR_CODE_INTERNAL, "worker[" + std::to_string(rank) + "]",
                          "TP worker " + std::to_string(rank)
                            + " generated other samples than TP worker 0: " + mismatch);
    }
  }

  pb::GenerateResult result;
  result.set_model_version(model_version_);
  for (const auto& g : results[0]) {
    auto* sample = result.add_samples();
    sample->set_prompt_index(g.prompt_index);
    sample->mutable_prompt_token_ids()->Add(g.prompt_token_ids.begin(), g.prompt_token_ids.end());
    sample->mutable_token_ids()->Add(g.token_ids.begin(), g.token_ids.end());
    sample->mutable_logprobs()->Add(g.logprobs.begin(), g.logprobs.end());
    sample->set_finish_reason(g.finish_reason);
    sample->set_prompt_truncated(g.prompt_truncated);
  }
  const auto& st = stats[0];
  *result.mutable_stats() = to_proto(st);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::steady_clock::now() - start)
                    .count();
  log_line("generate: model_version=" + std::to_string(st.model_version)
           + " prompts=" + std::to_string(st.prompts) + " samples=" + std::to_string(st.samples)
           + " prompt_tokens=" + std::to_string(st.prompt_tokens)
           + " prefix_hit_tokens=" + std::to_string(st.prefix_hit_tokens)
           + " computed_prompt_tokens=" + std::to_string(st.computed_prompt_tokens)
           + " generated_tokens=" + std::to_string(st.generated_tokens)
           + " waves=" + std::to_string(st.waves)
           + " stale_entries_dropped=" + std::to_string(st.stale_entries_dropped)
           + " ms=" + std::to_string(ms));
  return result;
}

pb::ScoreResult server::score(const pb::ScoreRequest& request) {
  require_generation_state("score");
  std::vector<std::vector<std::int32_t>> sequences;
  for (const auto& seq : request.sequences())
    sequences.emplace_back(seq.token_ids().begin(), seq.token_ids().end());
  const inference::engine_options options = generation_options(options_);
  try {
    inference::plan_score(options_.model,
                          inference::score_kv_geometry(options_.model, layout_->tp(), options),
                          options_.kv_cache_bytes, sequences, request.start());
  } catch (const inference::request_error& e) {
    throw command_error(pb::ERROR_CODE_INVALID_ARGUMENT, "score." + e.where, e.what());
  }
  const auto start = std::chrono::steady_clock::now();
  const std::size_t tp = workers_.size();
  std::vector<std::vector<std::vector<float>>> results(tp);
  run_on_workers(
    "score",
    [&](worker& self) {
      results[self.rank()] = self.score(options_.model, options, *comm_, sequences, request.start());
    },
    {});
  for (std::uint32_t rank = 1; rank < tp; ++rank)
    if (results[rank] != results[0])
      throw command_error(pb::ERROR_CODE_INTERNAL, "worker[" + std::to_string(rank) + "]",
                          "TP worker " + std::to_string(rank)
                            + " scored other logprobs than TP worker 0");
  pb::ScoreResult result;
  result.set_model_version(model_version_);
  std::uint64_t tokens = 0;
  for (const auto& lp : results[0]) {
    result.add_sequences()->mutable_logprobs()->Add(lp.begin(), lp.end());
    tokens += lp.size();
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::steady_clock::now() - start)
                    .count();
  log_line("score: model_version=" + std::to_string(model_version_) + " sequences="
           + std::to_string(sequences.size()) + " scored_tokens=" + std::to_string(tokens)
           + " ms=" + std::to_string(ms));
  return result;
}

pb::InitWeightTransferResult server::init_weight_transfer(
  const pb::InitWeightTransferRequest& request) {
  require_weights_awake("init_weight_transfer");
  pb::InitWeightTransferResult result = transfer_.init(request);
  // Direct mode: trainer ranks may write the exported arenas from now on; only a finished
  // publication makes them valid again.
  if (transfer_.exported())
    weights_valid_ = false;
  return result;
}

pb::StartWeightUpdateResult server::start_weight_update(
  const pb::StartWeightUpdateRequest& request) {
  require_weights_awake("start_weight_update");
  pb::StartWeightUpdateResult result = transfer_.start(request, model_version_);
  // Resident storage is about to be overwritten: only a finished publication makes it valid.
  weights_valid_ = false;
  return result;
}

pb::FinishWeightUpdateResult server::finish_weight_update(
  const pb::FinishWeightUpdateRequest& request) {
  pb::FinishWeightUpdateResult result = transfer_.finish(request);
  model_version_ = result.model_version();
  weights_valid_ = true;
  reset_prefix_cache();
  result.set_prefix_cache_reset(true);
  return result;
}

} // namespace refit::child
