#include "actors/runtime_proxy.hpp"

#include <cstdio>

#include <caf/actor_cast.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "messages/control.pb.h"
#include "runtime/control/protocol.hpp"
#include "runtime/control/runtime_channel.hpp"
#include "runtime/control/trace_wire.hpp"
#include "runtime/device/device.hpp"
#include "runtime/publication/memory_preflight.hpp"
#include "runtime/trace/trace.hpp"

namespace refit {

namespace pb = control::v1;
using proc::channel_event;
using self_ptr = runtime_proxy_impl::stateful_pointer<runtime_proxy_state>;

std::vector<std::string> runtime_arguments(const runtime_proxy_options& opts) {
  const auto& rt = opts.runtime;
  char init_scale[32];
  std::snprintf(init_scale, sizeof(init_scale), "%.9g", static_cast<double>(opts.init_scale));
  std::string devices;
  for (const auto& d : rt.devices)
    devices += (devices.empty() ? "" : ",") + d;
  std::vector<std::string> args{"--control-fd", "3",
                                "--tp", std::to_string(rt.tp_size),
                                "--devices", devices,
                                "--model", config::model_to_yaml(opts.model),
                                "--kv-cache-bytes", std::to_string(rt.kv_cache_bytes),
                                "--compute-dtype", rt.compute_dtype,
                                "--max-batch", std::to_string(rt.max_batch),
                                "--max-frame-bytes", std::to_string(rt.max_frame_bytes),
                                "--seed", std::to_string(opts.seed),
                                "--init-scale", init_scale};
  if (!opts.model_path.empty()) {
    args.emplace_back("--checkpoint");
    args.push_back(opts.model_path);
  }
  if (opts.publication_mode == "direct") {
    args.emplace_back("--publication-mode");
    args.emplace_back("direct");
  }
  for (const auto& f : rt.faults) {
    args.emplace_back("--fault");
    args.push_back(f.command + ":" + f.kind + ":" + std::to_string(f.after));
  }
  if (trace::enabled()) // this process traces (--trace FILE): the runtime ships its events
    args.emplace_back("--trace");
  return args;
}

runtime_proxy_state::~runtime_proxy_state() = default;

namespace {

std::chrono::milliseconds timeout_for(const config::timeouts& t, pb::Command cmd) {
  switch (cmd) {
    case pb::COMMAND_DESCRIBE: return config::ms(t.describe);
    case pb::COMMAND_GENERATE: return config::ms(t.generate);
    case pb::COMMAND_SCORE: return config::ms(t.generate); // teacher forcing: as long as generation
    case pb::COMMAND_SLEEP: return config::ms(t.sleep);
    case pb::COMMAND_WAKE_UP: return config::ms(t.wake_up);
    case pb::COMMAND_INIT_WEIGHT_TRANSFER: return config::ms(t.init_weight_transfer);
    case pb::COMMAND_START_WEIGHT_UPDATE: return config::ms(t.start_weight_update);
    case pb::COMMAND_UPDATE_WEIGHTS: return config::ms(t.update_weights);
    case pb::COMMAND_FINISH_WEIGHT_UPDATE: return config::ms(t.finish_weight_update);
    case pb::COMMAND_RELEASE_IPC: return config::ms(t.release_ipc);
    case pb::COMMAND_RESET_PREFIX_CACHE: return config::ms(t.reset_prefix_cache);
    case pb::COMMAND_SHUTDOWN: return config::ms(t.shutdown);
    default: return config::ms(t.describe);
  }
}

errc errc_from_wire(pb::ErrorCode code) {
  switch (code) {
    case pb::ERROR_CODE_UNSUPPORTED: return errc::runtime_unsupported;
    case pb::ERROR_CODE_INVALID_ARGUMENT: return errc::runtime_invalid_argument;
    case pb::ERROR_CODE_INVALID_STATE: return errc::runtime_invalid_state;
    case pb::ERROR_CODE_PROTOCOL_VERSION: return errc::runtime_protocol_version;
    case pb::ERROR_CODE_MALFORMED: return errc::runtime_malformed;
    case pb::ERROR_CODE_VALIDATION: return errc::runtime_validation;
    case pb::ERROR_CODE_INJECTED: return errc::runtime_injected;
    default: return errc::runtime_internal;
  }
}

// Answers that say the channel itself cannot be trusted any more.
bool breaks_channel(pb::ErrorCode code) {
  return code == pb::ERROR_CODE_PROTOCOL_VERSION || code == pb::ERROR_CODE_MALFORMED;
}

void pump(self_ptr self);

// Fails every call, kills and reaps the group, then quits with `err`.
void break_with(self_ptr self, caf::error err) {
  auto& st = self->state;
  if (st.ph == runtime_proxy_state::phase::broken)
    return;
  st.ph = runtime_proxy_state::phase::broken;
  st.failure = std::move(err);
  if (st.channel) {
    st.channel->interrupt();
    st.channel->terminate(std::chrono::milliseconds(0),
                          std::chrono::milliseconds(st.opts.runtime.kill_grace_ms));
  }
}

void on_reaped(self_ptr self, const std::string& exit_detail) {
  auto& st = self->state;
  caf::error reason = st.failure;
  if (reason && !exit_detail.empty() && exit_detail != "already exited") {
    // Keep the code and where; add how the process ended.
    auto where = error_where(reason);
    auto msg = error_message(reason) + " (runtime " + exit_detail + ")";
    reason = make_refit_error(static_cast<errc>(reason.code()), where, msg);
  }
  if (st.inflight) {
    st.inflight->on_error(reason ? reason
                                 : make_refit_error(errc::shutting_down, "runtime",
                                                    "the runtime was shut down"));
    st.inflight.reset();
  }
  for (auto& c : st.queue)
    c.on_error(reason ? reason
                      : make_refit_error(errc::shutting_down, "runtime",
                                         "the runtime was shut down"));
  st.queue.clear();
  for (auto& f : st.after_reap)
    f();
  st.after_reap.clear();
  if (reason)
    self->quit(reason);
  else
    self->quit();
}

void handle_response(self_ptr self, const channel_message& ev) {
  auto& st = self->state;
  if (!st.inflight || st.inflight->id != ev.request_id)
    return; // a late answer after break: ignored, the channel is being torn down
  auto call = std::move(*st.inflight);
  st.inflight.reset();
  auto cmd = static_cast<pb::Command>(call.command);
  pb::Response rsp;
  if (!rsp.ParseFromString(ev.payload)) {
    break_with(self, make_refit_error(errc::protocol_error, "frame.payload",
                                      std::string("response to '") + protocol::command_name(cmd)
                                        + "' is not a valid Response message ("
                                        + std::to_string(ev.payload.size()) + " bytes)"));
    st.inflight = std::move(call); // failed in on_reaped
    return;
  }
  wire::ingest_trace(rsp); // --trace: the runtime's events, on its tracks
  trace::complete(trace::tracks::runtime_proxy(), protocol::command_name(cmd), call.trace_start_ns,
                  {{"request_id", call.id}, {"ok", rsp.ok()}});
  if (auto v = protocol::validate_response(rsp, call.id, cmd)) {
    break_with(self, make_refit_error(errc::protocol_error, "response." + v->field, v->message));
    st.inflight = std::move(call);
    return;
  }
  if (!rsp.ok()) {
    const auto& e = rsp.error();
    auto err = make_refit_error(errc_from_wire(e.code()),
                                e.where().empty() ? protocol::command_name(cmd) : e.where(),
                                e.message());
    if (breaks_channel(e.code())) {
      break_with(self, err);
      st.inflight = std::move(call);
      return;
    }
    call.on_error(err);
  } else {
    call.on_ok(ev.payload);
  }
  pump(self);
}

void handle_channel(self_ptr self, const channel_message& ev) {
  auto& st = self->state;
  switch (static_cast<channel_event::kind>(ev.kind)) {
    case channel_event::kind::spawned:
      st.pid = ev.pid;
      return;
    case channel_event::kind::spawn_failed:
      break_with(self, make_refit_error(errc::spawn_failed, "runtime.executable", ev.detail));
      return;
    case channel_event::kind::response:
      handle_response(self, ev);
      return;
    case channel_event::kind::io_failed: {
      if (!st.inflight || st.inflight->id != ev.request_id)
        return;
      auto cmd = protocol::command_name(static_cast<pb::Command>(st.inflight->command));
      auto code = static_cast<wire::frame_errc>(ev.code);
      if (code == wire::frame_errc::timeout)
        break_with(self, make_refit_error(errc::runtime_timeout, cmd,
                                          "no answer within "
                                            + std::to_string(st.inflight->timeout.count())
                                            + " ms"));
      else if (code == wire::frame_errc::eof || code == wire::frame_errc::truncated)
        break_with(self, make_refit_error(errc::runtime_exited, cmd, ev.detail));
      else if (code == wire::frame_errc::interrupted)
        return; // we interrupted it ourselves: break_with already ran
      else
        break_with(self, make_refit_error(errc::protocol_error, "frame", ev.detail));
      return;
    }
    case channel_event::kind::exited:
      // Exit code 3: refit-runtime's own memory preflight refused (its stderr names the key
      // and both numbers). Deterministic: reported as preflight_failed, not as a crash.
      if (ev.detail == "exited with code 3")
        break_with(self, make_refit_error(errc::preflight_failed, "runtime.kv_cache_bytes",
                                          "refit-runtime's memory preflight refused to allocate "
                                          "its KV cache and resident weights (see its stderr); "
                                          "the runtime process " + ev.detail));
      else
        break_with(self, make_refit_error(errc::runtime_exited, "runtime",
                                          "the runtime process " + ev.detail));
      return;
    case channel_event::kind::reaped:
      on_reaped(self, ev.detail);
      return;
  }
}

void pump(self_ptr self) {
  auto& st = self->state;
  if (st.inflight || st.queue.empty() || !st.channel)
    return;
  if (st.ph == runtime_proxy_state::phase::broken || st.ph == runtime_proxy_state::phase::stopping)
    return;
  st.inflight = std::move(st.queue.front());
  st.queue.pop_front();
  st.inflight->trace_start_ns = trace::start();
  st.channel->transact(st.inflight->id, st.inflight->bytes, st.inflight->timeout);
}

// Queues a request with raw callbacks (one request on the wire at a time).
void enqueue(self_ptr self, pb::Request req, std::function<void(const std::string&)> on_ok,
             std::function<void(const caf::error&)> on_error,
             std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
  auto& st = self->state;
  runtime_proxy_state::call c;
  c.id = st.next_id++;
  req.set_request_id(c.id);
  c.command = static_cast<std::uint32_t>(req.command());
  c.timeout = timeout ? *timeout : timeout_for(st.opts.runtime.timeouts_ms, req.command());
  c.bytes = req.SerializeAsString();
  c.on_ok = std::move(on_ok);
  c.on_error = std::move(on_error);
  st.queue.push_back(std::move(c));
  pump(self);
}

caf::error going_away(const runtime_proxy_state& st) {
  return st.failure ? st.failure
                    : make_refit_error(errc::shutting_down, "runtime",
                                       "the runtime is shutting down");
}

// Queues a command; `convert` turns the validated ok Response into the reply value.
template <class T, class Convert>
caf::typed_response_promise<T> submit(self_ptr self, pb::Request req, Convert convert) {
  auto& st = self->state;
  auto rp = self->make_response_promise<T>();
  if (st.ph == runtime_proxy_state::phase::broken
      || st.ph == runtime_proxy_state::phase::stopping) {
    rp.deliver(going_away(st));
    return rp;
  }
  enqueue(
    self, std::move(req),
    [rp, convert](const std::string& bytes) mutable {
      pb::Response rsp;
      rsp.ParseFromString(bytes); // already validated once
      rp.deliver(convert(rsp));
    },
    [rp](const caf::error& err) mutable { rp.deliver(err); });
  return rp;
}

// After the runtime answered shutdown (or failed to): terminate and reap the group; the
// owed replies go out in on_reaped.
void begin_stop(self_ptr self) {
  auto& st = self->state;
  if (st.ph == runtime_proxy_state::phase::broken || st.ph == runtime_proxy_state::phase::stopping)
    return; // break_with already tears down
  st.ph = runtime_proxy_state::phase::stopping;
  auto grace = std::chrono::milliseconds(st.opts.runtime.kill_grace_ms);
  st.channel->terminate(grace, grace);
}

pb::Request request(pb::Command cmd) {
  return protocol::make_request(0, cmd);
}

caf::error memory_preflight(const runtime_proxy_options& opts) {
  try {
    std::vector<device::spec> devices;
    for (std::size_t r = 0; r < opts.runtime.devices.size(); ++r)
      devices.push_back(device::parse(opts.runtime.devices[r],
                                      "runtime.devices[" + std::to_string(r) + "]"));
    publication::preflight_runtime_memory(opts.model, devices, opts.runtime.kv_cache_bytes);
  } catch (const publication::memory_refusal& e) {
    std::string msg = e.what();
    return make_refit_error(errc::preflight_failed, e.key, msg.substr(e.key.size() + 2));
  } catch (const std::exception& e) {
    return make_refit_error(errc::preflight_failed, "runtime", e.what());
  }
  return {};
}

} // namespace

runtime_proxy_impl::behavior_type runtime_proxy(self_ptr self, runtime_proxy_options opts) {
  auto& st = self->state;
  st.opts = std::move(opts);
  // Events from the channel thread come back as messages. Hold only a weak reference:
  // the thread must never keep the actor alive.
  caf::actor_addr weak = self->address();
  auto forward = [weak](channel_event ev) {
    channel_message msg;
    msg.kind = static_cast<std::uint8_t>(ev.k);
    msg.request_id = ev.request_id;
    msg.pid = ev.pid;
    msg.code = static_cast<std::uint8_t>(ev.code);
    msg.payload = std::move(ev.payload);
    msg.detail = std::move(ev.detail);
    if (auto hdl = caf::actor_cast<runtime_proxy_impl>(weak))
      caf::anon_send(hdl, io_done_atom::value, std::move(msg));
  };
  proc::spawn_options so;
  so.executable = st.opts.executable_path;
  so.args = runtime_arguments(st.opts);
  so.scrub_env = st.opts.scrub_env; // the shared secret stays in this process
  // Memory preflight before the process exists: KV cache and resident weights of every TP
  // worker against MemAvailable / each GPU's free bytes. A refusal is deterministic
  // (errc::preflight_failed naming the key): the supervisor does not retry it as a crash.
  if (auto refusal = memory_preflight(st.opts)) {
    st.ph = runtime_proxy_state::phase::broken;
    self->quit(refusal);
  } else {
    st.channel = std::make_unique<proc::runtime_channel>(std::move(so),
                                                         st.opts.runtime.max_frame_bytes, forward);
  }
  // Startup handshake: the first describe must be answered within `startup`; requests that
  // arrive meanwhile queue behind it, so a validated answer is all it has to produce.
  auto hello = request(pb::COMMAND_DESCRIBE);
  hello.mutable_describe();
  enqueue(
    self, std::move(hello), [](const std::string&) {},
    [self](const caf::error& err) {
      break_with(self, make_refit_error(errc::spawn_failed, "runtime",
                                        "startup describe failed: " + render(err)));
    },
    config::ms(st.opts.runtime.timeouts_ms.startup));
  return {
    [=](describe_atom) {
      auto req = request(pb::COMMAND_DESCRIBE);
      req.mutable_describe();
      return submit<runtime_description>(
        self, std::move(req), [](const pb::Response& r) { return protocol::from_proto(r.describe()); });
    },
    [=](generate_atom, const generate_request& x) {
      auto req = request(pb::COMMAND_GENERATE);
      *req.mutable_generate() = protocol::to_proto(x);
      return submit<generate_result>(
        self, std::move(req), [](const pb::Response& r) { return protocol::from_proto(r.generate()); });
    },
    [=](score_atom, const score_request& x) {
      auto req = request(pb::COMMAND_SCORE);
      *req.mutable_score() = protocol::to_proto(x);
      return submit<score_result>(
        self, std::move(req), [](const pb::Response& r) { return protocol::from_proto(r.score()); });
    },
    [=](sleep_atom, std::uint32_t level) {
      auto req = request(pb::COMMAND_SLEEP);
      req.mutable_sleep()->set_level(level);
      return submit<runtime_description>(self, std::move(req), [](const pb::Response& r) {
        return protocol::from_proto(r.sleep().state());
      });
    },
    [=](wake_atom, const wake_tags& tags) {
      auto req = request(pb::COMMAND_WAKE_UP);
      *req.mutable_wake_up() = protocol::to_proto(tags);
      return submit<runtime_description>(self, std::move(req), [](const pb::Response& r) {
        return protocol::from_proto(r.wake_up().state());
      });
    },
    [=](init_wt_atom, const transfer_init& x) {
      auto req = request(pb::COMMAND_INIT_WEIGHT_TRANSFER);
      *req.mutable_init_weight_transfer() = protocol::to_proto(x);
      return submit<std::string>(self, std::move(req), [](const pb::Response& r) {
        return r.init_weight_transfer().transport();
      });
    },
    [=](start_upd_atom, const publication_header& h) {
      auto req = request(pb::COMMAND_START_WEIGHT_UPDATE);
      *req.mutable_start_weight_update()->mutable_header() = protocol::to_proto(h);
      return submit<std::string>(self, std::move(req), [](const pb::Response& r) {
        return r.start_weight_update().publication_id();
      });
    },
    [=](update_atom, const weight_chunk& chunk) {
      auto req = request(pb::COMMAND_UPDATE_WEIGHTS);
      *req.mutable_update_weights() = protocol::to_proto(chunk);
      return submit<chunk_ack>(self, std::move(req), [](const pb::Response& r) {
        return protocol::from_proto(r.update_weights());
      });
    },
    [=](finish_upd_atom, const finish_request& x) {
      auto req = request(pb::COMMAND_FINISH_WEIGHT_UPDATE);
      *req.mutable_finish_weight_update() = protocol::to_proto(x);
      return submit<commit_result>(self, std::move(req), [](const pb::Response& r) {
        return protocol::from_proto(r.finish_weight_update());
      });
    },
    [=](release_atom, const std::string& publication_id) {
      auto req = request(pb::COMMAND_RELEASE_IPC);
      req.mutable_release_ipc()->set_publication_id(publication_id);
      return submit<std::uint32_t>(self, std::move(req), [](const pb::Response& r) {
        return r.release_ipc().buffers_closed();
      });
    },
    [=](reset_pc_atom) {
      auto req = request(pb::COMMAND_RESET_PREFIX_CACHE);
      req.mutable_reset_prefix_cache();
      return submit<std::uint64_t>(self, std::move(req), [](const pb::Response& r) {
        return r.reset_prefix_cache().entries_dropped();
      });
    },
    [=](shutdown_atom) -> caf::result<caf::ok_atom> {
      auto rp = self->make_response_promise<caf::ok_atom>();
      auto& st = self->state;
      st.after_reap.push_back([rp]() mutable { rp.deliver(caf::ok_atom::value); });
      if (st.ph == runtime_proxy_state::phase::broken
          || st.ph == runtime_proxy_state::phase::stopping)
        return rp;
      auto req = request(pb::COMMAND_SHUTDOWN);
      req.mutable_shutdown();
      // Whatever the answer, the group ends up terminated and reaped before ok goes out.
      enqueue(
        self, std::move(req), [self](const std::string&) { begin_stop(self); },
        [self](const caf::error&) { begin_stop(self); });
      return rp;
    },
    [=](poison_atom, const std::string& reason) -> caf::result<caf::ok_atom> {
      auto rp = self->make_response_promise<caf::ok_atom>();
      self->state.after_reap.push_back([rp]() mutable { rp.deliver(caf::ok_atom::value); });
      break_with(self, make_refit_error(errc::poisoned, "runtime", reason));
      return rp;
    },
    [=](io_done_atom, const channel_message& ev) { handle_channel(self, ev); },
  };
}

} // namespace refit
