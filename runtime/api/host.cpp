// refit embedding API (runtime/api/refit/host.hpp): one trainer rank in its own process.
// Owns a CAF actor system with the middleman; spawns this rank's TrainerRank (its shards, its
// worker thread, the cross-process all-gather over this process's shm endpoint) and its
// TrainerHost; with serve.embedded, rank 0 also runs the coordinator services. Every blocking
// call here runs on the caller's thread, through requests with finite timeouts.
#include "host_impl.hpp"

#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <thread>

#include "runtime/system/bootstrap.hpp"
#include "runtime/device/device.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"
#include "runtime/system/network.hpp"
#include "runtime/control/process.hpp"
#include "runtime/control/protocol_version.hpp"
#include "runtime/publication/backend.hpp"
#if REFIT_HAVE_CUDA
#include "runtime/cuda/nccl_process_collective.hpp"
#endif

#ifndef REFIT_LIBRARY_VERSION
#define REFIT_LIBRARY_VERSION "unknown"
#endif

namespace refit::api {

const char* library_version() {
  return REFIT_LIBRARY_VERSION;
}

std::uint32_t wire_protocol_version() {
  return wire::serve_protocol_version;
}

error api_error(const std::string& code, const std::string& where, const std::string& message) {
  error e;
  e.code = code;
  e.where = where;
  e.message = message;
  e.text = "refit." + code + (where.empty() ? "" : " at " + where) + ": " + message;
  return e;
}

error from_caf(const caf::error& err) {
  if (!err)
    return {};
  if (err.category() == caf::atom("refit")) {
    error e;
    e.code = to_string(static_cast<errc>(err.code()));
    e.where = error_where(err);
    e.message = error_message(err);
    e.text = render(err);
    return e;
  }
  error e;
  e.code = "caf";
  e.message = caf::to_string(err);
  e.text = "caf: " + e.message;
  return e;
}

namespace {

error from_config(const config::config_error& e) {
  return api_error("invalid_argument", e.key, e.what());
}

publication convert(const publication_result& r) {
  publication p;
  p.publication_id = r.publication_id;
  p.model_version = r.model_version;
  p.manifest_fingerprint = r.manifest_fingerprint;
  p.tensors = r.tensors;
  p.bytes = r.bytes;
  p.chunks = r.chunks;
  p.trainer_ranks = r.trainer_ranks;
  p.tp = r.tp;
  p.seconds = r.seconds;
  p.peak_buffer_bytes = r.peak_buffer_bytes;
  p.attempts = r.attempts;
  p.recovered_errors = r.recovered_errors;
  for (const auto& rc : r.receipts) {
    receipt out;
    out.tp_rank = rc.tp_rank;
    out.device_uuid = rc.device_uuid;
    out.resident_tensor_count = rc.resident_tensor_count;
    for (const auto& c : rc.checksums)
      out.checksums.push_back({c.name, c.digest});
    p.receipts.push_back(std::move(out));
  }
  return p;
}

std::string hostname() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

} // namespace

result<std::unique_ptr<host>> host::create(host_options options) {
  auto p = std::make_unique<impl>();
  try {
    p->cfg = config::load_file(options.config_path);
    if (!options.coordinator_host.empty())
      p->cfg.serve.host = options.coordinator_host;
    if (options.coordinator_port >= 0)
      p->cfg.serve.port = static_cast<std::uint32_t>(options.coordinator_port);
    config::validate(p->cfg);
    if (!p->cfg.serve.present)
      throw config::config_error("serve", "the recipe has no serve section (host, port, "
                                          "token_env, world_size, ...)");
  } catch (const config::config_error& e) {
    return from_config(e);
  }
  if (p->cfg.serve.port == 0 && !(p->cfg.serve.embedded))
    return api_error("invalid_argument", "serve.port",
                     "a trainer process needs the coordinator's port: set serve.port or "
                     "host_options.coordinator_port");
  p->options = std::move(options);
  p->address = p->cfg.serve.host + ":" + std::to_string(p->cfg.serve.port);
  return std::unique_ptr<host>(new host(std::move(p)));
}

host::host(std::unique_ptr<impl> p) : impl_(std::move(p)) {}

host::~host() {
  close();
}

synthetic_weights host::recipe_weights() const {
  synthetic_weights w;
  w.seed = impl_->cfg.job.seed;
  w.lr = impl_->cfg.trainer.lr;
  w.init_scale = impl_->cfg.trainer.init_scale;
  return w;
}

error host::register_rank(rank_spec spec) {
  auto& p = *impl_;
  if (p.connected)
    return api_error("invalid_state", "register_rank", "already connected");
  if (p.registered)
    return api_error("invalid_state", "register_rank", "tensors are registered for the rank "
                                                       "registered before");
  auto world = config::serve_world(p.cfg);
  if (spec.world == 0)
    spec.world = world;
  if (spec.world != world)
    return api_error("invalid_argument", "rank.world",
                     "this process was told world " + std::to_string(spec.world)
                       + ", the recipe serves " + std::to_string(world) + " trainer ranks");
  if (spec.rank >= spec.world)
    return api_error("invalid_argument", "rank.rank",
                     "rank " + std::to_string(spec.rank) + " is out of range for "
                       + std::to_string(spec.world) + " ranks");
  if (spec.device.empty())
    spec.device = p.cfg.trainer.devices.empty() ? p.cfg.runtime.devices[spec.rank]
                                                : p.cfg.trainer.devices[spec.rank];
  try {
    auto d = device::parse(spec.device, "rank.device");
#if REFIT_HAVE_CUDA
    (void)d; // CPU devices, or one GPU per trainer process (its own NCCL communicator)
#else
    if (d.k != device::kind::cpu)
      return api_error("invalid_argument", "rank.device",
                       "'" + spec.device + "': this build publishes from CPU devices only "
                       "(CUDA devices need a build with REFIT_CUDA=ON)");
#endif
  } catch (const std::invalid_argument& e) {
    return api_error("invalid_argument", "rank.device", e.what());
  }
  p.rank = spec;
  return {};
}

error host::register_weights(synthetic_weights weights) {
  auto& p = *impl_;
  if (p.connected)
    return api_error("invalid_state", "register_weights", "already connected");
  if (!(weights.lr >= 0.0f && weights.lr <= 1.0f))
    return api_error("invalid_argument", "weights.lr", std::to_string(weights.lr) + " is out of range [0, 1]");
  if (!(weights.init_scale > 0.0f && weights.init_scale <= 10.0f))
    return api_error("invalid_argument", "weights.init_scale",
                     std::to_string(weights.init_scale) + " is out of range (0, 10]");
  if (p.registered)
    return api_error("invalid_state", "register_weights",
                     "this rank already registered its own tensors (register_tensor)");
  p.weights = weights;
  return {};
}

error host::register_tensor(tensor_spec spec) {
  auto& p = *impl_;
  const std::string where = spec.name.empty() ? "tensor" : spec.name;
  if (p.connected)
    return api_error("invalid_state", where, "register_tensor after connect");
  if (!p.rank)
    return api_error("invalid_state", where, "register_rank first");
  if (p.weights)
    return api_error("invalid_state", where,
                     "this rank already registered synthetic weights (register_weights)");
  try {
    if (!p.registered)
      p.registered = std::make_shared<refit::publication::registered_weights>(
        p.cfg.model, p.rank->world, p.rank->rank, device::parse(p.rank->device, "rank.device"));
    refit::publication::tensor_registration t;
    t.name = spec.name;
    t.data = static_cast<const std::byte*>(spec.data);
    t.bytes = spec.bytes;
    t.dt = model::parse_dtype(spec.dtype, where + ".dtype");
    t.device = spec.device;
    t.global_shape = spec.global_shape;
    t.placement = spec.sharding == placement::replicated
                    ? refit::publication::tensor_placement::replicated
                    : refit::publication::tensor_placement::shard0;
    t.row_begin = spec.row_begin;
    t.rows = spec.rows;
    p.registered->add(std::move(t));
  } catch (const model::model_error& e) {
    return api_error("invalid_argument", e.where, e.what());
  } catch (const std::exception& e) {
    return api_error("invalid_argument", where, e.what());
  }
  p.tensors.push_back(std::move(spec));
  return {};
}

namespace {

std::string pointer_text(const void* ptr) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", ptr);
  return buf;
}

} // namespace

