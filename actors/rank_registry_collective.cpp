// RankRegistry: the rendezvous of the NCCL unique ids of trainer processes on GPUs
// (rank_registry.hpp). Rank 0 creates a communicator's id (ncclGetUniqueId, in its own process)
// and offers it for a publication; every other rank asks for that publication's id and gets
// it as soon as rank 0's offer arrived. The registry only relays strings: it never calls NCCL.
// Waits are bounded by each asker's own request timeout (the collective's deadline); entries
// of old publications are dropped beyond `kept`, their waiters answered with an error.
#include "actors/rank_registry_parts.hpp"

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

namespace refit {

using self_ptr = rank_registry_self;

namespace {

constexpr std::size_t kept = 16;

void prune(rank_registry_state& st) {
  while (st.collective_ids.size() > kept) {
    auto oldest = st.collective_ids.begin();
    for (auto it = st.collective_ids.begin(); it != st.collective_ids.end(); ++it)
      if (it->second.seq < oldest->second.seq)
        oldest = it;
    for (auto& rp : oldest->second.waiting)
      rp.deliver(make_refit_error(errc::invalid_state, "collective_id",
                                  "publication " + oldest->first
                                    + " is too old: rank 0 never offered its communicator id"));
    st.collective_ids.erase(oldest);
  }
}

} // namespace

caf::result<std::string> registry_collective_id(self_ptr self, const std::string& token,
                                                std::uint32_t rank,
                                                const std::string& publication_id,
                                                const std::string& offered) {
  auto& st = self->state;
  if (!registry_token_ok(st, token))
    return registry_refuse(self, errc::unauthorized, "collective_id.token",
                           "wrong or missing shared secret (serve.token / serve.token_env)",
                           "collective_id: wrong token");
  auto member = st.members.find(rank);
  const auto& sender = self->current_sender();
  if (member == st.members.end() || !sender || sender->node() != member->second.host.node())
    return registry_refuse(self, errc::unauthorized, "collective_id",
                           "only the trainer process that joined as rank " + std::to_string(rank)
                             + " may ask for its communicator",
                           "collective_id for rank " + std::to_string(rank)
                             + " from a non-member");
  if (publication_id.empty())
    return make_refit_error(errc::invalid_argument, "collective_id.publication_id", "empty");
  if ((rank == 0) == offered.empty())
    return make_refit_error(errc::invalid_argument, "collective_id.offered",
                            rank == 0 ? "rank 0 must offer the communicator id"
                                      : "only rank 0 offers a communicator id (rank "
                                          + std::to_string(rank) + " offered one)");
  auto [it, fresh] = st.collective_ids.try_emplace(publication_id);
  auto& entry = it->second;
  if (fresh)
    entry.seq = st.next_collective_seq++;
  if (rank == 0) {
    if (!entry.id.empty())
      return make_refit_error(errc::invalid_state, "collective_id",
                              "rank 0 already offered the communicator of publication "
                                + publication_id);
    entry.id = offered;
    for (auto& rp : entry.waiting)
      rp.deliver(entry.id);
    entry.waiting.clear();
    prune(st);
    return offered;
  }
  if (!entry.id.empty())
    return entry.id;
  auto rp = self->make_response_promise<std::string>();
  entry.waiting.push_back(rp);
  prune(st);
  return rp;
}

} // namespace refit
