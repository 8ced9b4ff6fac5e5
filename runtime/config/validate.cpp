// Recipe validation: ranges, cross-key rules (devices, transport, serve), the shared secret.
#include "runtime/config/config.hpp"
#include "runtime/config/common.hpp"

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include <yaml-cpp/yaml.h>

#include "runtime/device/device.hpp"

namespace refit::config {
namespace detail {

void validate_config(const refit_config& cfg, const locator& locate) {
  auto fail = [&](const std::string& key, const std::string& what) {
    throw config_error(key, what + locate(key));
  };
  auto check_range = [&](const std::string& key, std::uint64_t value, std::uint64_t min,
                         std::uint64_t max) {
    if (value < min || value > max)
      fail(key, std::to_string(value) + " is out of range [" + std::to_string(min) + ", "
                  + std::to_string(max) + "]");
  };
  auto check_at_least = [&](const std::string& key, std::uint64_t value, std::uint64_t min) {
    if (value < min)
      fail(key, std::to_string(value) + " is too small (minimum " + std::to_string(min) + ")");
  };
  auto check_one_of = [&](const std::string& key, const std::string& value,
                          const std::vector<std::string>& allowed) {
    for (const auto& a : allowed)
      if (a == value)
        return;
    fail(key, "'" + value + "' is not one of " + join(allowed));
  };

  const runtime_config& rt = cfg.runtime;
  if (rt.executable.empty())
    fail("runtime.executable", "must not be empty");
  check_at_least("runtime.tp_size", rt.tp_size, 1);
  if (rt.devices.size() != rt.tp_size)
    fail("runtime.devices", "lists " + std::to_string(rt.devices.size())
                              + " devices but runtime.tp_size is "
                              + std::to_string(rt.tp_size) + " (one device per TP worker)");
  std::vector<device::spec> devices;
  for (std::size_t i = 0; i < rt.devices.size(); ++i) {
    const std::string key = index_path("runtime.devices", i);
    device::spec parsed;
    try {
      parsed = device::parse(rt.devices[i], key);
    } catch (const std::invalid_argument& e) {
      fail(key, without_prefix(e.what(), key));
    }
    for (std::size_t j = 0; j < devices.size(); ++j)
      if (devices[j].k == parsed.k && devices[j].index == parsed.index)
        fail(key, "device '" + rt.devices[i] + "' is already used by runtime.devices["
                    + std::to_string(j) + "]");
    devices.push_back(parsed);
  }
  check_at_least("runtime.kv_cache_bytes", rt.kv_cache_bytes, kv_cache_bytes_min);
  check_one_of("runtime.compute_dtype", rt.compute_dtype, {"auto", "float32", "bfloat16"});
  check_range("runtime.max_batch", rt.max_batch, 1, 65536);
  if (rt.compute_dtype == "bfloat16" && cfg.model.torch_dtype != model::dtype::bfloat16)
    fail("runtime.compute_dtype", std::string("bfloat16 needs a bfloat16 model, but "
                                              "model.torch_dtype is ")
                                    + model::dtype_name(cfg.model.torch_dtype));
  check_range("runtime.max_frame_bytes", rt.max_frame_bytes, frame_bytes_min, frame_bytes_max);
  check_range("runtime.kill_grace_ms", rt.kill_grace_ms, 0, kill_grace_max_ms);
  for (const auto& tf : timeout_fields())
    check_range(std::string("runtime.timeouts_ms.") + tf.name, rt.timeouts_ms.*tf.member,
                timeout_min_ms, timeout_max_ms);
  for (std::size_t i = 0; i < rt.faults.size(); ++i) {
    const std::string key = index_path("runtime.faults", i);
    check_one_of(key + ".command", rt.faults[i].command, fault_commands);
    check_one_of(key + ".kind", rt.faults[i].kind, fault_kinds);
    for (std::size_t j = 0; j < i; ++j) {
      const auto& a = rt.faults[j];
      const auto& b = rt.faults[i];
      bool same_runtime = a.incarnation == 0 || b.incarnation == 0 || a.incarnation == b.incarnation;
      if (same_runtime && a.command == b.command && a.after == b.after)
        fail(key, "targets the same occurrence of '" + b.command + "' as runtime.faults["
                    + std::to_string(j) + "] (one fault per occurrence)");
    }
  }

  const supervisor_config& sv = cfg.supervisor;
  if (sv.backoff_initial_ms > sv.backoff_max_ms)
    fail("supervisor.backoff_initial_ms",
         std::to_string(sv.backoff_initial_ms) + " exceeds supervisor.backoff_max_ms ("
           + std::to_string(sv.backoff_max_ms) + ")");

  const trainer_config& tr = cfg.trainer;
  if (!tr.devices.empty() && tr.devices.size() != rt.tp_size)
    fail("trainer.devices", "lists " + std::to_string(tr.devices.size())
                              + " devices; one per trainer rank (runtime.tp_size "
                              + std::to_string(rt.tp_size) + ") is required");
  for (std::size_t i = 0; i < tr.devices.size(); ++i) {
    const std::string key = index_path("trainer.devices", i);
    try {
      device::parse(tr.devices[i], key);
    } catch (const std::invalid_argument& e) {
      fail(key, without_prefix(e.what(), key));
    }
  }
  if (!(tr.lr >= 0.0f && tr.lr <= 1.0f))
    fail("trainer.lr", std::to_string(tr.lr) + " is out of range [0, 1]");
  if (!(tr.init_scale > 0.0f && tr.init_scale <= 10.0f))
    fail("trainer.init_scale", std::to_string(tr.init_scale) + " is out of range (0, 10]");
  for (std::size_t i = 0; i < tr.faults.size(); ++i) {
    const std::string key = index_path("trainer.faults", i);
    const trainer_fault& f = tr.faults[i];
    check_one_of(key + ".kind", f.kind,
                 {"drop_tensor", "wrong_shape", "fail_materialize", "never_report",
                  "wrong_manifest", "reject_final", "wrong_digest_terms", "fail_copy"});
    if (f.kind == "fail_copy" && cfg.publication.mode != "direct")
      fail(key + ".kind", "a fail_copy fault fails a direct write: it needs publication.mode "
                          "direct");
    if (f.rank >= rt.tp_size)
      fail(key + ".rank", "rank " + std::to_string(f.rank) + " does not exist (runtime.tp_size "
                            + std::to_string(rt.tp_size) + " trainer ranks)");
    if ((f.kind == "drop_tensor" || f.kind == "wrong_shape") && f.tensor.empty())
      fail(key + ".tensor", "a " + f.kind + " fault names the tensor");
  }

  const publication_config& pc = cfg.publication;
  check_at_least("publication.buffer_bytes", pc.buffer_bytes, 4096);
  check_range("publication.buffer_count", pc.buffer_count, 2, 16);
  check_one_of("publication.transport", pc.transport, {"shm", "cuda_ipc"});
  check_one_of("publication.mode", pc.mode, {"packed", "direct"});
  // The transport follows the devices: memfd buffers between CPU devices, CUDA IPC between
  // GPUs; trainer ranks and TP workers share their devices (same kind on both sides).
  {
    const bool want_cuda = pc.transport == "cuda_ipc";
    for (std::size_t i = 0; i < devices.size(); ++i)
      if ((devices[i].k == device::kind::cuda) != want_cuda)
        fail("publication.transport",
             "transport '" + pc.transport + "' needs " + (want_cuda ? "cuda:N" : "cpu:N")
               + " devices, but runtime.devices[" + std::to_string(i) + "] is '"
               + rt.devices[i] + "' (use '" + (want_cuda ? "shm" : "cuda_ipc") + "')");
    for (std::size_t i = 0; i < tr.devices.size(); ++i)
      if ((device::parse(tr.devices[i], "trainer.devices").k == device::kind::cuda) != want_cuda)
        fail(index_path("trainer.devices", i),
             "'" + tr.devices[i] + "' is not the device kind publication.transport '"
               + pc.transport + "' connects");
  }
  check_range("publication.gate_deadline_ms", pc.gate_deadline_ms, timeout_min_ms,
              timeout_max_ms);
  check_range("publication.republish_attempts", pc.republish_attempts, 0, 10);

  const job_config& jb = cfg.job;
  // 0: only the bootstrap generation with the checkpoint weights.
  check_range("job.iterations", jb.iterations, 0, 1000000);
  if (jb.prompts.empty())
    fail("job.prompts", "at least one prompt is required");
  for (std::size_t i = 0; i < jb.prompts.size(); ++i)
    if (jb.prompts[i].empty())
      fail(index_path("job.prompts", i), "a prompt must not be empty");
  check_range("job.n", jb.n, 1, 64);
  check_range("job.max_tokens", jb.max_tokens, 1, 4096);
  if (!(jb.temperature >= 0.0f && jb.temperature <= 10.0f))
    fail("job.temperature", std::to_string(jb.temperature) + " is out of range [0, 10]");
  if (!(jb.top_p > 0.0f && jb.top_p <= 1.0f))
    fail("job.top_p", std::to_string(jb.top_p) + " is out of range (0, 1]");
  if (!(jb.parity_tolerance > 0.0f && jb.parity_tolerance < 1.0f))
    fail("job.parity_tolerance", std::to_string(jb.parity_tolerance) + " is out of range (0, 1)");

  if (cfg.journal.enabled && cfg.journal.path.empty())
    fail("journal.path", "must not be empty when journal.enabled is true");
  const serve_config& srv = cfg.serve;
  if (srv.host.empty() || srv.host.find_first_of(" \t\r\n") != std::string::npos)
    fail("serve.host", "'" + srv.host + "' is not a host name or address");
  check_range("serve.port", srv.port, 0, 65535);
  if (!srv.token.empty() && !srv.token_env.empty())
    fail("serve.token", "set exactly one of serve.token and serve.token_env, not both");
  if (srv.present && srv.token.empty() && srv.token_env.empty())
    fail("serve.token_env", "a shared secret is required to join: set serve.token_env (the "
                            "name of an environment variable) or serve.token");
  if (!srv.token.empty() && srv.token.size() < min_token_chars)
    fail("serve.token", "the shared secret has " + std::to_string(srv.token.size())
                          + " characters; at least " + std::to_string(min_token_chars)
                          + " are required");
  if (!srv.token_env.empty() && !is_env_name(srv.token_env))
    fail("serve.token_env", "'" + srv.token_env + "' is not an environment variable name");
  if (srv.world_size != 0 && srv.world_size != rt.tp_size)
    fail("serve.world_size", std::to_string(srv.world_size) + " trainer ranks, but runtime.tp_size is "
                               + std::to_string(rt.tp_size)
                               + " (one trainer rank per TP worker; 0 = runtime.tp_size)");
  if (srv.embedded && srv.port == 0)
    fail("serve.port", "must be set (not 0) when serve.embedded is true: the other trainer "
                       "processes connect to rank 0's process on it");
  check_range("serve.join_timeout_ms", srv.join_timeout_ms, timeout_min_ms, timeout_max_ms);
  check_range("serve.publish_barrier_ms", srv.publish_barrier_ms, timeout_min_ms, timeout_max_ms);
  check_range("serve.publish_timeout_ms", srv.publish_timeout_ms, timeout_min_ms, timeout_max_ms);
  check_range("serve.handshake_timeout_ms", srv.handshake_timeout_ms, 10, 600000);
  check_range("serve.max_pending_handshakes", srv.max_pending_handshakes, 1, 65536);
  const tls_config& tls = srv.tls;
  if (!tls.enabled) {
    for (const auto& [key, value] : {std::pair<const char*, const std::string*>{"certificate", &tls.certificate},
                                     {"key", &tls.key}, {"passphrase", &tls.passphrase},
                                     {"cafile", &tls.cafile}})
      if (!value->empty())
        fail(std::string("serve.tls.") + key, "is set but serve.tls.enabled is false");
  } else {
    // Anonymous TLS authenticates neither side: the hello's token would go to whoever holds
    // the port. TLS here means mutual certificates.
    if (tls.certificate.empty() && tls.key.empty())
      fail("serve.tls.certificate", "required with serve.tls.enabled (and serve.tls.key, "
                                    "serve.tls.cafile): anonymous TLS authenticates neither side, "
                                    "so an impostor listener would receive the shared secret; "
                                    "without TLS the serve handshake already proves the secret "
                                    "both ways without sending it");
    if (tls.certificate.empty() != tls.key.empty())
      fail(tls.certificate.empty() ? "serve.tls.certificate" : "serve.tls.key",
           "serve.tls.certificate and serve.tls.key are set together");
    if (tls.cafile.empty())
      fail("serve.tls.cafile", "required with a certificate: it verifies the peers' certificates");
  }

  try {
    model::validate(cfg.model, rt.tp_size);
  } catch (const model::model_error& e) {
    fail(e.where, without_prefix(e.what(), e.where));
  }
}

} // namespace detail

using namespace detail;

void validate(const refit_config& cfg) {
  validate_config(cfg, [](const std::string&) { return std::string(); });
}

std::string resolve_token(const serve_config& serve) {
  if (!serve.present)
    throw config_error("serve", "the recipe has no serve section (host, port, token_env, ...)");
  if (!serve.token.empty())
    return serve.token;
  if (serve.token_env.empty())
    throw config_error("serve.token_env", "no shared secret configured");
  const char* value = std::getenv(serve.token_env.c_str());
  if (value == nullptr || *value == '\0')
    throw config_error("serve.token_env", "the environment variable " + serve.token_env
                                            + " is not set or empty");
  std::string token = value;
  if (token.size() < min_token_chars)
    throw config_error("serve.token_env", "the shared secret in " + serve.token_env + " has "
                                            + std::to_string(token.size())
                                            + " characters; at least "
                                            + std::to_string(min_token_chars) + " are required");
  return token;
}

std::uint32_t serve_world(const refit_config& cfg) {
  return cfg.serve.world_size != 0 ? cfg.serve.world_size : cfg.runtime.tp_size;
}

} // namespace refit::config
