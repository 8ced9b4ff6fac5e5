#include "actors/rollout_engine.hpp"

#include <algorithm>
#include <set>

#include <caf/event_based_actor.hpp>
#include <caf/sec.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "runtime/control/protocol_version.hpp"

namespace refit {

using self_ptr = rollout_engine_actor::stateful_pointer<rollout_engine_state>;

engine_status rollout_engine_state::status() const {
  engine_status s;
  s.connection = static_cast<std::uint8_t>(conn);
  s.incarnation = incarnation;
  s.committed_version = committed_version;
  s.needs_publication = needs_publication;
  s.update_open = update_open;
  s.sleep_level = runtime.sleep_level;
  s.weights_awake = runtime.weights_awake;
  s.kv_cache_awake = runtime.kv_cache_awake;
  s.last_error = gave_up ? gave_up_reason : last_error;
  s.gave_up = gave_up;
  return s;
}

namespace {

// Whether `err` means the proxy is gone or going (the runtime is unusable either way).
bool is_channel_failure(const caf::error& err) {
  if (err.category() != caf::atom("refit"))
    return true; // request timeout, receiver down, ...
  switch (static_cast<errc>(err.code())) {
    case errc::protocol_error:
    case errc::runtime_timeout:
    case errc::runtime_exited:
    case errc::spawn_failed:
    case errc::poisoned:
    case errc::shutting_down:
    case errc::runtime_protocol_version:
    case errc::runtime_malformed:
      return true;
    default:
      return false;
  }
}

// A typed refusal made before anything reaches the runtime; nullopt = allowed.
caf::error refuse_unless_connected(const rollout_engine_state& st, const char* what) {
  switch (st.conn) {
    case connection_state::detached:
      if (st.gave_up)
        return make_refit_error(errc::restart_limit, what,
                                "the runtime is gone for good: " + st.gave_up_reason);
      return make_refit_error(errc::not_attached, what,
                              "no runtime is attached (it is starting or being restarted)");
    case connection_state::broken:
      return make_refit_error(errc::broken, what,
                              "the runtime connection is BROKEN (" + st.last_error
                                + "); a restarted runtime needs a full publication");
    case connection_state::inflight:
      return make_refit_error(errc::busy, what,
                              "another request is in flight; requests are one at a time");
    case connection_state::idle:
      break;
  }
  return {};
}

std::chrono::milliseconds request_timeout(const rollout_engine_options& o,
                                          std::uint32_t command_ms) {
  // The proxy enforces the command timeout itself and then needs the kill grace to reap; the
  // margin covers a startup handshake that may still be ahead of the request.
  return std::chrono::milliseconds(command_ms) + std::chrono::milliseconds(o.timeouts_ms.startup)
         + std::chrono::milliseconds(o.kill_grace_ms) + std::chrono::seconds(5);
}

// Marks the connection BROKEN and, if asked, poisons the runtime (kill + reap + restart by
// the supervisor). The published version stays what it was; the next runtime needs a
// full publication.
void mark_broken(self_ptr self, const caf::error& err, bool poison) {
  auto& st = self->state;
  st.conn = connection_state::broken;
  st.last_error = render(err);
  st.needs_publication = true;
  st.update_open = false;
  st.transfer_initialized = false;
  st.ipc_open = false;
  if (poison && st.proxy) {
    auto reason = "poisoned by the RolloutEngine after: " + st.last_error;
    journal::note_send(self, st.opts.journal, st.proxy, poison_atom::value, reason);
    self->request(st.proxy, request_timeout(st.opts, st.opts.timeouts_ms.shutdown), poison_atom::value,
                  reason)
      .then([](caf::ok_atom) {}, [](caf::error&) {});
  }
}

// Whether a failed request must poison the runtime: any answer that is not a channel failure,
// and the engine's own request timeout (the proxy did not answer at all, so nothing says it
// is going away by itself; without poison no DOWN and no restart would ever follow).
bool needs_poison(const caf::error& err) {
  return !is_channel_failure(err) || err == caf::sec::request_timeout;
}

// Forwards one request to the proxy. `on_ok(reply)` returns an error (validation failure)
// or a default error to accept. `unsafe` failures poison the runtime.
template <class Reply, class Promise, class OnOk, class... Ts>
void forward(self_ptr self, Promise rp, bool unsafe, std::uint32_t command_ms, OnOk on_ok,
             Ts&&... xs) {
  auto& st = self->state;
  st.conn = connection_state::inflight;
  auto incarnation = st.incarnation;
  journal::note_send(self, st.opts.journal, st.proxy, xs...);
  self->request(st.proxy, request_timeout(st.opts, command_ms), std::forward<Ts>(xs)...)
    .then(
      [=](Reply& reply) mutable {
        auto& st = self->state;
        if (st.incarnation != incarnation)
          return (void)rp.deliver(make_refit_error(errc::broken, "runtime",
                                             "the runtime was replaced while the request ran"));
        if (st.conn != connection_state::inflight) // BROKEN meanwhile: stays BROKEN
          return (void)rp.deliver(make_refit_error(errc::broken, "runtime",
                                                   "the runtime was marked BROKEN while the "
                                                   "request ran (" + st.last_error + ")"));
        st.conn = connection_state::idle;
        on_ok(reply, rp);
      },
      [=](caf::error& err) mutable {
        auto& st = self->state;
        if (st.incarnation == incarnation && st.conn != connection_state::detached) {
          bool unsafe_now = unsafe || st.update_open || st.ipc_open;
          if (is_channel_failure(err) || unsafe_now)
            mark_broken(self, err, needs_poison(err));
          else if (st.conn == connection_state::inflight)
            st.conn = connection_state::idle;
        }
        rp.deliver(err);
      });
}

// Parent-side validation of an untrusted description.
caf::error check_description(const rollout_engine_state& st, const runtime_description& d) {
  auto bad = [](const std::string& where, const std::string& msg) {
    return make_refit_error(errc::validation_failed, "describe." + where, msg);
  };
  if (d.tp_world_size != st.opts.tp_size)
    return bad("tp_world_size", "runtime reports TP " + std::to_string(d.tp_world_size)
                                  + ", configured " + std::to_string(st.opts.tp_size));
  if (d.workers.size() != d.tp_world_size)
    return bad("workers", std::to_string(d.workers.size()) + " workers for TP "
                            + std::to_string(d.tp_world_size));
  std::set<std::string> uuids;
  for (std::size_t r = 0; r < d.workers.size(); ++r) {
    const auto& w = d.workers[r];
    if (w.rank != r)
      return bad("workers[" + std::to_string(r) + "].rank",
                 "worker at position " + std::to_string(r) + " reports rank "
                   + std::to_string(w.rank));
    if (w.device_uuid.empty() || !uuids.insert(w.device_uuid).second)
      return bad("workers[" + std::to_string(r) + "].device_uuid",
                 "missing or duplicate device UUID '" + w.device_uuid + "'");
  }
  return {};
}

caf::error check_sleep(const runtime_description& d, std::uint32_t level) {
  if (d.sleep_level != level || d.kv_cache_awake || d.weights_awake
      || (level == 2 && d.weights_valid))
    return make_refit_error(errc::validation_failed, "sleep",
                            "runtime state after sleep(" + std::to_string(level)
                              + ") is inconsistent: sleep_level=" + std::to_string(d.sleep_level)
                              + " weights_awake=" + std::to_string(d.weights_awake)
                              + " kv_cache_awake=" + std::to_string(d.kv_cache_awake)
                              + " weights_valid=" + std::to_string(d.weights_valid));
  return {};
}

caf::error check_wake(const runtime_description& d, const wake_tags& tags) {
  if ((tags.weights && !d.weights_awake) || (tags.kv_cache && !d.kv_cache_awake))
    return make_refit_error(errc::validation_failed, "wake_up",
                            "runtime did not wake what was asked (weights_awake="
                              + std::to_string(d.weights_awake)
                              + " kv_cache_awake=" + std::to_string(d.kv_cache_awake) + ")");
  return {};
}

caf::error check_generate_request(const generate_request& x) {
  auto bad = [](const std::string& where, const std::string& msg) {
    return make_refit_error(errc::invalid_argument, "generate." + where, msg);
  };
  if (x.prompts.empty())
    return bad("prompts", "at least one prompt is required");
  for (std::size_t i = 0; i < x.prompts.size(); ++i)
    if (x.prompts[i].empty())
      return bad("prompts[" + std::to_string(i) + "]", "prompt has no tokens");
  const auto& p = x.params;
  if (p.n == 0)
    return bad("params.n", "n must be >= 1");
  if (p.max_tokens == 0)
    return bad("params.max_tokens", "max_tokens must be >= 1");
  if (!(p.temperature >= 0.0f))
    return bad("params.temperature", "temperature must be >= 0, got " + std::to_string(p.temperature));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
    return bad("params.top_p", "top_p must be in (0, 1], got " + std::to_string(p.top_p));
  if (p.top_k < 0)
    return bad("params.top_k", "top_k must be >= 0 (0 = disabled), got " + std::to_string(p.top_k));
  return {};
}

caf::error check_generate_result(const rollout_engine_state& st, const generate_request& req,
                                 const generate_result& res) {
  auto bad = [](const std::string& where, const std::string& msg) {
    return make_refit_error(errc::validation_failed, "generate." + where, msg);
  };
  if (res.model_version != st.committed_version)
    return bad("model_version", "runtime generated with version "
                                  + std::to_string(res.model_version) + ", committed is "
                                  + std::to_string(st.committed_version));
  auto expected = req.prompts.size() * req.params.n;
  if (res.samples.size() != expected)
    return bad("samples", std::to_string(res.samples.size()) + " samples, expected "
                            + std::to_string(expected));
  for (std::size_t i = 0; i < res.samples.size(); ++i) {
    const auto& s = res.samples[i];
    auto where = "samples[" + std::to_string(i) + "]";
    if (s.prompt_index >= req.prompts.size())
      return bad(where + ".prompt_index", "out of range");
    if (s.logprobs.size() != s.token_ids.size())
      return bad(where + ".logprobs", std::to_string(s.logprobs.size()) + " logprobs for "
                                        + std::to_string(s.token_ids.size()) + " tokens");
    if (s.token_ids.size() > req.params.max_tokens)
      return bad(where + ".token_ids", "more tokens than max_tokens");
  }
  return {};
}

// The refusals generate and score share (nothing is sent): an open update or IPC, weights
// that are not a committed version, a sleeping runtime.
caf::error refuse_generation(const rollout_engine_state& st, const std::string& command) {
  if (st.update_open || st.ipc_open)
    return make_refit_error(errc::update_open, command,
                            "a weight update is open (publication '" + st.header.publication_id
                              + "'); generation waits for commit and release");
  if (st.needs_publication)
    return make_refit_error(errc::needs_publication, command,
                            "the runtime's weights are not a committed version; a full "
                            "publication must commit first (committed version "
                              + std::to_string(st.committed_version) + ")");
  if (!st.runtime.weights_awake || !st.runtime.kv_cache_awake)
    return make_refit_error(errc::asleep, command,
                            std::string("the runtime is asleep (weights ")
                              + (st.runtime.weights_awake ? "awake" : "asleep") + ", KV cache "
                              + (st.runtime.kv_cache_awake ? "awake" : "asleep") + ")");
  return {};
}

caf::error check_score_request(const score_request& x) {
  auto bad = [](const std::string& where, const std::string& msg) {
    return make_refit_error(errc::invalid_argument, "score." + where, msg);
  };
  if (x.sequences.empty())
    return bad("sequences", "at least one sequence is required");
  if (x.start == 0)
    return bad("start", "start must be >= 1 (the token at position 0 has no context)");
  for (std::size_t i = 0; i < x.sequences.size(); ++i)
    if (x.sequences[i].size() <= x.start)
      return bad("sequences[" + std::to_string(i) + "]",
                 "sequence has " + std::to_string(x.sequences[i].size()) + " tokens; start "
                   + std::to_string(x.start) + " leaves none to score");
  return {};
}

caf::error check_score_result(const rollout_engine_state& st, const score_request& req,
                              const score_result& res) {
  auto bad = [](const std::string& where, const std::string& msg) {
    return make_refit_error(errc::validation_failed, "score." + where, msg);
  };
  if (res.model_version != st.committed_version)
    return bad("model_version", "runtime scored with version " + std::to_string(res.model_version)
                                  + ", committed is " + std::to_string(st.committed_version));
  if (res.logprobs.size() != req.sequences.size())
    return bad("sequences", std::to_string(res.logprobs.size()) + " scored sequences, expected "
                              + std::to_string(req.sequences.size()));
  for (std::size_t i = 0; i < res.logprobs.size(); ++i)
    if (res.logprobs[i].size() != req.sequences[i].size() - req.start)
      return bad("sequences[" + std::to_string(i) + "]",
                 std::to_string(res.logprobs[i].size()) + " logprobs, expected "
                   + std::to_string(req.sequences[i].size() - req.start));
  return {};
}

bool is_hex64(const std::string& s) {
  return s.size() == 64
         && std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

caf::error check_header(const rollout_engine_state& st, const publication_header& h) {
  auto bad = [](const std::string& where, const std::string& msg) {
    return make_refit_error(errc::invalid_argument, "header." + where, msg);
  };
  if (h.protocol_version != wire::protocol_version)
    return bad("protocol_version", "header has protocol version "
                                     + std::to_string(h.protocol_version) + ", expected "
                                     + std::to_string(wire::protocol_version));
  if (h.publication_id.empty())
    return bad("publication_id", "publication id is empty");
  if (h.model_version <= st.committed_version)
    return bad("model_version", "model version " + std::to_string(h.model_version)
                                  + " is not above the committed version "
                                  + std::to_string(st.committed_version));
  if (h.tp_world_size != st.runtime.tp_world_size)
    return bad("tp_world_size", "header TP " + std::to_string(h.tp_world_size) + ", runtime TP "
                                  + std::to_string(st.runtime.tp_world_size));
  if (h.device_uuids.size() != st.runtime.workers.size())
    return bad("device_uuids", std::to_string(h.device_uuids.size()) + " UUIDs for "
                                 + std::to_string(st.runtime.workers.size()) + " TP workers");
  for (std::size_t r = 0; r < h.device_uuids.size(); ++r)
    if (h.device_uuids[r] != st.runtime.workers[r].device_uuid)
      return bad("device_uuids[" + std::to_string(r) + "]",
                 "trainer rank " + std::to_string(r) + " is on " + h.device_uuids[r]
                   + " but TP worker " + std::to_string(r) + " is on "
                   + st.runtime.workers[r].device_uuid);
  if (!is_hex64(h.manifest_fingerprint))
    return bad("manifest_fingerprint", "not a hex SHA-256");
  return {};
}

caf::error check_commit(const rollout_engine_state& st, const finish_request& req,
                        const commit_result& res) {
  auto bad = [](const std::string& where, const std::string& msg) {
    return make_refit_error(errc::validation_failed, "commit." + where, msg);
  };
  const auto& h = st.header;
  if (res.publication_id != h.publication_id)
    return bad("publication_id", "runtime committed '" + res.publication_id + "', expected '"
                                   + h.publication_id + "'");
  if (res.model_version != req.model_version || res.model_version != h.model_version)
    return bad("model_version", "runtime committed version " + std::to_string(res.model_version)
                                  + ", expected " + std::to_string(h.model_version));
  if (!res.prefix_cache_reset)
    return bad("prefix_cache_reset", "the runtime did not reset its prefix cache");
  if (res.receipts.size() != h.tp_world_size)
    return bad("receipts", std::to_string(res.receipts.size()) + " receipts for TP "
                             + std::to_string(h.tp_world_size));
  for (std::size_t r = 0; r < res.receipts.size(); ++r) {
    const auto& rc = res.receipts[r];
    auto where = "receipts[" + std::to_string(r) + "]";
    if (rc.publication_id != h.publication_id)
      return bad(where + ".publication_id", "'" + rc.publication_id + "' != '" + h.publication_id + "'");
    if (rc.model_version != h.model_version)
      return bad(where + ".model_version", std::to_string(rc.model_version));
    if (rc.tp_world_size != h.tp_world_size)
      return bad(where + ".tp_world_size", std::to_string(rc.tp_world_size));
    if (rc.manifest_fingerprint != h.manifest_fingerprint)
      return bad(where + ".manifest_fingerprint", rc.manifest_fingerprint);
    if (rc.tp_rank != r)
      return bad(where + ".tp_rank", std::to_string(rc.tp_rank));
    if (rc.device_uuid != h.device_uuids[r])
      return bad(where + ".device_uuid", "'" + rc.device_uuid + "' != '" + h.device_uuids[r] + "'");
    if (rc.resident_tensor_count == 0)
      return bad(where + ".resident_tensor_count", "worker reports no resident tensors");
  }
  return {};
}

void on_attach(self_ptr self, runtime_proxy_actor proxy, std::uint64_t incarnation) {
  auto& st = self->state;
  if (st.proxy)
    self->demonitor(st.proxy.address());
  st.proxy = proxy;
  st.incarnation = incarnation;
  st.update_open = false;
  st.transfer_initialized = false;
  st.ipc_open = false;
  st.conn = connection_state::inflight;
  self->monitor(proxy);
  // Learn topology and lifecycle; a runtime that lies about itself is poisoned.
  journal::note_send(self, st.opts.journal, proxy, describe_atom::value);
  self->request(proxy, request_timeout(st.opts, st.opts.timeouts_ms.describe), describe_atom::value)
    .then(
      [=](runtime_description& d) {
        auto& st = self->state;
        if (st.incarnation != incarnation || st.conn != connection_state::inflight)
          return;
        if (auto err = check_description(st, d)) {
          mark_broken(self, err, true);
          return;
        }
        st.runtime = d;
        st.conn = connection_state::idle;
        // The first runtime starts from the checkpoint (version 0) and may generate with it;
        // a restarted runtime holds stale weights until a full publication commits.
        if (incarnation > 1 || st.committed_version != d.model_version || !d.weights_valid)
          st.needs_publication = true;
      },
      [=](caf::error& err) {
        auto& st = self->state;
        if (st.incarnation == incarnation && st.conn == connection_state::inflight)
          mark_broken(self, err, needs_poison(err));
      });
}

} // namespace

rollout_engine_actor::behavior_type rollout_engine(self_ptr self, rollout_engine_options opts) {
  self->state.opts = std::move(opts);
  self->set_down_handler([=](const caf::down_msg& msg) {
    auto& st = self->state;
    if (!st.proxy || msg.source != st.proxy.address())
      return;
    st.proxy = nullptr;
    st.conn = connection_state::detached;
    st.needs_publication = true;
    st.update_open = false;
    st.transfer_initialized = false;
    st.ipc_open = false;
    st.runtime.weights_awake = st.runtime.kv_cache_awake = false;
    if (msg.reason)
      st.last_error = render(msg.reason);
  });
  const auto& t = self->state.opts.timeouts_ms;
  return {
    [=](status_atom) { return self->state.status(); },
    [=](describe_atom) -> caf::result<runtime_description> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "describe"))
        return err;
      auto rp = self->make_response_promise<runtime_description>();
      forward<runtime_description>(self, rp, false, t.describe,
        [=](runtime_description& d, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (auto err = check_description(st, d)) {
            mark_broken(self, err, true);
            return (void)rp.deliver(err);
          }
          st.runtime = d;
          rp.deliver(d);
        },
        describe_atom::value);
      return rp;
    },
    [=](generate_atom, generate_request& req) -> caf::result<generate_result> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "generate"))
        return err;
      if (auto err = refuse_generation(st, "generate"))
        return err;
      if (auto err = check_generate_request(req))
        return err;
      auto rp = self->make_response_promise<generate_result>();
      forward<generate_result>(self, rp, false, t.generate,
        [=](generate_result& res, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (auto err = check_generate_result(st, req, res)) {
            mark_broken(self, err, true);
            return (void)rp.deliver(err);
          }
          for (auto& s : res.samples)
            s.model_version = st.committed_version;
          res.model_version = st.committed_version;
          rp.deliver(res);
        },
        generate_atom::value, req);
      return rp;
    },
    [=](score_atom, score_request& req) -> caf::result<score_result> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "score"))
        return err;
      if (auto err = refuse_generation(st, "score"))
        return err;
      if (auto err = check_score_request(req))
        return err;
      auto rp = self->make_response_promise<score_result>();
      forward<score_result>(self, rp, false, t.generate,
        [=](score_result& res, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (auto err = check_score_result(st, req, res)) {
            mark_broken(self, err, true);
            return (void)rp.deliver(err);
          }
          res.model_version = st.committed_version;
          rp.deliver(res);
        },
        score_atom::value, req);
      return rp;
    },
    [=](sleep_atom, std::uint32_t level) -> caf::result<engine_status> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "sleep"))
        return err;
      if (level != 1 && level != 2)
        return make_refit_error(errc::invalid_argument, "sleep.level",
                                "sleep level must be 1 or 2, got " + std::to_string(level));
      if (st.update_open || st.ipc_open)
        return make_refit_error(errc::update_open, "sleep",
                                "cannot sleep while a weight update is open");
      auto rp = self->make_response_promise<engine_status>();
      forward<runtime_description>(self, rp, true, t.sleep,
        [=](runtime_description& d, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (auto err = check_sleep(d, level)) {
            mark_broken(self, err, true);
            return (void)rp.deliver(err);
          }
          st.runtime = d;
          if (level == 2)
            st.needs_publication = true; // weights discarded
          rp.deliver(st.status());
        },
        sleep_atom::value, level);
      return rp;
    },
    [=](wake_atom, wake_tags tags) -> caf::result<engine_status> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "wake_up"))
        return err;
      if (st.update_open)
        return make_refit_error(errc::update_open, "wake_up",
                                "cannot wake while a weight update is open (old weights, KV "
                                "cache and new weights must never coexist)");
      if (!tags.weights && !tags.kv_cache)
        return make_refit_error(errc::invalid_argument, "wake_up.tags",
                                "no tag selected (use weights, kv_cache, or both)");
      auto rp = self->make_response_promise<engine_status>();
      forward<runtime_description>(self, rp, true, t.wake_up,
        [=](runtime_description& d, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (auto err = check_wake(d, tags)) {
            mark_broken(self, err, true);
            return (void)rp.deliver(err);
          }
          st.runtime = d;
          rp.deliver(st.status());
        },
        wake_atom::value, tags);
      return rp;
    },
    [=](reset_pc_atom) -> caf::result<std::uint64_t> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "reset_prefix_cache"))
        return err;
      if (st.update_open)
        return make_refit_error(errc::update_open, "reset_prefix_cache",
                                "the prefix cache is reset by the commit of the open update");
      auto rp = self->make_response_promise<std::uint64_t>();
      forward<std::uint64_t>(self, rp, true, t.reset_prefix_cache,
        [](std::uint64_t& n, decltype(rp)& rp) mutable { rp.deliver(n); }, reset_pc_atom::value);
      return rp;
    },
    [=](init_wt_atom, transfer_init& x) -> caf::result<engine_status> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "init_weight_transfer"))
        return err;
      if (st.update_open || st.ipc_open)
        return make_refit_error(errc::update_open, "init_weight_transfer",
                                "a publication is still open or not released");
      if (!st.runtime.weights_awake)
        return make_refit_error(errc::asleep, "init_weight_transfer",
                                "wake_up(weights) must come before a publication");
      if (x.transport.empty() || x.buffer_bytes == 0 || x.buffer_count == 0)
        return make_refit_error(errc::invalid_argument, "init_weight_transfer",
                                "transport, buffer_bytes and buffer_count are required");
      auto rp = self->make_response_promise<engine_status>();
      forward<std::string>(self, rp, true, t.init_weight_transfer,
        [=](std::string& transport, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (transport != x.transport) {
            auto err = make_refit_error(errc::validation_failed, "init_weight_transfer.transport",
                                        "runtime initialized '" + transport + "', asked for '"
                                          + x.transport + "'");
            mark_broken(self, err, true);
            return (void)rp.deliver(err);
          }
          st.transfer_initialized = true;
          rp.deliver(st.status());
        },
        init_wt_atom::value, x);
      return rp;
    },
    [=](start_upd_atom, publication_header& h) -> caf::result<engine_status> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "start_weight_update"))
        return err;
      if (!st.transfer_initialized)
        return make_refit_error(errc::invalid_state, "start_weight_update",
                                "init_weight_transfer must come first");
      if (st.update_open || st.ipc_open)
        return make_refit_error(errc::update_open, "start_weight_update",
                                "one start/finish pair per publication; '"
                                  + st.header.publication_id + "' is still open");
      if (auto err = check_header(st, h))
        return err;
      auto rp = self->make_response_promise<engine_status>();
      st.header = h;
      st.update_open = true; // from here on every failure poisons
      st.next_chunk = 0;
      forward<std::string>(self, rp, true, t.start_weight_update,
        [=](std::string& id, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (id != h.publication_id) {
            auto err = make_refit_error(errc::validation_failed, "start_weight_update.publication_id",
                                        "runtime started '" + id + "', expected '" + h.publication_id + "'");
            mark_broken(self, err, true);
            return (void)rp.deliver(err);
          }
          rp.deliver(st.status());
        },
        start_upd_atom::value, h);
      return rp;
    },
    [=](update_atom, weight_chunk& chunk) -> caf::result<chunk_ack> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "update_weights"))
        return err;
      caf::error err;
      if (!st.update_open)
        err = make_refit_error(errc::invalid_state, "update_weights", "no weight update is open");
      else if (chunk.publication_id != st.header.publication_id)
        err = make_refit_error(errc::invalid_argument, "update_weights.publication_id",
                               "chunk of '" + chunk.publication_id + "' in publication '"
                                 + st.header.publication_id + "'");
      else if (chunk.chunk_index != st.next_chunk || chunk.is_first != (chunk.chunk_index == 0))
        err = make_refit_error(errc::invalid_argument, "update_weights.chunk_index",
                               "chunk " + std::to_string(chunk.chunk_index) + " arrived, expected "
                                 + std::to_string(st.next_chunk));
      if (err) {
        if (st.update_open)
          mark_broken(self, err, true); // the runtime is mid-update: fail-stop
        return err;
      }
      auto rp = self->make_response_promise<chunk_ack>();
      auto count = chunk.tensors.size();
      auto index = chunk.chunk_index;
      forward<chunk_ack>(self, rp, true, t.update_weights,
        [=](chunk_ack& ack, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (ack.chunk_index != index || ack.tensors_loaded != count) {
            auto err = make_refit_error(errc::validation_failed, "update_weights.ack",
                                        "runtime acknowledged chunk " + std::to_string(ack.chunk_index)
                                          + " with " + std::to_string(ack.tensors_loaded)
                                          + " tensors; sent chunk " + std::to_string(index) + " with "
                                          + std::to_string(count));
            mark_broken(self, err, true);
            return (void)rp.deliver(err);
          }
          ++st.next_chunk;
          rp.deliver(ack);
        },
        update_atom::value, std::move(chunk));
      return rp;
    },
    [=](finish_upd_atom, finish_request& req) -> caf::result<commit_result> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "finish_weight_update"))
        return err;
      if (!st.update_open)
        return make_refit_error(errc::invalid_state, "finish_weight_update", "no weight update is open");
      if (req.publication_id != st.header.publication_id || req.model_version != st.header.model_version) {
        auto err = make_refit_error(errc::invalid_argument, "finish_weight_update",
                                    "finish for '" + req.publication_id + "' v"
                                      + std::to_string(req.model_version) + " but '"
                                      + st.header.publication_id + "' v"
                                      + std::to_string(st.header.model_version) + " is open");
        mark_broken(self, err, true);
        return err;
      }
      auto rp = self->make_response_promise<commit_result>();
      forward<commit_result>(self, rp, true, t.finish_weight_update,
        [=](commit_result& res, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (auto err = check_commit(st, req, res)) {
            mark_broken(self, err, true);
            return (void)rp.deliver(err);
          }
          // The runtime committed; the engine reports the version once the IPC imports are
          // released (a failure before that poisons and leaves the version unchanged).
          st.update_open = false;
          st.ipc_open = true;
          st.runtime.model_version = res.model_version;
          st.runtime.weights_valid = true;
          rp.deliver(res);
        },
        finish_upd_atom::value, req);
      return rp;
    },
    [=](release_atom) -> caf::result<engine_status> {
      auto& st = self->state;
      if (auto err = refuse_unless_connected(st, "release_ipc"))
        return err;
      if (!st.transfer_initialized)
        return make_refit_error(errc::invalid_state, "release_ipc", "no weight transfer to release");
      if (st.update_open)
        return make_refit_error(errc::update_open, "release_ipc",
                                "publication '" + st.header.publication_id
                                  + "' is still open; release_ipc follows finish_weight_update");
      auto rp = self->make_response_promise<engine_status>();
      forward<std::uint32_t>(self, rp, true, t.release_ipc,
        [=](std::uint32_t&, decltype(rp)& rp) mutable {
          auto& st = self->state;
          if (st.ipc_open) { // Committed -> Released: the version is now the engine's
            st.committed_version = st.header.model_version;
            st.needs_publication = false;
          }
          st.ipc_open = false;
          st.transfer_initialized = false;
          rp.deliver(st.status());
        },
        release_atom::value, st.header.publication_id);
      return rp;
    },
    [=](poison_atom, std::string& reason) -> caf::result<engine_status> {
      auto& st = self->state;
      auto err = make_refit_error(errc::poisoned, "runtime", reason);
      if (st.proxy && st.conn != connection_state::detached)
        mark_broken(self, err, true);
      return st.status();
    },
    [=](attach_atom, runtime_proxy_actor proxy, std::uint64_t incarnation) {
      self->state.gave_up = false;
      on_attach(self, std::move(proxy), incarnation);
    },
    [=](gave_up_atom, const std::string& reason) {
      auto& st = self->state;
      st.gave_up = true;
      st.gave_up_reason = reason;
      st.last_error = reason;
    },
  };
}

} // namespace refit
