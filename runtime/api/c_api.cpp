// The C ABI (refit/refit.h) over refit::api::host: every entry point catches everything, so
// no C++ exception crosses into C (or ctypes); failures are refit_status values.
#include "refit/refit.h"

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "refit/host.hpp"

struct refit_host {
  std::unique_ptr<refit::api::host> h;
  std::optional<refit::api::publication> last;
  std::optional<refit::api::generation> generated;
};

namespace {

void copy_text(char* dst, std::size_t size, const std::string& src) {
  if (dst == nullptr || size == 0)
    return;
  const std::size_t n = std::min(size - 1, src.size());
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

template <std::size_t N>
void copy_field(char (&dst)[N], const std::string& src) {
  copy_text(dst, N, src);
}

int set_ok(refit_status* st) {
  if (st) {
    std::memset(st, 0, sizeof(*st));
    st->ok = 1;
  }
  return 0;
}

int set_error(refit_status* st, const refit::api::error& e) {
  if (st) {
    std::memset(st, 0, sizeof(*st));
    st->ok = 0;
    copy_field(st->code, e.code);
    copy_field(st->where, e.where);
    copy_field(st->message, e.message);
    copy_field(st->text, e.text);
  }
  return -1;
}

int set_error(refit_status* st, const std::string& code, const std::string& where,
              const std::string& message) {
  refit::api::error e;
  e.code = code;
  e.where = where;
  e.message = message;
  e.text = "refit." + code + (where.empty() ? "" : " at " + where) + ": " + message;
  return set_error(st, e);
}

int from(refit_status* st, const refit::api::error& e) {
  return e ? set_error(st, e) : set_ok(st);
}

std::string str(const char* s) {
  return s ? std::string(s) : std::string();
}

// Runs `f` (returning 0 / -1 and filling the status itself), converting any exception.
template <class F>
int guarded(refit_status* st, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return set_error(st, "internal", "", e.what());
  } catch (...) {
    return set_error(st, "internal", "", "unknown exception");
  }
}

bool need_host(refit_host* h, refit_status* st) {
  if (h && h->h)
    return true;
  set_error(st, "invalid_argument", "host", "a NULL or destroyed host");
  return false;
}

} // namespace

extern "C" {

const char* refit_version(void) {
  return refit::api::library_version();
}

uint32_t refit_wire_protocol_version(void) {
  return refit::api::wire_protocol_version();
}

int refit_host_create(const refit_host_options* options, refit_host** out, refit_status* st) {
  return guarded(st, [&] {
    if (out == nullptr || options == nullptr)
      return set_error(st, "invalid_argument", "refit_host_create", "NULL options or out");
    *out = nullptr;
    refit::api::host_options o;
    o.config_path = str(options->config_path);
    o.coordinator_host = str(options->coordinator_host);
    o.coordinator_port = options->coordinator_port;
    o.runtime_executable = str(options->runtime_executable);
    auto r = refit::api::host::create(std::move(o));
    if (!r)
      return set_error(st, r.failure());
    auto h = std::make_unique<refit_host>();
    h->h = std::move(r.value());
    *out = h.release();
    return set_ok(st);
  });
}

void refit_host_destroy(refit_host* host) {
  try {
    delete host; // the host's destructor closes it
  } catch (...) {
  }
}

int refit_host_close(refit_host* host, refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    host->h->close();
    return set_ok(st);
  });
}

int refit_host_register_rank(refit_host* host, uint32_t rank, uint32_t world, const char* device,
                             refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    return from(st, host->h->register_rank({rank, world, str(device)}));
  });
}

int refit_host_register_synthetic(refit_host* host, uint64_t start_step, refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    auto w = host->h->recipe_weights();
    w.start_step = start_step;
    return from(st, host->h->register_weights(w));
  });
}

int refit_host_register_tensor(refit_host* host, const refit_tensor_desc* t, refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    if (t == nullptr || t->name == nullptr)
      return set_error(st, "invalid_argument", "tensor", "NULL tensor description or name");
    if (t->ndim > 0 && t->global_shape == nullptr)
      return set_error(st, "invalid_argument", t->name, "NULL global_shape with ndim > 0");
    if (t->placement != REFIT_SHARD0 && t->placement != REFIT_REPLICATED)
      return set_error(st, "invalid_argument", t->name,
                       "placement " + std::to_string(t->placement)
                         + " is neither REFIT_SHARD0 nor REFIT_REPLICATED");
    refit::api::tensor_spec s;
    s.name = t->name;
    s.data = t->data;
    s.bytes = t->bytes;
    s.dtype = str(t->dtype);
    s.device = t->device ? t->device : "cpu";
    s.global_shape.assign(t->global_shape, t->global_shape + t->ndim);
    s.sharding = t->placement == REFIT_REPLICATED ? refit::api::placement::replicated
                                                  : refit::api::placement::shard0;
    s.row_begin = t->row_begin;
    s.rows = t->rows;
    return from(st, host->h->register_tensor(std::move(s)));
  });
}

