// Spawning a coordinator-side actor with its messages journaled. The actor keeps its
// function-based behavior; it only runs as `journaled_actor<...>`, which
//   - wraps every processed message in sink::begin_step / end_step (the input, and the state
//     after the step if it changed, under the journal's lock), and
//   - in replay lets the sink hold every incoming message until the journal says the actor
//     processes it.
// `journal_state(const State&)` (found by ADL) says what the state is.
#pragma once

#include <functional>
#include <utility>

#include <caf/actor_config.hpp>
#include <caf/actor_system.hpp>
#include <caf/detail/init_fun_factory.hpp>
#include <caf/infer_handle.hpp>
#include <caf/mailbox_element.hpp>
#include <caf/scheduled_actor.hpp>

#include "runtime/journal/journal.hpp"

namespace refit::journal {

template <class Base>
class journaled_actor final : public Base {
public:
  journaled_actor(caf::actor_config& cfg, sink_ptr j) : Base(cfg), journal_(std::move(j)) {}

  caf::invoke_message_result consume(caf::mailbox_element& x) override {
    std::function<caf::message()> state = [this] { return journal_state(this->state); };
    journal_->begin_step(this, x, state);
    struct end_guard {
      journaled_actor* self;
      std::function<caf::message()>& state;
      ~end_guard() { self->journal_->end_step(self, state); }
    } guard{this, state};
    return Base::consume(x);
  }

  void enqueue(caf::mailbox_element_ptr ptr, caf::execution_unit* eu) override {
    if (journal_->divert(this, ptr))
      return;
    Base::enqueue(std::move(ptr), eu);
  }

  using Base::enqueue;

private:
  sink_ptr journal_;
};

// Spawns `fun(self, xs...)` as usual, or journaled through `j` (named State::name).
template <class F, class... Ts>
caf::infer_handle_from_fun_t<F> spawn(caf::actor_system& sys, const sink_ptr& j, F fun,
                                      Ts&&... xs) {
  if (!j)
    return sys.spawn(fun, std::forward<Ts>(xs)...);
  using impl = caf::infer_impl_from_fun_t<F>;
  caf::actor_config cfg;
  caf::detail::init_fun_factory<impl, F> fac;
  cfg.init_fun = fac(std::move(fun), std::forward<Ts>(xs)...);
  auto h = sys.spawn_class<journaled_actor<impl>, caf::no_spawn_options>(cfg, j);
  using state_type = std::decay_t<decltype(std::declval<impl&>().state)>;
  j->name(caf::actor_cast<caf::actor_addr>(h), state_type::name, sink::role::journaled);
  return h;
}

} // namespace refit::journal
