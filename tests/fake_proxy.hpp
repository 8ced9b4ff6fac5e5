// A scripted stand-in for the vLLMRuntimeProxy: a typed actor implementing
// refit::runtime_proxy_actor (plus one test-only message) whose answers come from a
// `fake_script` the test owns. It models the runtime's sleep/wake lifecycle honestly (so the
// RolloutEngine's parent-side validation passes), records every command in order, and lets a
// test fail, hold ("never answer" until released) or tamper with any answer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/interfaces.hpp"
#include "messages/errors.hpp"
#include "messages/types.hpp"

namespace refit_test {

// Test-only: deliver every held answer now (in arrival order).
using release_held_atom = caf::atom_constant<caf::atom("rel_held")>;

using fake_proxy_actor = refit::runtime_proxy_actor::extend<caf::reacts_to<release_held_atom>>;

inline const std::vector<std::string>& fake_device_uuids() {
  static const std::vector<std::string> uuids = {"GPU-11111111-aaaa-0000-0000-000000000000",
                                                 "GPU-22222222-bbbb-0000-0000-000000000001"};
  return uuids;
}

// The honest description of a freshly started runtime: checkpoint weights (version 0) loaded
// and valid, everything awake.
inline refit::runtime_description fresh_description(std::uint32_t tp = 2) {
  refit::runtime_description d;
  d.runtime_kind = "fake";
  d.runtime_version = "0.0-test";
  d.tp_world_size = tp;
  for (std::uint32_t r = 0; r < tp; ++r) {
    refit::worker_info w;
    w.rank = r;
    w.device_index = static_cast<std::int32_t>(r);
    w.device_uuid = fake_device_uuids().at(r);
    w.weight_bytes_resident = 1000;
    w.kv_cache_bytes_resident = 500;
    w.device_free_bytes = 1u << 20;
    w.resident_tensor_count = 10;
    d.workers.push_back(w);
  }
  d.sleep_level = 0;
  d.weights_awake = true;
  d.kv_cache_awake = true;
  d.model_version = 0;
  d.weights_valid = true;
  d.pid = 4242;
  return d;
}

// What the test scripts and observes. Shared between the test and one fake proxy.
struct fake_script {
  std::uint64_t incarnation = 0;        // set by factories that count incarnations
  refit::runtime_description desc = fresh_description(); // the runtime's real state

  // Scripting switches (keyed by command name: describe, generate, sleep, wake_up,
  // init_weight_transfer, start_weight_update, update_weights, finish_weight_update,
  // release_ipc, reset_prefix_cache, shutdown).
  std::map<std::string, caf::error> fail;  // answer this command with this error
  std::map<std::string, caf::error> die;   // answer with this error and quit with it (a crashed
                                           // runtime or a broken channel, as the real proxy does)
  std::set<std::string> hold;              // never answer until release_held_atom
  std::map<std::string, std::size_t> skip; // fail/die/hold apply only after this many occurrences
  bool defer_poison = false;               // log poison, answer + quit only on release

  // Tamper with an answer after the honest state update (to send inconsistent answers).
  std::function<void(refit::runtime_description&)> tamper_describe;
  std::function<void(refit::runtime_description&)> tamper_sleep;
  std::function<void(refit::runtime_description&)> tamper_wake;
  std::function<void(refit::generate_result&)> tamper_generate;
  std::size_t score_extra = 0; // logprobs added to every scored sequence (a wrong answer)
  std::function<void(std::string&)> tamper_init;
  std::function<void(std::string&)> tamper_start;
  std::function<void(refit::chunk_ack&)> tamper_ack;
  std::function<void(refit::commit_result&)> tamper_commit;

  // Observations.
  std::vector<std::string> log;            // every command, in arrival order
  std::vector<std::string> poison_reasons;
  std::vector<refit::generate_request> generate_requests;
  std::vector<std::uint32_t> sleeps;
  std::vector<refit::wake_tags> wakes;
  std::vector<refit::weight_chunk> chunks;
  std::vector<std::string> releases;       // publication ids passed to release_ipc
  refit::publication_header header;        // of the last started update
  std::uint64_t tensors_loaded = 0;        // in the open update
  bool alive = true;                       // false once the actor terminated
  caf::error exit_reason;                  // why it terminated