error moved_error(const tensor_spec& t, const void* data, std::uint64_t bytes) {
  return api_error("invalid_argument", t.name,
                   "the tensor's memory changed since registration (pointer "
                     + pointer_text(t.data) + " -> " + pointer_text(data) + ", "
                     + std::to_string(t.bytes) + " -> " + std::to_string(bytes)
                     + " bytes): registered memory must stay at the same address and size; "
                       "nothing was published");
}

error host::check_tensor(const std::string& name, const void* data, std::uint64_t bytes) const {
  for (const auto& t : impl_->tensors)
    if (t.name == name)
      return t.data == data && t.bytes == bytes ? error{} : moved_error(t, data, bytes);
  return api_error("invalid_argument", name, "no tensor of this name is registered");
}

std::vector<model_tensor> host::model_tensors() const {
  std::vector<model_tensor> out;
  for (const auto& p : model::expected_key_stream(impl_->cfg.model))
    out.push_back({p.name, p.shape, model::dtype_name(p.dt)});
  return out;
}

error host::impl::connect() {
  // Everything connect_steps() started goes again on failure; its scoped actor is gone by then
  // (the actor system's destructor waits for every actor).
  auto e = connect_steps();
  if (e)
    stop();
  return e;
}

error host::impl::connect_steps() {
  if (connected)
    return api_error("invalid_state", "connect", "already connected");
  if (!rank)
    return api_error("invalid_state", "connect", "register_rank first");
  if (!weights && !registered)
    return api_error("invalid_state", "connect", "register_weights or register_tensor first");
  if (registered) {
    try {
      registered->seal(); // the whole set against the model's key stream
    } catch (const model::model_error& e) {
      return api_error("invalid_argument", e.where, e.what());
    } catch (const std::exception& e) {
      return api_error("invalid_argument", "tensors", e.what());
    }
  }
  try {
    token = config::resolve_token(cfg.serve);
  } catch (const config::config_error& e) {
    return from_config(e);
  }
  const auto join_timeout = std::chrono::milliseconds(cfg.serve.join_timeout_ms);
  sys_cfg = std::make_unique<caf::actor_system_config>();
  configure(*sys_cfg);
  try {
    net::configure_network(*sys_cfg, cfg.serve);
  } catch (const config::config_error& e) {
    sys_cfg.reset();
    return from_config(e);
  }
  sys = std::make_unique<caf::actor_system>(*sys_cfg);

  // The coordinator: in this process (serve.embedded, rank 0) or reached over the network.
  if (cfg.serve.embedded && rank->rank == 0) {
    std::string exe;
    try {
      exe = proc::resolve_executable(options.runtime_executable.empty() ? cfg.runtime.executable
                                                                        : options.runtime_executable);
    } catch (const std::exception& e) {
      return api_error("invalid_argument", "runtime.executable", e.what());
    }
    auto log = [prefix = "refit[" + std::to_string(::getpid()) + "] coordinator: "](const std::string& line) {
      std::cerr << prefix + line + "\n" << std::flush;
    };
    auto services = serve::start_coordinator(*sys, cfg, exe, static_cast<std::uint16_t>(cfg.serve.port), log);
    if (!services)
      return from_caf(services.error());
    embedded = *services;
    registry = embedded->registry;
  } else {
    // Trainer processes may start before the coordinator listens (torchrun starts them all at
    // once): a refused connection is tried again until serve.join_timeout_ms has passed.
    auto deadline = std::chrono::steady_clock::now() + join_timeout;
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
      auto r = net::connect_registry(*sys, cfg.serve, cfg.serve.host,
                                     static_cast<std::uint16_t>(cfg.serve.port),
                                     std::max(left, std::chrono::milliseconds(1)));
      if (r) {
        registry = *r;
        break;
      }
      if (static_cast<errc>(r.error().code()) != errc::coordinator_unreachable
          || std::chrono::steady_clock::now() + std::chrono::milliseconds(100) >= deadline)
        return from_caf(r.error());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  caf::scoped_actor self{*sys};
  // The hello and join carry the token only with TLS (to a certificate-verified coordinator).
  // In plain mode the connection already proved the secret both ways, and the secret never
  // travels: the fields stay empty. (An embedded coordinator is this process: no wire at all.)
  const std::string wire_token = cfg.serve.tls.enabled ? token : std::string();
  token = wire_token; // what the rollout requests (generate, sleep, wake, status) carry too
  // hello: protocol version (and, with TLS, the shared secret); the answer carries the gate.
  welcome w;
  consensus_gate_actor gate;
  caf::error err;
  self->request(registry, join_timeout, hello_atom::value, wire::serve_protocol_version, wire_token)
    .receive([&](welcome& x, consensus_gate_actor& g) { w = std::move(x), gate = std::move(g); },
             [&](caf::error& e) { err = std::move(e); });
  if (err)
    return err == caf::sec::request_timeout
             ? api_error("coordinator_unreachable", address,
                         "no answer to hello within serve.join_timeout_ms")
             : from_caf(err);
  if (w.world != rank->world)
    return api_error("join_refused", "rank.world",
                     "the coordinator (" + w.coordinator + ") serves " + std::to_string(w.world)
                       + " trainer ranks, this process was started for "
                       + std::to_string(rank->world));

  // This rank: its all-gather endpoint, its TrainerRank and its TrainerHost.
  try {
    group = std::make_shared<refit::publication::shm_group>(
      std::make_shared<refit::publication::shm_endpoint>(rank->rank));
  } catch (const std::exception& e) {
    return api_error("spawn_failed", "collective", e.what());
  }
  trainer_rank_options ro;
  ro.rank = rank->rank;
  ro.world = rank->world;
  ro.device = rank->device;
  ro.model = cfg.model;
  if (weights) {
    // A recipe with model.path: the synthetic steps start from the checkpoint, as the
    // coordinator's verifier and the runtime's version 0 do.
    try {
      ro.weights = {weights->seed, weights->lr, weights->init_scale,
                    config::trainer_weights(cfg).initial};
    } catch (const std::exception& e) {
      return api_error("invalid_argument", "model.path", e.what());
    }
  }
  ro.registered = registered;
  for (const auto& f : cfg.trainer.faults)
    if (f.rank == rank->rank)
      ro.faults.push_back(f);
  ro.device_uuid = refit::publication::device_uuid(device::parse(rank->device, "rank.device"));
  ro.collectives = group; // every publication's collective: a shm_collective over the members
  if (device::parse(rank->device, "rank.device").k == device::kind::cuda) {
#if REFIT_HAVE_CUDA
    // One GPU per trainer process: this process's NCCL communicator, rank `rank` of `world`.
    // Rank 0 creates each communicator's unique id and offers it through the coordinator
    // (the RankRegistry's collective_id); the other ranks fetch it there, each wait bounded
    // by the collective's deadline. Called on the TrainerRank's worker thread.
    auto exchange = [sys = sys.get(), registry = registry, wire = token, r = rank->rank](
                      const std::string& publication_id, const std::string& offered,
                      std::chrono::steady_clock::time_point deadline) -> std::string {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0)
        throw std::runtime_error("the deadline passed before the communicator id exchange");
      caf::scoped_actor self{*sys};
      std::string out;
      caf::error err;
      self->request(registry, left, collective_id_atom::value, wire, r, publication_id, offered)
        .receive([&](std::string& id) { out = std::move(id); },
                 [&](caf::error& e) { err = std::move(e); });
      if (err)
        throw std::runtime_error(
          "communicator id of publication " + publication_id + " from the coordinator: "
          + (err == caf::sec::request_timeout ? std::string("no answer before the deadline "
                                                            "(rank 0 did not offer it)")
                                              : render(err)));
      return out;
    };
    try {
      ro.collectives = refit::cuda::make_nccl_process_registry(
        device::parse(rank->device, "rank.device").index, rank->rank, rank->world,
        std::move(exchange));
    } catch (const std::exception& e) {
      return api_error("spawn_failed", "collective", e.what());
    }
#endif
  }
  ro.gate = gate;
  ro.collective_timeout_ms = cfg.publication.gate_deadline_ms * 9 / 10;
  rank_actor = sys->spawn(trainer_rank, std::move(ro));
  for (std::uint64_t s = 0; weights && s < weights->start_step; ++s) {
    self->request(rank_actor, std::chrono::minutes(10), step_atom::value)
      .receive([](std::uint64_t) {}, [&](caf::error& e) { err = std::move(e); });
    if (err)
      return from_caf(err);
  }
  auto b = serve::bounds_of(cfg);
  trainer_host_options ho;
  ho.rank = rank->rank;
  ho.world = rank->world;
  ho.registry = registry;
  ho.group = group;
  ho.coordinator = address;
  ho.membership_wait_ms = b.membership_wait_ms;
  ho.publish_timeout_ms = b.host_publish_timeout_ms;
  host_actor = sys->spawn(trainer_host, std::move(ho));

  // join: the registry checks version, secret, rank, world and model again.
  join_request req;
  req.protocol_version = wire::serve_protocol_version;
  req.token = wire_token;
  req.rank = rank->rank;
  req.world = rank->world;
  req.device = rank->device;
  req.device_uuid = refit::publication::device_uuid(device::parse(rank->device, "rank.device"));
  req.manifest_fingerprint = model::structural_manifest(model::expected_key_stream(cfg.model));
  req.pid = ::getpid();
  req.hostname = hostname();
  req.collective_endpoint = group->endpoint()->handle();
  self->request(registry, join_timeout, join_atom::value, req, rank_actor, host_actor)
    .receive([](join_ack&) {}, [&](caf::error& e) { err = std::move(e); });
  if (err)
    return err == caf::sec::request_timeout
             ? api_error("coordinator_unreachable", address,
                         "no answer to join within serve.join_timeout_ms")
             : from_caf(err);
  connected = true;
  return {};
}

