// The messages of the multi-process deployment cross processes through CAF's binary
// serialization: every field must survive a round trip (a field missing from `inspect` would
// arrive as its default on the other side), and the type-ID block must register every type.
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/binary_deserializer.hpp>
#include <caf/binary_serializer.hpp>
#include <gtest/gtest.h>

#include "messages/net_type_ids.hpp"
#include "runtime/system/bootstrap.hpp"

namespace {

using namespace refit;

class WireTypes : public ::testing::Test {
protected:
  WireTypes() {
    configure(cfg);
    cfg.add_message_types<caf::id_block::refit_net>();
    sys = std::make_unique<caf::actor_system>(cfg);
  }

  template <class T>
  T round_trip(T x) {
    std::vector<char> buf;
    caf::binary_serializer out{*sys, buf};
    EXPECT_FALSE(out(x));
    T y;
    caf::binary_deserializer in{*sys, buf};
    EXPECT_FALSE(in(y));
    return y;
  }

  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
};

member_info member(std::uint32_t r) {
  return {r, 1000 + static_cast<std::int32_t>(r), "host-" + std::to_string(r), "cpu:" + std::to_string(r),
          "CPU-uuid-" + std::to_string(r), "memfd:" + std::to_string(1000 + r) + ":7"};
}

void expect_same(const member_info& a, const member_info& b) {
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.pid, b.pid);
  EXPECT_EQ(a.hostname, b.hostname);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.device_uuid, b.device_uuid);
  EXPECT_EQ(a.collective_endpoint, b.collective_endpoint);
}

TEST_F(WireTypes, HelloAndJoinSurviveARoundTrip) {
  welcome w{3, 2, 41, "pid 7 on box"};
  auto w2 = round_trip(w);
  EXPECT_EQ(w2.protocol_version, 3u);
  EXPECT_EQ(w2.world, 2u);
  EXPECT_EQ(w2.committed_version, 41u);
  EXPECT_EQ(w2.coordinator, "pid 7 on box");

  join_request j{5, "secret-0123456789", 1, 2, "cpu:1", "CPU-x", std::string(64, 'f'), 4242,
                 "box", "memfd:4242:9"};
  auto j2 = round_trip(j);
  EXPECT_EQ(j2.protocol_version, 5u);
  EXPECT_EQ(j2.token, j.token);
  EXPECT_EQ(j2.rank, 1u);
  EXPECT_EQ(j2.world, 2u);
  EXPECT_EQ(j2.device, "cpu:1");
  EXPECT_EQ(j2.device_uuid, "CPU-x");
  EXPECT_EQ(j2.manifest_fingerprint, j.manifest_fingerprint);
  EXPECT_EQ(j2.pid, 4242);
  EXPECT_EQ(j2.hostname, "box");
  EXPECT_EQ(j2.collective_endpoint, "memfd:4242:9");

  auto a = round_trip(join_ack{1, 2, 9});
  EXPECT_EQ(a.rank, 1u);
  EXPECT_EQ(a.world, 2u);
  EXPECT_EQ(a.committed_version, 9u);
}

TEST_F(WireTypes, MembershipAndPublishSurviveARoundTrip) {
  membership m{12, true, 2, {member(0), member(1)}, "every rank joined"};
  auto m2 = round_trip(m);
  EXPECT_EQ(m2.epoch, 12u);
  EXPECT_TRUE(m2.complete);
  EXPECT_EQ(m2.world, 2u);
  ASSERT_EQ(m2.members.size(), 2u);
  expect_same(m2.members[0], member(0));
  expect_same(m2.members[1], member(1));
  EXPECT_EQ(m2.reason, "every rank joined");

  auto p = round_trip(publish_request{1, 17, 12});
  EXPECT_EQ(p.rank, 1u);
  EXPECT_EQ(p.model_version, 17u);
  EXPECT_EQ(p.epoch, 12u);
}