  std::size_t count(const std::string& cmd) const {
    return static_cast<std::size_t>(std::count(log.begin(), log.end(), cmd));
  }
};

struct fake_proxy_state {
  static inline const char* name = "FakeRuntimeProxy";
  std::shared_ptr<fake_script> script;
  struct held_answer {
    std::function<void()> deliver;
    std::function<void(const caf::error&)> fail;
  };
  std::vector<held_answer> held;
};

using fake_self = fake_proxy_actor::stateful_pointer<fake_proxy_state>;

namespace detail {

inline void fail_held(fake_self self, const caf::error& err);

// Whether the scripted faults of `cmd` apply to its current (just logged) occurrence.
inline bool fake_armed(const fake_script& sc, const std::string& cmd) {
  auto i = sc.skip.find(cmd);
  return i == sc.skip.end() || sc.count(cmd) > i->second;
}

// Logs the command; returns the scripted failure, if any.
inline caf::error fake_begin(fake_self self, const std::string& cmd) {
  auto& sc = *self->state.script;
  sc.log.push_back(cmd);
  if (!fake_armed(sc, cmd))
    return {};
  if (auto d = sc.die.find(cmd); d != sc.die.end()) {
    auto err = d->second;
    fail_held(self, err);
    self->quit(err);
    return err;
  }
  auto i = sc.fail.find(cmd);
  if (i != sc.fail.end())
    return i->second;
  return {};
}

// Answers `value` now, or holds it if the script says so.
template <class T>
caf::result<T> fake_answer(fake_self self, const std::string& cmd, T value) {
  auto& sc = *self->state.script;
  if (sc.hold.count(cmd) == 0 || !fake_armed(sc, cmd))
    return value;
  auto rp = self->make_response_promise<T>();
  self->state.held.push_back({[rp, value]() mutable { rp.deliver(value); },
                              [rp](const caf::error& e) mutable { rp.deliver(e); }});
  return rp;
}

inline void fail_held(fake_self self, const caf::error& err) {
  auto held = std::move(self->state.held);
  self->state.held.clear();
  for (auto& h : held)
    h.fail(err);
}

} // namespace detail

inline fake_proxy_actor::behavior_type fake_proxy(fake_self self,
                                                  std::shared_ptr<fake_script> script) {
  using namespace refit;
  using detail::fake_answer;
  using detail::fake_begin;
  self->state.script = script;
  self->attach_functor([script](const caf::error& reason) {
    script->alive = false;
    script->exit_reason = reason;
  });
  return {
    [=](describe_atom) -> caf::result<runtime_description> {
      if (auto err = fake_begin(self, "describe"))
        return err;
      auto& sc = *self->state.script;
      auto d = sc.desc;
      if (sc.tamper_describe)
        sc.tamper_describe(d);
      return fake_answer(self, "describe", d);
    },
    [=](generate_atom, generate_request& req) -> caf::result<generate_result> {
      if (auto err = fake_begin(self, "generate"))
        return err;
      auto& sc = *self->state.script;
      sc.generate_requests.push_back(req);
      if (!sc.desc.weights_awake || !sc.desc.kv_cache_awake || !sc.desc.weights_valid)
        return make_refit_error(errc::runtime_invalid_state, "generate", "runtime cannot generate");
      generate_result res;
      res.model_version = sc.desc.model_version;
      for (std::size_t i = 0; i < req.prompts.size(); ++i)
        for (std::uint32_t j = 0; j < req.params.n; ++j) {
          sample s;
          s.prompt_index = static_cast<std::uint32_t>(i);
          s.prompt_token_ids = req.prompts[i];
          auto len = std::min<std::uint32_t>(req.params.max_tokens, 3);
          for (std::uint32_t t = 0; t < len; ++t) {
            s.token_ids.push_back(static_cast<std::int32_t>(10 + t + j));
            s.logprobs.push_back(-0.5f);
          }
          s.finish_reason = "length";
          s.model_version = 777; // not the engine's stamp: the engine must overwrite it
          res.samples.push_back(std::move(s));
        }
      if (sc.tamper_generate)
        sc.tamper_generate(res);
      return fake_answer(self, "generate", res);
    },
    [=](score_atom, score_request& req) -> caf::result<score_result> {
      if (auto err = fake_begin(self, "score"))
        return err;
      auto& sc = *self->state.script;
      if (!sc.desc.weights_awake || !sc.desc.kv_cache_awake || !sc.desc.weights_valid)
        return make_refit_error(errc::runtime_invalid_state, "score", "runtime cannot score");
      score_result res;
      res.model_version = sc.desc.model_version;
      for (const auto& seq : req.sequences)
        res.logprobs.emplace_back(seq.size() - req.start + sc.score_extra, -0.25f);
      return fake_answer(self, "score", res);
    },
    [=](sleep_atom, std::uint32_t level) -> caf::result<runtime_description> {
      if (auto err = fake_begin(self, "sleep"))
        return err;
      auto& sc = *self->state.script;
      sc.sleeps.push_back(level);
      auto& d = sc.desc;
      d.sleep_level = level;
      d.weights_awake = false;
      d.kv_cache_awake = false;
      for (auto& w : d.workers) {
        if (level == 1)
          w.weight_bytes_offloaded = w.weight_bytes_resident; // offloaded to host
        else
          w.weight_bytes_offloaded = 0; // discarded
        w.weight_bytes_resident = 0;
        w.kv_cache_bytes_resident = 0;
      }
      if (level >= 2)
        d.weights_valid = false;
      auto out = d;
      if (sc.tamper_sleep)
        sc.tamper_sleep(out);
      return fake_answer(self, "sleep", out);
    },
    [=](wake_atom, wake_tags tags) -> caf::result<runtime_description> {
      if (auto err = fake_begin(self, "wake_up"))
        return err;
      auto& sc = *self->state.script;
      sc.wakes.push_back(tags);
      auto& d = sc.desc;
      if (tags.weights && !d.weights_awake) {
        d.weights_awake = true;
        for (auto& w : d.workers) {
          w.weight_bytes_resident = 1000;
          w.weight_bytes_offloaded = 0;
        }
      }
      if (tags.kv_cache && !d.kv_cache_awake) {
        d.kv_cache_awake = true;
        for (auto& w : d.workers)
          w.kv_cache_bytes_resident = 500;
      }
      if (d.weights_awake && d.kv_cache_awake)
        d.sleep_level = 0;
      auto out = d;
      if (sc.tamper_wake)
        sc.tamper_wake(out);
      return fake_answer(self, "wake_up", out);
    },
    [=](init_wt_atom, transfer_init& x) -> caf::result<std::string> {
      if (auto err = fake_begin(self, "init_weight_transfer"))
        return err;
      auto& sc = *self->state.script;
      auto out = x.transport;
      if (sc.tamper_init)
        sc.tamper_init(out);
      return fake_answer(self, "init_weight_transfer", out);
    },
    [=](start_upd_atom, publication_header& h) -> caf::result<std::string> {
      if (auto err = fake_begin(self, "start_weight_update"))
        return err;
      auto& sc = *self->state.script;
      sc.header = h;
      sc.tensors_loaded = 0;
      auto out = h.publication_id;
      if (sc.tamper_start)
        sc.tamper_start(out);
      return fake_answer(self, "start_weight_update", out);
    },
    [=](update_atom, weight_chunk& chunk) -> caf::result<chunk_ack> {
      if (auto err = fake_begin(self, "update_weights"))
        return err;
      auto& sc = *self->state.script;
      sc.chunks.push_back(chunk);
      sc.tensors_loaded += chunk.tensors.size();
      chunk_ack ack;
      ack.chunk_index = chunk.chunk_index;
      ack.tensors_loaded = chunk.tensors.size();
      if (sc.tamper_ack)
        sc.tamper_ack(ack);
      return fake_answer(self, "update_weights", ack);
    },
    [=](finish_upd_atom, finish_request& req) -> caf::result<commit_result> {
      if (auto err = fake_begin(self, "finish_weight_update"))
        return err;
      auto& sc = *self->state.script;
      const auto& h = sc.header;
      commit_result res;
      res.publication_id = req.publication_id;
      res.model_version = req.model_version;
      res.prefix_cache_reset = true;
      for (std::uint32_t r = 0; r < sc.desc.workers.size(); ++r) {
        receipt rc;
        rc.publication_id = h.publication_id;
        rc.model_version = h.model_version;
        rc.tp_world_size = h.tp_world_size;
        rc.manifest_fingerprint = h.manifest_fingerprint;
        rc.tp_rank = r;
        rc.device_uuid = sc.desc.workers[r].device_uuid;
        rc.resident_tensor_count = sc.tensors_loaded;
        res.receipts.push_back(rc);
      }
      sc.desc.model_version = req.model_version;
      sc.desc.weights_valid = true;
      if (sc.tamper_commit)
        sc.tamper_commit(res);
      return fake_answer(self, "finish_weight_update", res);
    },
    [=](release_atom, std::string& publication_id) -> caf::result<std::uint32_t> {
      if (auto err = fake_begin(self, "release_ipc"))
        return err;
      self->state.script->releases.push_back(publication_id);
      return fake_answer(self, "release_ipc", std::uint32_t{2});
    },
    [=](reset_pc_atom) -> caf::result<std::uint64_t> {
      if (auto err = fake_begin(self, "reset_prefix_cache"))
        return err;
      return fake_answer(self, "reset_prefix_cache", std::uint64_t{7});
    },
    [=](shutdown_atom) -> caf::result<caf::ok_atom> {
      if (auto err = fake_begin(self, "shutdown"))
        return err;
      auto rp = self->make_response_promise<caf::ok_atom>();
      detail::fail_held(self, make_refit_error(errc::shutting_down, "runtime",
                                               "the runtime was shut down"));
      rp.deliver(caf::ok_atom::value);
      self->quit();
      return rp;
    },
    // Like the real proxy: fail what is pending, answer ok, quit with errc::poisoned.
    [=](poison_atom, std::string& reason) -> caf::result<caf::ok_atom> {
      auto& sc = *self->state.script;
      sc.log.push_back("poison");
      sc.poison_reasons.push_back(reason);
      auto err = make_refit_error(errc::poisoned, "runtime", reason);
      auto rp = self->make_response_promise<caf::ok_atom>();
      auto finish = [self, rp, err]() mutable {
        detail::fail_held(self, err);
        rp.deliver(caf::ok_atom::value);
        self->quit(err);
      };
      if (sc.defer_poison)
        self->state.held.push_back(
          {finish, [rp](const caf::error&) mutable { rp.deliver(caf::ok_atom::value); }});
      else
        finish();
      return rp;
    },
    [=](release_held_atom) {
      auto held = std::move(self->state.held);
      self->state.held.clear();
      for (auto& h : held)
        h.deliver();
    },
  };
}

} // namespace refit_test
