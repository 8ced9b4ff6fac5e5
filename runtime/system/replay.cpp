#include "runtime/system/replay.hpp"

#include <chrono>
#include <deque>
#include <map>
#include <set>
#include <tuple>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/exit_reason.hpp>
#include <caf/local_actor.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <caf/send.hpp>

#include "runtime/system/bootstrap.hpp"

namespace refit::replay {

namespace {

using journal::entry;
using journal::kind;

using stand_in_ping_atom = caf::atom_constant<caf::atom("standin")>;

// Requests the stand-ins received: (stand-in, requester, id of the awaited response).
using request_log = std::set<std::tuple<std::string, caf::actor_addr, std::uint64_t>>;

// An outside actor in the replay: takes every message, answers nothing (a request stays
// unanswered until the journal delivers the recorded answer) and logs every request.
caf::behavior stand_in(caf::event_based_actor* self, std::shared_ptr<request_log> log,
                       std::string symbol) {
  self->set_default_handler(
    [log, symbol](caf::scheduled_actor* me, caf::message_view&) -> caf::result<caf::message> {
      auto mid = me->current_message_id();
      if (mid.is_request())
        log->emplace(symbol, caf::actor_cast<caf::actor_addr>(me->current_sender()),
                     mid.response_id().integer_value());
      return caf::delegated<caf::message>{};
    });
  return {[](stand_in_ping_atom) {}};
}

class harness final : public journal::sink {
public:
  harness(caf::actor_system& sys, const std::vector<entry>& expected, std::string origin)
    : sys_(sys),
      sched_(dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler())),
      expected_(expected),
      origin_(std::move(origin)) {}

  bool replaying() const override { return true; }

  bool divert(caf::local_actor* self, caf::mailbox_element_ptr& x) override {
    if (passthrough_ || releasing_)
      return false;
    pending_[self->address()].push_back(std::move(x));
    return true;
  }

  void setup(const config::refit_config& cfg) {
    auto self = std::static_pointer_cast<journal::sink>(shared_from_this());
    auto engine = spawn_engine(sys_, cfg, self);
    auto gate = spawn_gate(sys_, self);
    std::vector<trainer_rank_actor> ranks;
    for (std::uint32_t r = 0; r < cfg.runtime.tp_size; ++r) {
      auto h = create("rank" + std::to_string(r), role::rank);
      ranks.push_back(caf::actor_cast<trainer_rank_actor>(h));
    }
    auto pub = spawn_coordinator(sys_, cfg, engine, gate, std::move(ranks), self);
    core_["RolloutEngine"] = caf::actor_cast<caf::strong_actor_ptr>(engine);
    core_["ConsensusGate"] = caf::actor_cast<caf::strong_actor_ptr>(pub.gate);
    core_["SyncCoordinator"] = caf::actor_cast<caf::strong_actor_ptr>(pub.coordinator);
    sched_.run();
  }

  // Walks the journal; returns "" or the divergence.
  std::string walk(std::uint64_t& diverged_seq, std::size_t& tail) {
    std::size_t i = 0;
    while (i < expected_.size()) {
      if (actual_.size() > i) {
        if (!actual_[i].same_as(expected_[i]))
          return diverge(i, diverged_seq, "");
        ++i;
        continue;
      }
      const auto& e = expected_[i];
      if (!journal::is_processed(e.k))
        return diverge(i, diverged_seq, "the replayed actors produced nothing here");
      auto target = core_.at(e.actor);
      auto msg = take_pending(caf::actor_cast<caf::actor_addr>(target), e);
      if (!msg) {
        if (e.k == kind::internal)
          return diverge(i, diverged_seq,
                         "no replayed actor sent this message to " + e.actor);
        msg = rebuild(e, caf::actor_cast<caf::actor_addr>(target));
      }
      releasing_ = true;
      target->enqueue(std::move(msg), nullptr);
      releasing_ = false;
      sched_.run();
      if (actual_.size() <= i)
        return diverge(i, diverged_seq, e.actor + " did not process the message (it has exited)");
    }
    // A journal that ends inside a step (the recording process died while writing it) is
    // checked up to its end; what the last step produced beyond it is only counted.
    tail = actual_.size() - expected_.size();
    return {};
  }

  void teardown() {
    passthrough_ = true;
    pending_.clear();
    for (auto& [name, h] : core_)
      caf::anon_send_exit(h, caf::exit_reason::kill);
    for (auto& [name, h] : stand_ins_)
      caf::anon_send_exit(h, caf::exit_reason::kill);
    sched_.run();
    core_.clear();
    stand_ins_.clear();
  }

protected:
  void emit(entry e) override { actual_.push_back(std::move(e)); }

  std::optional<std::vector<journal::element>> recorded_value(const std::string& actor,
                                                              const std::string& what) override {
    auto i = actual_.size(); // where the value entry lands
    if (i < expected_.size() && expected_[i].k == kind::value && expected_[i].actor == actor
        && expected_[i].type == what)
      return expected_[i].elements;
    return std::nullopt;
  }

private:
  caf::strong_actor_ptr create(const std::string& symbol, role r) {
    auto h = caf::actor_cast<caf::strong_actor_ptr>(sys_.spawn(stand_in, requests_, symbol));
    stand_ins_[symbol] = h;
    name(caf::actor_cast<caf::actor_addr>(h), symbol, r);
    return h;
  }

