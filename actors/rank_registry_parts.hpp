// The RankRegistry's behavior is split over three files (rank_registry.cpp: the barrier and
// the publish run; rank_registry_rollout.cpp: a trainer's generate / sleep / wake;
// rank_registry_collective.cpp: the NCCL communicator ids). These are the functions they
// call across files; not part of the actor's interface.
#pragma once

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/rank_registry.hpp"

namespace refit {

using rank_registry_self = rank_registry_impl::stateful_pointer<rank_registry_state>;

// A trainer's generate / sleep / wake (rank_registry_rollout.cpp).
caf::result<generate_result> registry_generate(rank_registry_self self, rollout_generate& req);
caf::result<engine_status> registry_sleep(rank_registry_self self, const rollout_sleep& req);
caf::result<engine_status> registry_wake(rank_registry_self self, const rollout_wake& req);
// A trainer process's NCCL communicator id (rank_registry_collective.cpp).
caf::result<std::string> registry_collective_id(rank_registry_self self, const std::string& token,
                                                std::uint32_t rank,
                                                const std::string& publication_id,
                                                const std::string& offered);
// Counts and logs a refusal, returns its error (rank_registry.cpp).
caf::error registry_refuse(rank_registry_self self, errc code, const std::string& where,
                           const std::string& what, const std::string& log_what);
// The shared secret check of hello / join / status (rank_registry.cpp).
bool registry_token_ok(const rank_registry_state& st, const std::string& given);

} // namespace refit
