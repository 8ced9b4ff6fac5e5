// Message types of the multi-process deployment: the join handshake between trainer
// processes and `refit-coordinator serve` (or rank 0's process with serve.embedded), the
// member table every trainer process receives, and the collective publish request. Like
// messages/types.hpp, every type is default-constructible, copyable and fully inspectable:
// they cross processes through CAF's middleman and nothing else is deserialized there.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <caf/meta/type_name.hpp>

#include "messages/types.hpp"

namespace refit {

// The answer to a hello (protocol version and shared secret checked). The gate handle travels
// next to it in the same reply: a trainer rank reports its phases to it.
struct welcome {
  std::uint32_t protocol_version = 0;
  std::uint32_t world = 0;             // trainer ranks the coordinator expects
  std::uint64_t committed_version = 0; // the runtime's committed model version
  std::string coordinator;             // "pid <pid> on <host>" for logs
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, welcome& x) {
  return f(caf::meta::type_name("welcome"), x.protocol_version, x.world, x.committed_version,
           x.coordinator);
}

// What a trainer process presents to join as one rank (the TrainerRank and TrainerHost
// handles travel next to it in the same message).
struct join_request {
  std::uint32_t protocol_version = 0;
  std::string token;                // the shared secret
  std::uint32_t rank = 0;
  std::uint32_t world = 0;
  std::string device;               // "cpu:N"
  std::string device_uuid;
  std::string manifest_fingerprint; // structural manifest of the rank's model config
  std::int32_t pid = 0;
  std::string hostname;
  std::string collective_endpoint;  // "memfd:<pid>:<fd>" of the rank's all-gather endpoint
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, join_request& x) {
  return f(caf::meta::type_name("join_request"), x.protocol_version, x.token, x.rank, x.world,
           x.device, x.device_uuid, x.manifest_fingerprint, x.pid, x.hostname,
           x.collective_endpoint);
}

struct join_ack {
  std::uint32_t rank = 0;
  std::uint32_t world = 0;
  std::uint64_t committed_version = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, join_ack& x) {
  return f(caf::meta::type_name("join_ack"), x.rank, x.world, x.committed_version);
}

// One joined rank as every trainer process sees it: enough to reach its all-gather endpoint.
struct member_info {
  std::uint32_t rank = 0;
  std::int32_t pid = 0;
  std::string hostname;
  std::string device;
  std::string device_uuid;
  std::string collective_endpoint;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, member_info& x) {
  return f(caf::meta::type_name("member_info"), x.rank, x.pid, x.hostname, x.device,
           x.device_uuid, x.collective_endpoint);
}

// The member table the coordinator pushes to every trainer process whenever it changes. A
// publish is possible only in a complete epoch (every rank joined); the epoch number grows each
// time the table becomes complete, so a publish names the membership it was meant for.
struct membership {
  std::uint64_t epoch = 0;
  bool complete = false;
  std::uint32_t world = 0;
  std::vector<member_info> members; // by rank; only the joined ones while incomplete
  std::string reason;               // what changed ("rank 1 joined", "rank 1 left: ...")
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, membership& x) {
  return f(caf::meta::type_name("membership"), x.epoch, x.complete, x.world, x.members,
           x.reason);
}

// One rank's share of a collective publish(model_version).
struct publish_request {
  std::uint32_t rank = 0;
  std::uint64_t model_version = 0;
  std::uint64_t epoch = 0; // the complete membership the rank publishes in
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, publish_request& x) {
  return f(caf::meta::type_name("publish_request"), x.rank, x.model_version, x.epoch);
}

// What the coordinator's RankRegistry reports (token required).
struct registry_status {
  std::uint32_t world = 0;
  std::uint64_t epoch = 0;
  bool complete = false;
  std::vector<member_info> members;
  std::uint64_t committed_version = 0;
  std::uint64_t publications = 0;       // committed through the registry
  std::uint64_t failures = 0;           // failed collective publishes
  std::uint64_t rank_losses = 0;        // members that left (process died, connection lost)
  std::uint64_t refusals = 0;           // refused hello/join/status/publish requests
  std::string last_error;
  bool publishing = false;              // a publication is running
  std::uint64_t barrier_version = 0;    // the version ranks are waiting to publish (0 = none)
  std::vector<std::uint32_t> waiting_ranks;
  coordinator_status coordinator;       // the current epoch's SyncCoordinator (if any)
  engine_status engine;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, registry_status& x) {
  return f(caf::meta::type_name("registry_status"), x.world, x.epoch, x.complete, x.members,
           x.committed_version, x.publications, x.failures, x.rank_losses, x.refusals,
           x.last_error, x.publishing, x.barrier_version, x.waiting_ranks, x.coordinator,
           x.engine);
}

// Rollout requests of a trainer process through the coordinator (token required; refused
// with update_open while a collective publish is open: at its barrier or running).
struct rollout_generate {
  std::string token;
  std::uint32_t rank = 0; // who asks (for the coordinator's log)
  generate_request request;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rollout_generate& x) {
  return f(caf::meta::type_name("rollout_generate"), x.token, x.rank, x.request);
}

struct rollout_sleep {
  std::string token;
  std::uint32_t rank = 0;
  std::uint32_t level = 1; // 1: weights to host memory, KV cache freed; 2: both freed
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rollout_sleep& x) {
  return f(caf::meta::type_name("rollout_sleep"), x.token, x.rank, x.level);
}

struct rollout_wake {
  std::string token;
  std::uint32_t rank = 0;
  wake_tags tags;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rollout_wake& x) {
  return f(caf::meta::type_name("rollout_wake"), x.token, x.rank, x.tags);
}

// What a trainer process's TrainerHost reports (local only).
struct host_status {
  std::uint32_t rank = 0;
  std::uint32_t world = 0;
  std::uint64_t epoch = 0;
  bool complete = false;          // every rank joined
  bool coordinator_lost = false;
  std::string last_error;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, host_status& x) {
  return f(caf::meta::type_name("host_status"), x.rank, x.world, x.epoch, x.complete,
           x.coordinator_lost, x.last_error);
}

} // namespace refit