  caf::strong_actor_ptr resolve(const std::string& symbol, journal::handle_kind k) {
    if (symbol == "none")
      return nullptr;
    if (auto i = core_.find(symbol); i != core_.end())
      return i->second;
    if (auto i = stand_ins_.find(symbol); i != stand_ins_.end())
      return i->second;
    role r = role::other;
    if (k == journal::handle_kind::runtime_proxy || symbol.rfind("runtime#", 0) == 0)
      r = role::runtime;
    else if (k == journal::handle_kind::trainer_rank || symbol.rfind("rank", 0) == 0)
      r = role::rank;
    return create(symbol, r);
  }

  caf::mailbox_element_ptr take_pending(const caf::actor_addr& target, const entry& e) {
    auto& q = pending_[target];
    auto names = [this](const caf::actor_addr& a) { return name_of(a); };
    for (auto it = q.begin(); it != q.end(); ++it) {
      const auto& x = **it;
      if (sender_name(x.sender) != e.peer || x.mid.integer_value() != e.message_id)
        continue;
      if (journal::encode(x.content(), names) != e.elements)
        continue;
      auto out = std::move(*it);
      q.erase(it);
      return out;
    }
    return nullptr;
  }

  [[noreturn]] void malformed(const entry& e, const std::string& field, const std::string& what) {
    throw journal::journal_error(origin_ + ": entry seq " + std::to_string(e.seq) + ": field '"
                                   + field + "': " + what,
                                 0, e.seq, field);
  }

  caf::mailbox_element_ptr rebuild(const entry& e, const caf::actor_addr& target) {
    caf::message content;
    auto resolver = [this](const std::string& s, journal::handle_kind k) { return resolve(s, k); };
    auto err = journal::decode(e.elements, resolver, content);
    if (!err.empty())
      malformed(e, "elements", err);
    // A reply from outside answers a request the actor really sent to that outside actor
    // (an error may answer any request: timeouts, bounced requests).
    caf::message_id mid{e.message_id};
    bool only_error = content.size() == 1 && content.match_element<caf::error>(0);
    if (mid.is_response() && !only_error
        && requests_->count({e.peer, target, e.message_id}) == 0)
      malformed(e, "message_id",
                "a reply from " + e.peer + " to a request " + e.actor
                  + " did not send it in the replay");
    return caf::make_mailbox_element(resolve(e.peer, journal::handle_kind::any),
                                     caf::message_id{e.message_id}, {}, std::move(content));
  }

  std::string diverge(std::size_t i, std::uint64_t& seq, const std::string& why) {
    const auto& e = expected_[i];
    seq = e.seq;
    std::string out = "first difference at seq " + std::to_string(e.seq) + " (entry "
                      + std::to_string(i + 1) + " of " + std::to_string(expected_.size())
                      + ")\n  expected: " + journal::render(e);
    if (i < actual_.size())
      out += "\n  actual:   " + journal::render(actual_[i]);
    else
      out += "\n  actual:   nothing";
    if (!why.empty())
      out += " (" + why + ")";
    return out;
  }

  caf::actor_system& sys_;
  caf::scheduler::test_coordinator& sched_;
  const std::vector<entry>& expected_;
  std::string origin_;
  std::vector<entry> actual_;
  std::map<std::string, caf::strong_actor_ptr> core_;
  std::map<std::string, caf::strong_actor_ptr> stand_ins_;
  std::map<caf::actor_addr, std::deque<caf::mailbox_element_ptr>> pending_;
  std::shared_ptr<request_log> requests_ = std::make_shared<request_log>();
  bool releasing_ = false;
  bool passthrough_ = false;
};

caf::actor_system_config& testing_config(caf::actor_system_config& cfg) {
  configure(cfg);
  cfg.set("scheduler.policy", caf::atom("testing"));
  cfg.set("logger.file-verbosity", caf::atom("quiet"));
  return cfg;
}

} // namespace

result run(const journal::file& j, const std::string& origin) {
  auto t0 = std::chrono::steady_clock::now();
  result res;
  res.entries = j.entries.size();
  for (const auto& e : j.entries) {
    if (journal::is_processed(e.k))
      ++res.inputs;
    else if (e.k == kind::output_transition)
      ++res.transitions;
    else if (e.k == kind::output_send || e.k == kind::output_reply)
      ++res.outputs;
    else if (e.k == kind::value)
      ++res.values;
    if (e.k == kind::output_transition && e.actor == "SyncCoordinator") {
      caf::message m;
      if (journal::decode(e.elements, {}, m).empty() && m.size() >= 1
          && m.match_element<coordinator_status>(0)) {
        res.publications = m.get_as<coordinator_status>(0).publications;
        res.failures = m.get_as<coordinator_status>(0).failures;
      }
    }
  }
  auto cfg = config::parse_yaml(j.header.config_yaml, origin + " (header config)");
  caf::actor_system_config sys_cfg;
  caf::actor_system sys{testing_config(sys_cfg)};
  auto h = std::make_shared<harness>(sys, j.entries, origin);
  try {
    h->setup(cfg);
    res.divergence = h->walk(res.diverged_seq, res.unrecorded_tail);
  } catch (...) {
    h->teardown();
    throw;
  }
  h->teardown();
  res.ok = res.divergence.empty();
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

} // namespace refit::replay