int refit_host_check_tensor(refit_host* host, const char* name, const void* data, uint64_t bytes,
                            refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    return from(st, host->h->check_tensor(str(name), data, bytes));
  });
}

int refit_host_model_tensor_count(refit_host* host, uint64_t* count, refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    if (count == nullptr)
      return set_error(st, "invalid_argument", "count", "NULL");
    *count = host->h->model_tensors().size();
    return set_ok(st);
  });
}

int refit_host_model_tensor(refit_host* host, uint64_t index, char* name, size_t name_size,
                            char* dtype, size_t dtype_size, int64_t* shape, uint32_t* ndim,
                            refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    const auto all = host->h->model_tensors();
    if (index >= all.size())
      return set_error(st, "invalid_argument", "index",
                       std::to_string(index) + " is out of range (" + std::to_string(all.size())
                         + " tensors)");
    const auto& t = all[index];
    copy_text(name, name_size, t.name);
    copy_text(dtype, dtype_size, t.dtype);
    if (ndim)
      *ndim = static_cast<uint32_t>(t.shape.size());
    if (shape)
      for (std::size_t d = 0; d < t.shape.size() && d < 8; ++d)
        shape[d] = t.shape[d];
    return set_ok(st);
  });
}

int refit_host_connect(refit_host* host, refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    return from(st, host->h->connect());
  });
}

int refit_host_step(refit_host* host, uint64_t* step, refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    auto r = host->h->step();
    if (!r)
      return set_error(st, r.failure());
    if (step)
      *step = *r;
    return set_ok(st);
  });
}

int refit_host_publish(refit_host* host, uint64_t model_version, refit_publication* out,
                       refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    auto r = host->h->publish(model_version);
    if (!r)
      return set_error(st, r.failure());
    host->last = r.value();
    if (out) {
      std::memset(out, 0, sizeof(*out));
      copy_field(out->publication_id, r->publication_id);
      out->model_version = r->model_version;
      copy_field(out->manifest_fingerprint, r->manifest_fingerprint);
      out->tensors = r->tensors;
      out->bytes = r->bytes;
      out->chunks = r->chunks;
      out->trainer_ranks = r->trainer_ranks;
      out->tp = r->tp;
      out->attempts = r->attempts;
      out->seconds = r->seconds;
      out->peak_buffer_bytes = r->peak_buffer_bytes;
      out->receipts = static_cast<uint32_t>(r->receipts.size());
    }
    return set_ok(st);
  });
}

int refit_host_receipt_checksum_count(refit_host* host, uint32_t tp_rank, uint64_t* count,
                                      refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    if (!host->last)
      return set_error(st, "invalid_state", "receipts", "no publication committed yet");
    if (tp_rank >= host->last->receipts.size())
      return set_error(st, "invalid_argument", "tp_rank",
                       std::to_string(tp_rank) + " is out of range ("
                         + std::to_string(host->last->receipts.size()) + " receipts)");
    if (count)
      *count = host->last->receipts[tp_rank].checksums.size();
    return set_ok(st);
  });
}

int refit_host_receipt_checksum(refit_host* host, uint32_t tp_rank, uint64_t index, char* name,
                                size_t name_size, char* digest, size_t digest_size,
                                refit_status* st) {
  return guarded(st, [&] {
    uint64_t count = 0;
    if (refit_host_receipt_checksum_count(host, tp_rank, &count, st) != 0)
      return -1;
    if (index >= count)
      return set_error(st, "invalid_argument", "index",
                       std::to_string(index) + " is out of range (" + std::to_string(count)
                         + " checksums)");
    const auto& c = host->last->receipts[tp_rank].checksums[index];
    copy_text(name, name_size, c.name);
    copy_text(digest, digest_size, c.digest);
    return set_ok(st);
  });
}

namespace {

int rollout_out(refit_status* st, const refit::api::result<refit::api::rollout_status>& r,
                refit_rollout_status* out) {
  if (!r)
    return set_error(st, r.failure());
  if (out) {
    std::memset(out, 0, sizeof(*out));
    out->committed_version = r->committed_version;
    copy_field(out->connection, r->connection);
    out->needs_publication = r->needs_publication ? 1 : 0;
    out->sleep_level = r->sleep_level;
    out->weights_awake = r->weights_awake ? 1 : 0;
    out->kv_cache_awake = r->kv_cache_awake ? 1 : 0;
    out->publishing = r->publishing ? 1 : 0;
    out->epoch = r->epoch;
    out->complete = r->complete ? 1 : 0;
    copy_field(out->last_error, r->last_error);
  }
  return set_ok(st);
}

} // namespace