TEST_F(WireTypes, StatusSurvivesARoundTrip) {
  registry_status s;
  s.world = 2;
  s.epoch = 3;
  s.complete = true;
  s.members = {member(0), member(1)};
  s.committed_version = 8;
  s.publications = 7;
  s.failures = 2;
  s.rank_losses = 1;
  s.refusals = 4;
  s.last_error = "refit.rank_lost at rank 1: ...";
  s.publishing = true;
  s.barrier_version = 9;
  s.waiting_ranks = {0, 1};
  s.coordinator.state = 3;
  s.coordinator.committed_version = 8;
  s.coordinator.transitions = {"Idle", "Initialized"};
  s.engine.connection = 1;
  s.engine.incarnation = 2;
  s.engine.gave_up = true;
  auto s2 = round_trip(s);
  EXPECT_EQ(s2.world, 2u);
  EXPECT_EQ(s2.epoch, 3u);
  EXPECT_TRUE(s2.complete);
  ASSERT_EQ(s2.members.size(), 2u);
  expect_same(s2.members[1], member(1));
  EXPECT_EQ(s2.committed_version, 8u);
  EXPECT_EQ(s2.publications, 7u);
  EXPECT_EQ(s2.failures, 2u);
  EXPECT_EQ(s2.rank_losses, 1u);
  EXPECT_EQ(s2.refusals, 4u);
  EXPECT_EQ(s2.last_error, s.last_error);
  EXPECT_TRUE(s2.publishing);
  EXPECT_EQ(s2.barrier_version, 9u);
  EXPECT_EQ(s2.waiting_ranks, (std::vector<std::uint32_t>{0, 1}));
  EXPECT_EQ(s2.coordinator.state, 3u);
  EXPECT_EQ(s2.coordinator.transitions, s.coordinator.transitions);
  EXPECT_EQ(s2.engine.incarnation, 2u);
  EXPECT_TRUE(s2.engine.gave_up);

  host_status h{1, 2, 3, true, true, "refit.coordinator_lost at ..."};
  auto h2 = round_trip(h);
  EXPECT_EQ(h2.rank, 1u);
  EXPECT_EQ(h2.world, 2u);
  EXPECT_EQ(h2.epoch, 3u);
  EXPECT_TRUE(h2.complete);
  EXPECT_TRUE(h2.coordinator_lost);
  EXPECT_EQ(h2.last_error, h.last_error);
}

TEST_F(WireTypes, RolloutRequestsOfATrainerSurviveARoundTrip) {
  rollout_generate g;
  g.token = "secret-token-0123456789";
  g.rank = 1;
  g.request.prompts = {{1, 2, 3}, {250}};
  g.request.params.n = 3;
  g.request.params.max_tokens = 9;
  g.request.params.temperature = 0.5f;
  g.request.params.top_k = 4;
  g.request.params.top_p = 0.25f;
  g.request.params.seed = 77;
  g.request.params.stop_token_ids = {0, 10};
  g.request.params.max_prompt_length = 12;
  auto g2 = round_trip(g);
  EXPECT_EQ(g2.token, g.token);
  EXPECT_EQ(g2.rank, 1u);
  EXPECT_EQ(g2.request.prompts, g.request.prompts);
  EXPECT_EQ(g2.request.params.n, 3u);
  EXPECT_EQ(g2.request.params.max_tokens, 9u);
  EXPECT_EQ(g2.request.params.temperature, 0.5f);
  EXPECT_EQ(g2.request.params.top_k, 4);
  EXPECT_EQ(g2.request.params.top_p, 0.25f);
  EXPECT_EQ(g2.request.params.seed, 77u);
  EXPECT_EQ(g2.request.params.stop_token_ids, g.request.params.stop_token_ids);
  EXPECT_EQ(g2.request.params.max_prompt_length, 12u);

  rollout_sleep sl{"t", 1, 2};
  auto sl2 = round_trip(sl);
  EXPECT_EQ(sl2.token, "t");
  EXPECT_EQ(sl2.rank, 1u);
  EXPECT_EQ(sl2.level, 2u);
  rollout_wake wk{"t", 1, wake_tags::only_kv_cache()};
  auto wk2 = round_trip(wk);
  EXPECT_EQ(wk2.rank, 1u);
  EXPECT_FALSE(wk2.tags.weights);
  EXPECT_TRUE(wk2.tags.kv_cache);
}

TEST_F(WireTypes, RegisteredWeightFieldsOfTheRankMessagesSurviveARoundTrip) {
  rank_info info;
  info.weight_source = "registered";
  EXPECT_EQ(round_trip(info).weight_source, "registered");
  publication_spec spec;
  spec.tp = 4;
  spec.verify = true;
  auto spec2 = round_trip(spec);
  EXPECT_EQ(spec2.tp, 4u);
  EXPECT_TRUE(spec2.verify);
  rank_report r;
  r.digest_terms = {1, 0xffffffffffffffffull, 42};
  EXPECT_EQ(round_trip(r).digest_terms, r.digest_terms);
}

TEST_F(WireTypes, TheNetworkBlockFollowsRefitsOwnAndNamesEveryType) {
  EXPECT_EQ(caf::id_block::refit_net::begin, caf::id_block::refit::end);
  EXPECT_STREQ(caf::type_name<welcome>::value, "refit::welcome");
  EXPECT_STREQ(caf::type_name<membership>::value, "refit::membership");
  EXPECT_STREQ(caf::type_name<registry_status>::value, "refit::registry_status");
  EXPECT_STREQ(caf::type_name<rollout_generate>::value, "refit::rollout_generate");
  EXPECT_EQ(caf::id_block::refit_net::end - caf::id_block::refit_net::begin, 11);
}

} // namespace
