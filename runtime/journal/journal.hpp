// The actor journal: what the coordinator-side actors (SyncCoordinator, ConsensusGate,
// RolloutEngine) process and produce, in the order they do it, so that refit-replay can re-run
// them on CAF's test_coordinator and check that they behave the same.
//
// A `sink` receives, under one lock:
//   - every message one of those actors processes (inputs from outside: runtime replies, rank
//     reports and replies, timers and request timeouts, DOWN of a runtime proxy, supervisor
//     attach/gave_up, the driver's requests, the worker's verifier result; and the messages
//     they exchange among themselves),
//   - each actor's state after a step when it changed (transitions),
//   - the messages they send to outside actors and their replies to outside requesters,
//   - the non-deterministic values they draw (publication id, clock readings).
// The journaled actors hold the lock for their whole step (runtime/journal_actor.hpp), so the
// journal is one sequence in which each step's outputs follow its input.
//
// Actors see only this header (no protobuf). Zero cost when journaling is off: the actors are
// spawned as plain actors and every hook is a null check of `sink_ptr`.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor_addr.hpp>
#include <caf/actor_cast.hpp>
#include <caf/fwd.hpp>
#include <caf/mailbox_element.hpp>
#include <caf/make_message.hpp>
#include <caf/message.hpp>

namespace refit::journal {

// Mirrors refit.journal.v1.Kind (messages/journal.proto).
enum class kind : std::uint8_t {
  unspecified = 0,
  input_driver = 1,
  input_runtime = 2,
  input_process_exit = 3,
  input_supervisor = 4,
  input_rank_report = 5,
  input_rank_reply = 6,
  input_timer = 7,
  input_worker = 8,
  input_exit = 9,
  internal = 10,
  value = 11,
  output_transition = 12,
  output_send = 13,
  output_reply = 14,
};
constexpr std::uint8_t max_kind = 14;
const char* to_string(kind k);
// A message the actor processed (inputs from outside and internal messages).
bool is_processed(kind k);

// One element of a message or state: type name and bytes (see `encode`).
struct element {
  std::string type;
  std::string data;
  bool operator==(const element& o) const { return type == o.type && data == o.data; }
  bool operator!=(const element& o) const { return !(*this == o); }
};

struct entry {
  std::uint64_t seq = 0;
  kind k = kind::unspecified;
  std::string actor;   // the journaled actor
  std::string type;    // message signature, "state", or the value's name
  std::string peer;    // sender / receiver / requester
  std::uint64_t message_id = 0;
  std::vector<element> elements;
  // Equal in everything but `seq`.
  bool same_as(const entry& o) const;
};

// One line for humans: "seq 12 INPUT_RUNTIME RolloutEngine <- runtime#1 [mid 0x...]: ..."
std::string render(const entry& e);
// The elements rendered as text (undecodable bytes are named, not thrown).
std::string render(const std::vector<element>& xs);

// -------------------------------------------------------------------------------- codec

// What kind of actor handle a journal name stands for (replay creates stand-ins by kind).
enum class handle_kind : std::uint8_t { any, runtime_proxy, trainer_rank };

using name_fn = std::function<std::string(const caf::actor_addr&)>;
using resolve_fn = std::function<caf::strong_actor_ptr(const std::string&, handle_kind)>;

// Encodes every element of `xs`. Actor handles become their journal names (`name_of`); a type
// outside the element table is kept as "?<type>" with its rendering (it cannot be replayed).
std::vector<element> encode(const caf::type_erased_tuple& xs, const name_fn& name_of);
std::vector<element> encode(const caf::message& xs, const name_fn& name_of);
// "'update', weight_chunk": the element types, atoms by their text.
std::string signature(const std::vector<element>& xs);
// Rebuilds a message. Returns the error text ("elements[1] (weight_chunk): ...") on failure.
std::string decode(const std::vector<element>& xs, const resolve_fn& resolve, caf::message& out);
// Whether `type` names an element type of the table.
bool known_element_type(const std::string& type);

// -------------------------------------------------------------------------------- sink

class sink : public std::enable_shared_from_this<sink> {
public:
  enum class role : std::uint8_t { journaled, runtime, rank, other };

  virtual ~sink();

  // Names an actor in the journal ("RolloutEngine", "rank0", "runtime#2", ...).
  void name(const caf::actor_addr& who, const std::string& symbol, role r);

  // -- called by a journaled actor around every message it processes (journal_actor.hpp)
  void begin_step(caf::local_actor* self, caf::mailbox_element& x,
                  const std::function<caf::message()>& state);
  void end_step(caf::local_actor* self, const std::function<caf::message()>& state);
  // Replay: keeps `x` away from the actor until the journal says it is processed.
  virtual bool divert(caf::local_actor* self, caf::mailbox_element_ptr& x);

  // -- hooks in the actors
  void sent(const caf::actor_addr& from, const caf::actor_addr& to, const caf::message& msg);
  // Records `fresh` (recording) or returns the recorded value (replay).
  caf::message value(const caf::actor_addr& from, const char* what, const caf::message& fresh);
  virtual bool replaying() const { return false; }

protected:
  // A finished entry (seq set). Called with the lock held.
  virtual void emit(entry e) = 0;
  // Replay: the recorded value the next entry holds, if it is `what` of `actor`.
  virtual std::optional<std::vector<element>> recorded_value(const std::string& actor,
                                                             const std::string& what);
  std::string name_of(const caf::actor_addr& who); // registry, or a new "actor#k"
  std::string sender_name(const caf::strong_actor_ptr& who);
  role role_of(const std::string& symbol) const;
  kind classify(const std::string& actor, const std::string& sender,
                const caf::mailbox_element& x) const;
  void replied(const std::string& actor, const std::string& requester,
               const caf::mailbox_element& x);

  std::recursive_mutex mtx_;
  std::uint64_t seq_ = 0;

private:
  std::map<caf::actor_addr, std::string> names_;
  std::map<std::string, role> roles_;
  std::uint64_t unnamed_ = 0;
  std::map<std::string, std::vector<element>> states_; // last state per journaled actor
};

using sink_ptr = std::shared_ptr<sink>;

// -------------------------------------------------------------------------------- hooks

// Journals a message `self` sends to the outside actor `to` (call right before the send).
template <class Self, class Handle, class... Ts>
void note_send(Self* self, const sink_ptr& j, const Handle& to, const Ts&... xs) {
  if (j)
    j->sent(self->address(), caf::actor_cast<caf::actor_addr>(to), caf::make_message(xs...));
}

// A non-deterministic value: `fresh` when not journaling or recording, the recorded value in
// replay.
template <class T, class Self>
T draw(Self* self, const sink_ptr& j, const char* what, T fresh) {
  if (!j)
    return fresh;
  auto msg = j->value(self->address(), what, caf::make_message(fresh));
  return msg.template match_elements<T>() ? msg.template get_as<T>(0) : fresh;
}

inline bool replaying(const sink_ptr& j) {
  return j && j->replaying();
}

} // namespace refit::journal
