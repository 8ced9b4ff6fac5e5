// The CAF type-ID block of the multi-process deployment, appended after refit's own block
// (messages/type_ids.hpp). Register with `cfg.add_message_types<caf::id_block::refit_net>()`
// (runtime/network.cpp: configure_network does it, with the actor handle types that cross
// processes).
#pragma once

#include <caf/atom.hpp>
#include <caf/type_id.hpp>

#include "messages/net_types.hpp"
#include "messages/type_ids.hpp"

CAF_BEGIN_TYPE_ID_BLOCK(refit_net, caf::id_block::refit::end)

  CAF_ADD_ATOM(refit_net, refit, hello_atom, "hello")
  CAF_ADD_ATOM(refit_net, refit, join_atom, "join")
  CAF_ADD_ATOM(refit_net, refit, members_atom, "members")

  CAF_ADD_TYPE_ID(refit_net, (refit::welcome))
  CAF_ADD_TYPE_ID(refit_net, (refit::join_request))
  CAF_ADD_TYPE_ID(refit_net, (refit::join_ack))
  CAF_ADD_TYPE_ID(refit_net, (refit::member_info))
  CAF_ADD_TYPE_ID(refit_net, (refit::membership))
  CAF_ADD_TYPE_ID(refit_net, (refit::publish_request))
  CAF_ADD_TYPE_ID(refit_net, (refit::registry_status))
  CAF_ADD_TYPE_ID(refit_net, (refit::host_status))
  CAF_ADD_TYPE_ID(refit_net, (refit::rollout_generate))
  CAF_ADD_TYPE_ID(refit_net, (refit::rollout_sleep))
  CAF_ADD_TYPE_ID(refit_net, (refit::rollout_wake))

  // Trainer processes on GPUs: the NCCL unique id of a publication's communicator, offered by
  // rank 0 and fetched by the others through the RankRegistry.
  CAF_ADD_ATOM(refit_net, refit, collective_id_atom, "coll_id")

CAF_END_TYPE_ID_BLOCK(refit_net)