error host::connect() {
  return impl_->connect();
}

result<std::uint64_t> host::step() {
  auto& p = *impl_;
  if (!p.connected)
    return api_error("invalid_state", "step", "connect first");
  caf::scoped_actor self{*p.sys};
  std::optional<std::uint64_t> out;
  caf::error err;
  self->request(p.rank_actor, std::chrono::minutes(10), step_atom::value)
    .receive([&](std::uint64_t s) { out = s; }, [&](caf::error& e) { err = std::move(e); });
  if (!out)
    return from_caf(err);
  return *out;
}

result<publication> host::publish(std::uint64_t model_version) {
  auto& p = *impl_;
  if (!p.connected)
    return api_error("invalid_state", "publish", "connect first");
  // Registered memory that moved or resized is refused before anything is published.
  for (const auto& t : p.tensors)
    if (t.current) {
      const void* data = t.data;
      std::uint64_t bytes = t.bytes;
      t.current(data, bytes);
      if (data != t.data || bytes != t.bytes)
        return moved_error(t, data, bytes);
    }
  auto b = serve::bounds_of(p.cfg);
  caf::scoped_actor self{*p.sys};
  std::optional<publication> out;
  caf::error err;
  self->request(p.host_actor,
                std::chrono::milliseconds(b.membership_wait_ms) + std::chrono::milliseconds(b.host_publish_timeout_ms)
                  + std::chrono::seconds(10),
                publish_atom::value, model_version)
    .receive([&](publication_result& r) { out = convert(r); },
             [&](caf::error& e) { err = std::move(e); });
  if (!out)
    return from_caf(err);
  return *out;
}

void host::close() {
  if (impl_)
    impl_->stop();
}

std::uint32_t host::rank() const {
  return impl_->rank ? impl_->rank->rank : 0;
}

std::uint32_t host::world() const {
  return impl_->rank ? impl_->rank->world : config::serve_world(impl_->cfg);
}

bool host::connected() const {
  return impl_->connected;
}

} // namespace refit::api