int refit_host_generate(refit_host* host, const int32_t* tokens, const uint64_t* prompt_lengths,
                        uint64_t prompt_count, const refit_sampling_params* params,
                        uint64_t* sample_count, uint64_t* model_version, refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    if (params == nullptr || (prompt_count > 0 && prompt_lengths == nullptr))
      return set_error(st, "invalid_argument", "generate", "NULL params or prompt_lengths");
    std::vector<std::vector<std::int32_t>> prompts;
    std::uint64_t at = 0;
    for (std::uint64_t i = 0; i < prompt_count; ++i) {
      if (prompt_lengths[i] > 0 && tokens == nullptr)
        return set_error(st, "invalid_argument", "generate.tokens", "NULL with non-empty prompts");
      prompts.emplace_back(tokens + at, tokens + at + prompt_lengths[i]);
      at += prompt_lengths[i];
    }
    refit::api::sampling_params p;
    p.n = params->n;
    p.max_tokens = params->max_tokens;
    p.temperature = params->temperature;
    p.top_k = params->top_k;
    p.top_p = params->top_p;
    p.seed = params->seed;
    if (params->stop_count > 0) {
      if (params->stop_token_ids == nullptr)
        return set_error(st, "invalid_argument", "generate.params.stop_token_ids",
                         "NULL with stop_count > 0");
      p.stop_token_ids.assign(params->stop_token_ids, params->stop_token_ids + params->stop_count);
    }
    p.max_prompt_length = params->max_prompt_length;
    auto r = host->h->generate(prompts, p);
    host->generated.reset();
    if (!r)
      return set_error(st, r.failure());
    host->generated = std::move(r.value());
    if (sample_count)
      *sample_count = host->generated->samples.size();
    if (model_version)
      *model_version = host->generated->model_version;
    return set_ok(st);
  });
}

int refit_host_sample(refit_host* host, uint64_t index, refit_sample_info* info,
                      int32_t* token_ids, float* logprobs, uint64_t capacity,
                      int32_t* prompt_token_ids, uint64_t prompt_capacity, refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    if (!host->generated)
      return set_error(st, "invalid_state", "sample", "no generation result");
    const auto& all = host->generated->samples;
    if (index >= all.size())
      return set_error(st, "invalid_argument", "index",
                       std::to_string(index) + " is out of range (" + std::to_string(all.size())
                         + " samples)");
    const auto& smp = all[index];
    if (info) {
      std::memset(info, 0, sizeof(*info));
      info->prompt_index = smp.prompt_index;
      info->token_count = smp.token_ids.size();
      info->prompt_token_count = smp.prompt_token_ids.size();
      copy_field(info->finish_reason, smp.finish_reason);
      info->prompt_truncated = smp.prompt_truncated ? 1 : 0;
      info->model_version = smp.model_version;
    }
    for (std::uint64_t i = 0; i < smp.token_ids.size() && i < capacity; ++i) {
      if (token_ids)
        token_ids[i] = smp.token_ids[i];
      if (logprobs && i < smp.logprobs.size())
        logprobs[i] = smp.logprobs[i];
    }
    for (std::uint64_t i = 0; prompt_token_ids && i < smp.prompt_token_ids.size() && i < prompt_capacity; ++i)
      prompt_token_ids[i] = smp.prompt_token_ids[i];
    return set_ok(st);
  });
}

int refit_host_sleep(refit_host* host, uint32_t level, refit_rollout_status* out,
                     refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    return rollout_out(st, host->h->sleep(level), out);
  });
}

int refit_host_wake(refit_host* host, int weights, int kv_cache, refit_rollout_status* out,
                    refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    return rollout_out(st, host->h->wake(weights != 0, kv_cache != 0), out);
  });
}

int refit_host_status(refit_host* host, refit_rollout_status* out, refit_status* st) {
  return guarded(st, [&] {
    if (!need_host(host, st))
      return -1;
    return rollout_out(st, host->h->status(), out);
  });
}

uint32_t refit_host_rank(const refit_host* host) {
  return host && host->h ? host->h->rank() : 0;
}

uint32_t refit_host_world(const refit_host* host) {
  return host && host->h ? host->h->world() : 0;
}

int refit_host_connected(const refit_host* host) {
  return host && host->h && host->h->connected() ? 1 : 0;
}

} // extern "C"
