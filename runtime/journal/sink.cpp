// The journal sink: names actors, records steps, sends, replies and drawn values under one lock.
#include "runtime/journal/journal.hpp"

#include <cstring>
#include <type_traits>

#include <caf/actor_companion.hpp>
#include <caf/actor_system.hpp>
#include <caf/deep_to_string.hpp>
#include <caf/local_actor.hpp>
#include <caf/make_actor.hpp>
#include <caf/message_builder.hpp>
#include <caf/meta/annotation.hpp>
#include <caf/sec.hpp>
#include <caf/system_messages.hpp>

#include "actors/interfaces.hpp"
#include "messages/errors.hpp"

namespace refit::journal {

sink::~sink() = default;

void sink::name(const caf::actor_addr& who, const std::string& symbol, role r) {
  std::lock_guard<std::recursive_mutex> guard(mtx_);
  names_[who] = symbol;
  roles_[symbol] = r;
}

std::string sink::name_of(const caf::actor_addr& who) {
  if (!who)
    return "none";
  auto i = names_.find(who);
  if (i != names_.end())
    return i->second;
  auto symbol = "actor#" + std::to_string(++unnamed_);
  names_[who] = symbol;
  roles_[symbol] = role::other;
  return symbol;
}

std::string sink::sender_name(const caf::strong_actor_ptr& who) {
  if (!who)
    return "none";
  auto i = names_.find(caf::actor_cast<caf::actor_addr>(who));
  return i != names_.end() ? i->second : "outside";
}

sink::role sink::role_of(const std::string& symbol) const {
  auto i = roles_.find(symbol);
  return i != roles_.end() ? i->second : role::other;
}

kind sink::classify(const std::string& actor, const std::string& sender,
                    const caf::mailbox_element& x) const {
  auto r = role_of(sender);
  if (r == role::journaled && sender != actor)
    return kind::internal;
  const auto& c = x.content();
  if (c.size() == 1 && c.match_element<caf::exit_msg>(0))
    return kind::input_exit;
  if (c.size() == 1 && c.match_element<caf::down_msg>(0))
    return kind::input_process_exit;
  if (sender == actor)
    return kind::input_timer; // delayed self-messages and request timeouts
  if (r == role::rank)
    return x.mid.is_response() ? kind::input_rank_reply : kind::input_rank_report;
  if (r == role::runtime)
    return kind::input_runtime;
  auto first_atom = [&](caf::atom_value a) {
    return c.size() > 0 && c.match_element<caf::atom_value>(0)
           && c.get_as<caf::atom_value>(0) == a;
  };
  if (first_atom(attach_atom::value) && c.size() == 3)
    return kind::input_supervisor;
  if (first_atom(gave_up_atom::value))
    return kind::input_supervisor;
  if (first_atom(done_atom::value) && sender == "none")
    return kind::input_worker;
  if (x.mid.is_response()) // a request bounced by CAF (receiver already gone)
    return actor == "SyncCoordinator" ? kind::input_rank_reply : kind::input_runtime;
  return kind::input_driver;
}

void sink::begin_step(caf::local_actor* self, caf::mailbox_element& x,
                      const std::function<caf::message()>& state) {
  mtx_.lock(); // released by end_step
  auto names = [this](const caf::actor_addr& a) { return name_of(a); };
  auto actor = name_of(self->address());
  if (!states_.count(actor))
    states_[actor] = encode(state(), names);
  entry e;
  e.seq = ++seq_;
  e.actor = actor;
  e.peer = sender_name(x.sender);
  e.k = classify(actor, e.peer, x);
  e.message_id = x.mid.integer_value();
  if (!x.content().empty())
    e.elements = encode(x.content(), names);
  e.type = signature(e.elements);
  emit(std::move(e));
  // A request from outside: the reply goes through a tap that journals it, then on to the
  // requester unchanged (same message id, same sender).
  if (x.mid.is_request() && role_of(sender_name(x.sender)) != role::journaled) {
    caf::actor_config cfg;
    auto& sys = self->home_system();
    auto tap = caf::make_actor<caf::actor_companion, caf::strong_actor_ptr>(
      sys.next_actor_id(), sys.node(), &sys, cfg);
    auto* companion = static_cast<caf::actor_companion*>(caf::actor_cast<caf::abstract_actor*>(tap));
    std::weak_ptr<sink> weak = shared_from_this();
    auto requester = sender_name(x.sender);
    companion->on_enqueue(
      [weak, actor, requester, origin = x.sender](caf::mailbox_element_ptr reply) {
        if (auto j = weak.lock())
          j->replied(actor, requester, *reply);
        if (origin)
          origin->enqueue(std::move(reply), nullptr);
      });
    x.sender = std::move(tap);
  }
}

void sink::end_step(caf::local_actor* self, const std::function<caf::message()>& state) {
  auto names = [this](const caf::actor_addr& a) { return name_of(a); };
  auto actor = name_of(self->address());
  auto now = encode(state(), names);
  auto& last = states_[actor];
  if (now != last) {
    entry e;
    e.seq = ++seq_;
    e.k = kind::output_transition;
    e.actor = actor;
    e.type = "state";
    e.elements = now;
    last = std::move(now);
    emit(std::move(e));
  }
  mtx_.unlock();
}

bool sink::divert(caf::local_actor*, caf::mailbox_element_ptr&) {
  return false;
}

void sink::sent(const caf::actor_addr& from, const caf::actor_addr& to, const caf::message& msg) {
  std::lock_guard<std::recursive_mutex> guard(mtx_);
  auto names = [this](const caf::actor_addr& a) { return name_of(a); };
  entry e;
  e.seq = ++seq_;
  e.k = kind::output_send;
  e.actor = name_of(from);
  e.peer = name_of(to);
  e.elements = encode(msg, names);
  e.type = signature(e.elements);
  emit(std::move(e));
}

void sink::replied(const std::string& actor, const std::string& requester,
                   const caf::mailbox_element& x) {
  std::lock_guard<std::recursive_mutex> guard(mtx_);
  auto names = [this](const caf::actor_addr& a) { return name_of(a); };
  entry e;
  e.seq = ++seq_;
  e.k = kind::output_reply;
  e.actor = actor;
  e.peer = requester;
  e.message_id = x.mid.integer_value();
  if (!x.content().empty())
    e.elements = encode(x.content(), names);
  e.type = signature(e.elements);
  emit(std::move(e));
}

std::optional<std::vector<element>> sink::recorded_value(const std::string&, const std::string&) {
  return std::nullopt;
}

caf::message sink::value(const caf::actor_addr& from, const char* what, const caf::message& fresh) {
  std::lock_guard<std::recursive_mutex> guard(mtx_);
  auto names = [this](const caf::actor_addr& a) { return name_of(a); };
  entry e;
  e.seq = ++seq_;
  e.k = kind::value;
  e.actor = name_of(from);
  e.type = what;
  e.elements = encode(fresh, names);
  caf::message out = fresh;
  if (auto rec = recorded_value(e.actor, e.type)) {
    caf::message m;
    if (decode(*rec, {}, m).empty() && signature(encode(m, names)) == signature(e.elements)) {
      out = m;
      e.elements = std::move(*rec);
    }
  }
  emit(std::move(e));
  return out;
}

} // namespace refit::journal
