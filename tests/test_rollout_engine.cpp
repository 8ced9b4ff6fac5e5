// RolloutEngine on CAF's test_coordinator (no processes, threads or real time): every state
// transition and every refusal, against a scripted fake runtime proxy.
#include "actors/rollout_engine.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "runtime/control/protocol_version.hpp"
#include "tests/actor_fixture.hpp"
#include "tests/fake_proxy.hpp"

namespace {

using namespace refit;
using namespace refit_test;
using std::chrono::milliseconds;

class engine_test : public actor_fixture {
protected:
  static rollout_engine_options options() {
    rollout_engine_options o;
    o.tp_size = 2;
    o.kill_grace_ms = 10;
    auto& t = o.timeouts_ms;
    t.describe = 100;
    t.generate = 200;
    t.sleep = 100;
    t.wake_up = 100;
    t.init_weight_transfer = 100;
    t.start_weight_update = 100;
    t.update_weights = 100;
    t.finish_weight_update = 100;
    t.release_ipc = 100;
    t.reset_prefix_cache = 100;
    t.shutdown = 100;
    t.startup = 100;
    return o;
  }

  // The engine's own backstop timeout for a generate request (see rollout_engine.cpp):
  // command timeout + startup + kill grace + 5 s.
  static milliseconds generate_backstop() {
    return milliseconds(200 + 100 + 10) + std::chrono::seconds(5);
  }

  engine_test() {
    engine = sys.spawn(rollout_engine, options());
    track(engine);
    sched.run();
  }

  // Spawns a fake proxy and attaches it with incarnation `inc`; runs the describe handshake.
  std::shared_ptr<fake_script> attach(std::uint64_t inc = 1,
                                      std::function<void(fake_script&)> prepare = {}) {
    auto sc = std::make_shared<fake_script>();
    sc->incarnation = inc;
    if (prepare)
      prepare(*sc);
    auto p = sys.spawn(fake_proxy, sc);
    track(p);
    proxy = p;
    script = sc;
    caf::anon_send(engine, attach_atom::value, runtime_proxy_actor{p}, inc);
    sched.run();
    return sc;
  }

  engine_status status() {
    auto r = ask<engine_status>(engine, status_atom::value);
    EXPECT_TRUE(r->ok()) << render(r->error);
    return r->value;
  }

  // -- rollout API shortcuts ------------------------------------------------------------

  static generate_request gen_req(std::size_t prompts = 2, std::uint32_t n = 1) {
    generate_request req;
    for (std::size_t i = 0; i < prompts; ++i)
      req.prompts.push_back({1, 2, static_cast<std::int32_t>(3 + i)});
    req.params.n = n;
    req.params.max_tokens = 8;
    req.params.temperature = 0.7f;
    req.params.top_p = 0.9f;
    req.params.top_k = 5;
    req.params.seed = 99;
    return req;
  }

  std::shared_ptr<reply<generate_result>> generate(generate_request req = gen_req()) {
    return ask<generate_result>(engine, generate_atom::value, std::move(req));
  }
  std::shared_ptr<reply<score_result>> score(score_request req) {
    return ask<score_result>(engine, score_atom::value, std::move(req));
  }
  std::shared_ptr<reply<engine_status>> sleep(std::uint32_t level) {
    return ask<engine_status>(engine, sleep_atom::value, level);
  }
  std::shared_ptr<reply<engine_status>> wake(wake_tags tags = wake_tags::all()) {
    return ask<engine_status>(engine, wake_atom::value, tags);
  }
  std::shared_ptr<reply<runtime_description>> describe() {
    return ask<runtime_description>(engine, describe_atom::value);
  }
  std::shared_ptr<reply<engine_status>> init(transfer_init x = tinit()) {
    return ask<engine_status>(engine, init_wt_atom::value, std::move(x));
  }
  std::shared_ptr<reply<engine_status>> start(publication_header h) {
    return ask<engine_status>(engine, start_upd_atom::value, std::move(h));
  }
  std::shared_ptr<reply<chunk_ack>> update(weight_chunk c) {
    return ask<chunk_ack>(engine, update_atom::value, std::move(c));
  }
  std::shared_ptr<reply<commit_result>> finish(finish_request req) {
    return ask<commit_result>(engine, finish_upd_atom::value, std::move(req));
  }
  std::shared_ptr<reply<engine_status>> release() {
    return ask<engine_status>(engine, release_atom::value);
  }
  std::shared_ptr<reply<engine_status>> poison(std::string reason) {
    return ask<engine_status>(engine, poison_atom::value, std::move(reason));
  }
  void release_held() {
    caf::anon_send(proxy, release_held_atom::value);
    sched.run();
  }

  // -- publication helpers --------------------------------------------------------------

  static constexpr std::uint32_t chunk_count = 3;
  static constexpr std::uint32_t tensors_per_chunk = 2;

  static transfer_init tinit() {
    transfer_init x;
    x.transport = "shm";
    x.buffer_bytes = 1 << 20;
    x.buffer_count = 2;
    return x;
  }

  static publication_header header(std::uint64_t version) {
    publication_header h;
    h.protocol_version = wire::protocol_version;
    h.transport = "shm";
    h.publication_id = "pub-v" + std::to_string(version);
    h.model_version = version;
    h.tp_world_size = 2;
    h.manifest_fingerprint =
      "0123456789abcdef0123456789abcdef0123456789abcdef0123456789ABCDEF";
    h.device_uuids = fake_device_uuids();
    h.expected_tensor_count = chunk_count * tensors_per_chunk;
    return h;
  }

  static weight_chunk chunk(const publication_header& h, std::uint32_t index) {
    weight_chunk c;
    c.publication_id = h.publication_id;
    c.chunk_index = index;
    c.is_first = index == 0;
    c.is_last = index + 1 == chunk_count;
    for (std::uint32_t t = 0; t < tensors_per_chunk; ++t) {
      tensor_meta m;
      m.name = "layers." + std::to_string(index) + ".w" + std::to_string(t);
      m.shape = {4, 4};
      m.dtype = 1;
      m.offset = t * 32;
      m.nbytes = 32;
      c.tensors.push_back(m);
    }
    for (std::uint32_t r = 0; r < h.device_uuids.size(); ++r) {
      buffer_handle b;
      b.device_uuid = h.device_uuids[r];
      b.buffer_index = index % 2;
      b.handle = "/refit-shm-" + std::to_string(index % 2);
      b.size = 1 << 20;
      c.handles.push_back(b);
    }
    return c;
  }

  static finish_request fin(const publication_header& h) {
    return finish_request{h.publication_id, h.model_version};
  }

  // init + start, asserting success.
  void open_update(const publication_header& h) {
    auto i = init();
    ASSERT_TRUE(i->ok()) << render(i->error);
    auto s = start(h);
    ASSERT_TRUE(s->ok()) << render(s->error);
    ASSERT_TRUE(s->value.update_open);
  }

  // init + start + all chunks, asserting success.
  void load_all(const publication_header& h) {
    open_update(h);
    for (std::uint32_t k = 0; k < chunk_count; ++k) {
      auto a = update(chunk(h, k));
      ASSERT_TRUE(a->ok()) << render(a->error);
    }
  }

  // A full publication up to and including release.
  void publish(const publication_header& h) {
    load_all(h);
    auto c = finish(fin(h));
    ASSERT_TRUE(c->ok()) << render(c->error);
    auto r = release();
    ASSERT_TRUE(r->ok()) << render(r->error);
  }

  // The runtime was poisoned because of `where` and is gone; the engine is DETACHED.
  void expect_poisoned(const std::string& where) {
    ASSERT_EQ(script->poison_reasons.size(), 1u);
    EXPECT_TRUE(contains(script->poison_reasons[0], "at " + where))
      << script->poison_reasons[0];
    EXPECT_FALSE(script->alive);
    auto s = status();
    EXPECT_EQ(state_of(s), "DETACHED");
    EXPECT_TRUE(s.needs_publication);
    EXPECT_FALSE(s.update_open);
    EXPECT_TRUE(contains(s.last_error, "refit.poisoned at runtime")) << s.last_error;
    EXPECT_TRUE(contains(s.last_error, where)) << s.last_error;
  }

  void expect_not_poisoned() {
    EXPECT_TRUE(script->poison_reasons.empty());
    EXPECT_TRUE(script->alive);
  }

  // A generate request that must be refused before anything reaches the runtime.
  void expect_invalid_generate(generate_request req, const std::string& where) {
    auto r = generate(std::move(req));
    ASSERT_TRUE(r->done);
    EXPECT_REFIT_ERROR(r->error, errc::invalid_argument, where);
    EXPECT_EQ(script->count("generate"), 0u);
    EXPECT_EQ(state_of(status()), "IDLE");
    expect_not_poisoned();
  }

  // A header that must be refused before anything reaches the runtime.
  void expect_bad_header(const publication_header& h, const std::string& where,
                         std::uint64_t valid_version = 1) {
    ASSERT_TRUE(init()->ok());
    auto starts = script->count("start_weight_update");
    auto r = start(h);
    ASSERT_TRUE(r->done);
    EXPECT_REFIT_ERROR(r->error, errc::invalid_argument, where);
    EXPECT_EQ(script->count("start_weight_update"), starts); // nothing reached the runtime
    auto s = status();
    EXPECT_EQ(state_of(s), "IDLE");
    EXPECT_FALSE(s.update_open);
    expect_not_poisoned();
    // The refusal left the transfer usable: a valid header still starts.
    auto ok = start(header(valid_version));
    EXPECT_TRUE(ok->ok()) << render(ok->error);
  }

  // A forged commit answer: validation_failed at `where`, poison, version unchanged.
  void expect_forged_commit(std::function<void(commit_result&)> forge, const std::string& where) {
    attach();
    auto h = header(1);
    load_all(h);
    script->tamper_commit = std::move(forge);
    auto c = finish(fin(h));
    ASSERT_TRUE(c->done);
    EXPECT_REFIT_ERROR(c->error, errc::validation_failed, where);
    expect_poisoned(where);
    EXPECT_EQ(status().committed_version, 0u);
    auto g = generate();
    EXPECT_REFIT_ERROR(g->error, errc::not_attached, "generate");
  }

  rollout_engine_actor engine;
  fake_proxy_actor proxy;
  std::shared_ptr<fake_script> script;
};

// ================================================================ DETACHED

TEST_F(engine_test, StatusIsDetachedBeforeAttach) {
  auto s = status();
  EXPECT_EQ(state_of(s), "DETACHED");
  EXPECT_EQ(s.incarnation, 0u);
  EXPECT_EQ(s.committed_version, 0u);
  EXPECT_FALSE(s.update_open);
}

TEST_F(engine_test, DetachedRefusesGenerate) {
  auto r = generate();
  ASSERT_TRUE(r->done);
  EXPECT_REFIT_ERROR(r->error, errc::not_attached, "generate");
}

TEST_F(engine_test, DetachedRefusesSleep) {
  auto r = sleep(1);
  ASSERT_TRUE(r->done);
  EXPECT_REFIT_ERROR(r->error, errc::not_attached, "sleep");
}

TEST_F(engine_test, DetachedRefusesDescribe) {
  auto r = describe();
  ASSERT_TRUE(r->done);
  EXPECT_REFIT_ERROR(r->error, errc::not_attached, "describe");
}

TEST_F(engine_test, DetachedRefusesWakeAndWeightTransfer) {
  EXPECT_REFIT_ERROR(wake()->error, errc::not_attached, "wake_up");
  EXPECT_REFIT_ERROR(init()->error, errc::not_attached, "init_weight_transfer");
  EXPECT_REFIT_ERROR(start(header(1))->error, errc::not_attached, "start_weight_update");
  EXPECT_REFIT_ERROR(update(chunk(header(1), 0))->error, errc::not_attached, "update_weights");
  EXPECT_REFIT_ERROR(finish(fin(header(1)))->error, errc::not_attached, "finish_weight_update");
  EXPECT_REFIT_ERROR(release()->error, errc::not_attached, "release_ipc");
  EXPECT_REFIT_ERROR(ask<std::uint64_t>(engine, reset_pc_atom::value)->error, errc::not_attached,
                     "reset_prefix_cache");
}

TEST_F(engine_test, PoisonWhileDetachedOnlyReportsStatus) {
  auto r = poison("nothing to poison");
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_EQ(state_of(r->value), "DETACHED");
  EXPECT_EQ(state_of(status()), "DETACHED");
}

// ================================================================ attach / describe

TEST_F(engine_test, AttachDescribesRuntimeAndBecomesIdle) {
  auto sc = attach(1);
  EXPECT_EQ(sc->log, std::vector<std::string>{"describe"});
  auto s = status();
  EXPECT_EQ(state_of(s), "IDLE");
  EXPECT_EQ(s.incarnation, 1u);
  EXPECT_FALSE(s.needs_publication);
  EXPECT_EQ(s.committed_version, 0u);
  EXPECT_EQ(s.sleep_level, 0u);
  EXPECT_TRUE(s.weights_awake);
  EXPECT_TRUE(s.kv_cache_awake);
  EXPECT_TRUE(s.last_error.empty());
}

TEST_F(engine_test, AttachIsInflightUntilDescribeAnswers) {
  attach(1, [](fake_script& sc) { sc.hold.insert("describe"); });
  EXPECT_EQ(state_of(status()), "INFLIGHT");
  EXPECT_REFIT_ERROR(generate()->error, errc::busy, "generate");
  release_held();
  EXPECT_EQ(state_of(status()), "IDLE");
}

TEST_F(engine_test, AttachWithInvalidCheckpointWeightsNeedsPublication) {
  attach(1, [](fake_script& sc) { sc.desc.weights_valid = false; });
  auto s = status();
  EXPECT_EQ(state_of(s), "IDLE");
  EXPECT_TRUE(s.needs_publication);
  EXPECT_REFIT_ERROR(generate()->error, errc::needs_publication, "generate");
}

TEST_F(engine_test, DescribeForwardsAndReturnsTheRuntimeDescription) {
  attach();
  auto d = describe();
  ASSERT_TRUE(d->ok()) << render(d->error);
  EXPECT_EQ(d->value.tp_world_size, 2u);
  ASSERT_EQ(d->value.workers.size(), 2u);
  EXPECT_EQ(d->value.workers[1].device_uuid, fake_device_uuids()[1]);
  EXPECT_EQ(script->log, (std::vector<std::string>{"describe", "describe"}));
  EXPECT_EQ(state_of(status()), "IDLE");
}

TEST_F(engine_test, AttachDescriptionWithTpMismatchIsPoisoned) {
  // With the poison deferred, the BROKEN state between poison and DOWN is observable.
  attach(1, [](fake_script& sc) {
    sc.desc = fresh_description(1);
    sc.defer_poison = true;
  });
  auto s = status();
  EXPECT_EQ(state_of(s), "BROKEN");
  EXPECT_TRUE(contains(s.last_error, "refit.validation_failed at describe.tp_world_size"))
    << s.last_error;
  ASSERT_EQ(script->poison_reasons.size(), 1u);
  EXPECT_REFIT_ERROR(generate()->error, errc::broken, "generate");
  release_held();
  expect_poisoned("describe.tp_world_size");
}

TEST_F(engine_test, AttachDescriptionWithDuplicateUuidsIsPoisoned) {
  attach(1, [](fake_script& sc) {
    sc.tamper_describe = [](runtime_description& d) {
      d.workers[1].device_uuid = d.workers[0].device_uuid;
    };
  });
  expect_poisoned("describe.workers[1].device_uuid");
}

TEST_F(engine_test, AttachDescriptionWithRanksOutOfOrderIsPoisoned) {
  attach(1, [](fake_script& sc) {
    sc.tamper_describe = [](runtime_description& d) { std::swap(d.workers[0], d.workers[1]); };
  });
  expect_poisoned("describe.workers[0].rank");
}

TEST_F(engine_test, AttachDescriptionWithMissingWorkerIsPoisoned) {
  attach(1, [](fake_script& sc) {
    sc.tamper_describe = [](runtime_description& d) { d.workers.pop_back(); };
  });
  expect_poisoned("describe.workers");
}

TEST_F(engine_test, DescribeThatLiesLaterIsPoisoned) {
  attach();
  script->tamper_describe = [](runtime_description& d) { d.workers[1].device_uuid.clear(); };
  auto d = describe();
  ASSERT_TRUE(d->done);
  EXPECT_REFIT_ERROR(d->error, errc::validation_failed, "describe.workers[1].device_uuid");
  expect_poisoned("describe.workers[1].device_uuid");
}

// ================================================================ generate

TEST_F(engine_test, GenerateSucceedsAndStampsCommittedVersion) {
  attach();
  auto req = gen_req(2, 2);
  auto r = generate(req);
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_EQ(r->value.model_version, 0u);
  ASSERT_EQ(r->value.samples.size(), 4u);
  for (const auto& s : r->value.samples) {
    EXPECT_EQ(s.model_version, 0u); // the fake wrote 777; the engine stamps the commit
    EXPECT_EQ(s.token_ids.size(), s.logprobs.size());
  }
  EXPECT_EQ(r->value.samples[0].prompt_index, 0u);
  EXPECT_EQ(r->value.samples[3].prompt_index, 1u);
  ASSERT_EQ(script->generate_requests.size(), 1u);
  EXPECT_EQ(script->generate_requests[0].prompts, req.prompts);
  EXPECT_EQ(script->generate_requests[0].params.top_k, 5);
  EXPECT_EQ(script->generate_requests[0].params.seed, 99u);
  EXPECT_EQ(state_of(status()), "IDLE");
}

TEST_F(engine_test, GenerateWhileAsleepIsRefused) {
  attach();
  ASSERT_TRUE(sleep(1)->ok());
  auto r = generate();
  EXPECT_REFIT_ERROR(r->error, errc::asleep, "generate");
  EXPECT_EQ(script->count("generate"), 0u);
  EXPECT_EQ(state_of(status()), "IDLE");
}

TEST_F(engine_test, GenerateWithOnlyWeightsAwakeIsRefused) {
  attach();
  ASSERT_TRUE(sleep(1)->ok());
  ASSERT_TRUE(wake(wake_tags::only_weights())->ok());
  EXPECT_REFIT_ERROR(generate()->error, errc::asleep, "generate");
  EXPECT_EQ(script->count("generate"), 0u);
}

TEST_F(engine_test, GenerateWhileUpdateOpenIsRefused) {
  attach();
  open_update(header(1));
  auto r = generate();
  EXPECT_REFIT_ERROR(r->error, errc::update_open, "generate");
  EXPECT_EQ(script->count("generate"), 0u);
  expect_not_poisoned();
  EXPECT_TRUE(status().update_open);
}

// Scoring goes through the same refusals as generation; its answer is validated.
TEST_F(engine_test, ScoreIsForwardedRefusedLikeGenerateAndValidated) {
  attach();
  const score_request req{{{1, 2, 3, 4}, {5, 6, 7}}, 2};
  auto ok = score(req);
  ASSERT_TRUE(ok->ok()) << render(ok->error);
  ASSERT_EQ(ok->value.logprobs.size(), 2u);
  EXPECT_EQ(ok->value.logprobs[0].size(), 2u);
  EXPECT_EQ(ok->value.logprobs[1].size(), 1u);
  EXPECT_EQ(script->count("score"), 1u);

  EXPECT_REFIT_ERROR(score({{}, 1})->error, errc::invalid_argument, "score.sequences");
  EXPECT_REFIT_ERROR(score({{{1, 2}}, 0})->error, errc::invalid_argument, "score.start");
  EXPECT_REFIT_ERROR(score({{{1, 2}, {3, 4}}, 2})->error, errc::invalid_argument,
                     "score.sequences[0]");
  EXPECT_EQ(script->count("score"), 1u) << "refused before the runtime";

  ASSERT_TRUE(sleep(1)->ok());
  EXPECT_REFIT_ERROR(score(req)->error, errc::asleep, "score");
  ASSERT_TRUE(wake()->ok());
  open_update(header(1));
  EXPECT_REFIT_ERROR(score(req)->error, errc::update_open, "score");
  EXPECT_EQ(script->count("score"), 1u);
  expect_not_poisoned();
}

TEST_F(engine_test, ScoreResultOfTheWrongLengthIsPoisoned) {
  attach(1, [](fake_script& sc) { sc.score_extra = 1; }); // one logprob too many
  auto r = score({{{1, 2, 3}}, 1});
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "score.sequences[0]");
  expect_poisoned("score.sequences[0]");
}

TEST_F(engine_test, GenerateAfterSleepTwoAndWakeAllNeedsPublication) {
  attach();
  ASSERT_TRUE(sleep(2)->ok());
  auto w = wake();
  ASSERT_TRUE(w->ok()) << render(w->error);
  EXPECT_TRUE(w->value.weights_awake);
  EXPECT_TRUE(w->value.kv_cache_awake);
  EXPECT_REFIT_ERROR(generate()->error, errc::needs_publication, "generate");
  EXPECT_EQ(script->count("generate"), 0u);
}

TEST_F(engine_test, GenerateWithoutPromptsIsInvalid) {
  attach();
  auto req = gen_req();
  req.prompts.clear();
  expect_invalid_generate(req, "generate.prompts");
}

TEST_F(engine_test, GenerateWithEmptyPromptIsInvalid) {
  attach();
  auto req = gen_req(3);
  req.prompts[1].clear();
  expect_invalid_generate(req, "generate.prompts[1]");
}

TEST_F(engine_test, GenerateWithZeroNIsInvalid) {
  attach();
  auto req = gen_req();
  req.params.n = 0;
  expect_invalid_generate(req, "generate.params.n");
}

TEST_F(engine_test, GenerateWithZeroMaxTokensIsInvalid) {
  attach();
  auto req = gen_req();
  req.params.max_tokens = 0;
  expect_invalid_generate(req, "generate.params.max_tokens");
}

TEST_F(engine_test, GenerateWithNegativeTemperatureIsInvalid) {
  attach();
  auto req = gen_req();
  req.params.temperature = -0.1f;
  expect_invalid_generate(req, "generate.params.temperature");
}

TEST_F(engine_test, GenerateWithNanTemperatureIsInvalid) {
  attach();
  auto req = gen_req();
  req.params.temperature = std::numeric_limits<float>::quiet_NaN();
  expect_invalid_generate(req, "generate.params.temperature");
}

TEST_F(engine_test, GenerateWithTopPZeroIsInvalid) {
  attach();
  auto req = gen_req();
  req.params.top_p = 0.0f;
  expect_invalid_generate(req, "generate.params.top_p");
}

TEST_F(engine_test, GenerateWithTopPAboveOneIsInvalid) {
  attach();
  auto req = gen_req();
  req.params.top_p = 1.5f;
  expect_invalid_generate(req, "generate.params.top_p");
}

TEST_F(engine_test, GenerateWithNegativeTopKIsInvalid) {
  attach();
  auto req = gen_req();
  req.params.top_k = -1;
  expect_invalid_generate(req, "generate.params.top_k");
}

TEST_F(engine_test, GenerateBoundaryParametersAreValid) {
  attach();
  auto req = gen_req(1);
  req.params.temperature = 0.0f; // greedy
  req.params.top_p = 1.0f;
  req.params.top_k = 0; // disabled
  auto r = generate(req);
  EXPECT_TRUE(r->ok()) << render(r->error);
}

TEST_F(engine_test, GenerateResultWithWrongModelVersionBreaksThenDetaches) {
  attach(1, [](fake_script& sc) {
    sc.defer_poison = true;
    sc.tamper_generate = [](generate_result& r) { r.model_version = 5; };
  });
  auto r = generate();
  ASSERT_TRUE(r->done);
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "generate.model_version");
  // BROKEN while the proxy kills its runtime...
  auto s = status();
  EXPECT_EQ(state_of(s), "BROKEN");
  EXPECT_TRUE(s.needs_publication);
  EXPECT_EQ(script->poison_reasons.size(), 1u);
  EXPECT_REFIT_ERROR(generate()->error, errc::broken, "generate");
  EXPECT_REFIT_ERROR(sleep(1)->error, errc::broken, "sleep");
  // ... DETACHED once it is gone.
  release_held();
  expect_poisoned("generate.model_version");
}

TEST_F(engine_test, GenerateResultWithWrongSampleCountIsPoisoned) {
  attach(1, [](fake_script& sc) {
    sc.tamper_generate = [](generate_result& r) { r.samples.pop_back(); };
  });
  auto r = generate(gen_req(2, 2));
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "generate.samples");
  expect_poisoned("generate.samples");
}

TEST_F(engine_test, GenerateResultWithLogprobsLengthMismatchIsPoisoned) {
  attach(1, [](fake_script& sc) {
    sc.tamper_generate = [](generate_result& r) { r.samples[1].logprobs.pop_back(); };
  });
  auto r = generate();
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "generate.samples[1].logprobs");
  expect_poisoned("generate.samples[1].logprobs");
}

TEST_F(engine_test, GenerateResultWithPromptIndexOutOfRangeIsPoisoned) {
  attach(1, [](fake_script& sc) {
    sc.tamper_generate = [](generate_result& r) { r.samples[0].prompt_index = 2; };
  });
  auto r = generate();
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "generate.samples[0].prompt_index");
  expect_poisoned("generate.samples[0].prompt_index");
}

TEST_F(engine_test, GenerateResultWithTooManyTokensIsPoisoned) {
  attach(1, [](fake_script& sc) {
    sc.tamper_generate = [](generate_result& r) {
      r.samples[0].token_ids.assign(9, 1);
      r.samples[0].logprobs.assign(9, -1.0f);
    };
  });
  auto r = generate(); // max_tokens 8
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "generate.samples[0].token_ids");
  expect_poisoned("generate.samples[0].token_ids");
}

TEST_F(engine_test, SecondRequestWhileOneIsInFlightIsBusy) {
  attach(1, [](fake_script& sc) { sc.hold.insert("generate"); });
  auto first = generate();
  EXPECT_FALSE(first->done);
  EXPECT_EQ(state_of(status()), "INFLIGHT");
  EXPECT_REFIT_ERROR(generate()->error, errc::busy, "generate");
  EXPECT_REFIT_ERROR(sleep(1)->error, errc::busy, "sleep");
  EXPECT_REFIT_ERROR(describe()->error, errc::busy, "describe");
  EXPECT_EQ(script->count("generate"), 1u);
  // The held answer completes the first request; the engine is IDLE again.
  release_held();
  ASSERT_TRUE(first->ok()) << render(first->error);
  EXPECT_EQ(first->value.samples.size(), 2u);
  EXPECT_EQ(state_of(status()), "IDLE");
  expect_not_poisoned();
}

TEST_F(engine_test, GenerateRuntimeRefusalKeepsTheConnection) {
  attach();
  script->fail["generate"] =
    make_refit_error(errc::runtime_invalid_argument, "generate", "prompt too long");
  auto r = generate();
  EXPECT_REFIT_ERROR(r->error, errc::runtime_invalid_argument, "generate");
  EXPECT_EQ(state_of(status()), "IDLE");
  expect_not_poisoned();
  script->fail.clear();
  EXPECT_TRUE(generate()->ok());
}

TEST_F(engine_test, GenerateChannelFailureBreaksWithoutPoisoning) {
  attach();
  auto failure = make_refit_error(errc::runtime_timeout, "generate", "no answer in 200 ms");
  script->fail["generate"] = failure;
  auto r = generate();
  EXPECT_REFIT_ERROR(r->error, errc::runtime_timeout, "generate");
  auto s = status();
  EXPECT_EQ(state_of(s), "BROKEN");
  EXPECT_TRUE(s.needs_publication);
  EXPECT_EQ(s.last_error, render(failure));
  expect_not_poisoned(); // the proxy is already going away by itself
  send_exit(proxy, failure);
  sched.run();
  s = status();
  EXPECT_EQ(state_of(s), "DETACHED");
  EXPECT_EQ(s.last_error, render(failure));
}

TEST_F(engine_test, EngineSideRequestTimeoutBreaksAndPoisons) {
  attach(1, [](fake_script& sc) { sc.hold.insert("generate"); });
  auto r = generate();
  advance(generate_backstop() - milliseconds(1));
  EXPECT_FALSE(r->done);
  EXPECT_EQ(state_of(status()), "INFLIGHT");
  script->defer_poison = true;
  advance(milliseconds(1));
  ASSERT_TRUE(r->done);
  EXPECT_EQ(r->error, caf::sec::request_timeout) << render(r->error);
  auto s = status();
  EXPECT_EQ(state_of(s), "BROKEN");
  EXPECT_TRUE(s.needs_publication);
  // An unresponsive proxy never dies by itself: the engine must poison it, or no DOWN (and
  // no restart by the supervisor) ever follows.
  EXPECT_EQ(script->poison_reasons.size(), 1u);
}

// ================================================================ sleep / wake

TEST_F(engine_test, SleepLevelZeroIsInvalid) {
  attach();
  EXPECT_REFIT_ERROR(sleep(0)->error, errc::invalid_argument, "sleep.level");
  EXPECT_EQ(script->count("sleep"), 0u);
  EXPECT_EQ(state_of(status()), "IDLE");
}

TEST_F(engine_test, SleepLevelThreeIsInvalid) {
  attach();
  EXPECT_REFIT_ERROR(sleep(3)->error, errc::invalid_argument, "sleep.level");
  EXPECT_EQ(script->count("sleep"), 0u);
  EXPECT_EQ(state_of(status()), "IDLE");
}

TEST_F(engine_test, SleepOneUpdatesStatusAndKeepsWeights) {
  attach();
  auto r = sleep(1);
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_EQ(state_of(r->value), "IDLE");
  EXPECT_EQ(r->value.sleep_level, 1u);
  EXPECT_FALSE(r->value.weights_awake);
  EXPECT_FALSE(r->value.kv_cache_awake);
  EXPECT_FALSE(r->value.needs_publication);
  EXPECT_EQ(script->sleeps, std::vector<std::uint32_t>{1});
  auto s = status();
  EXPECT_EQ(s.sleep_level, 1u);
  EXPECT_FALSE(s.weights_awake);
}

TEST_F(engine_test, SleepTwoDiscardsWeights) {
  attach();
  auto r = sleep(2);
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_EQ(r->value.sleep_level, 2u);
  EXPECT_TRUE(r->value.needs_publication);
  EXPECT_EQ(r->value.committed_version, 0u);
}

TEST_F(engine_test, SleepErrorFromRuntimeBreaksAndPoisons) {
  attach(1, [](fake_script& sc) { sc.defer_poison = true; });
  script->fail["sleep"] = make_refit_error(errc::runtime_internal, "sleep", "cuMemUnmap failed");
  auto r = sleep(1);
  EXPECT_REFIT_ERROR(r->error, errc::runtime_internal, "sleep");
  auto s = status();
  EXPECT_EQ(state_of(s), "BROKEN");
  EXPECT_TRUE(contains(s.last_error, "cuMemUnmap failed")) << s.last_error;
  EXPECT_EQ(script->poison_reasons.size(), 1u);
  release_held();
  expect_poisoned("sleep");
}

TEST_F(engine_test, InconsistentSleepAnswerIsPoisoned) {
  attach();
  script->tamper_sleep = [](runtime_description& d) { d.kv_cache_awake = true; };
  auto r = sleep(1);
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "sleep");
  expect_poisoned("sleep");
}

TEST_F(engine_test, SleepTwoThatKeepsWeightsValidIsPoisoned) {
  attach();
  script->tamper_sleep = [](runtime_description& d) { d.weights_valid = true; };
  auto r = sleep(2);
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "sleep");
  expect_poisoned("sleep");
}

TEST_F(engine_test, SleepAnswerWithWrongLevelIsPoisoned) {
  attach();
  script->tamper_sleep = [](runtime_description& d) { d.sleep_level = 1; };
  auto r = sleep(2);
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "sleep");
  expect_poisoned("sleep");
}

TEST_F(engine_test, SleepWhileUpdateOpenIsRefused) {
  attach();
  open_update(header(1));
  EXPECT_REFIT_ERROR(sleep(2)->error, errc::update_open, "sleep");
  EXPECT_EQ(script->count("sleep"), 0u);
  expect_not_poisoned();
}

TEST_F(engine_test, WakeWithoutTagsIsInvalid) {
  attach();
  ASSERT_TRUE(sleep(1)->ok());
  EXPECT_REFIT_ERROR(wake(wake_tags{false, false})->error, errc::invalid_argument, "wake_up.tags");
  EXPECT_EQ(script->count("wake_up"), 0u);
  EXPECT_EQ(state_of(status()), "IDLE");
}

TEST_F(engine_test, WakeThatDoesNotWakeIsPoisoned) {
  attach();
  ASSERT_TRUE(sleep(1)->ok());
  script->tamper_wake = [](runtime_description& d) { d.kv_cache_awake = false; };
  auto r = wake();
  EXPECT_REFIT_ERROR(r->error, errc::validation_failed, "wake_up");
  expect_poisoned("wake_up");
}

TEST_F(engine_test, WakeErrorFromRuntimeBreaksAndPoisons) {
  attach();
  ASSERT_TRUE(sleep(1)->ok());
  script->fail["wake_up"] = make_refit_error(errc::runtime_internal, "wake_up", "oom");
  auto r = wake();
  EXPECT_REFIT_ERROR(r->error, errc::runtime_internal, "wake_up");
  expect_poisoned("wake_up");
}

TEST_F(engine_test, WakeOnlyWeightsReportsKvCacheAsleep) {
  attach();
  ASSERT_TRUE(sleep(2)->ok());
  auto r = wake(wake_tags::only_weights());
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_TRUE(r->value.weights_awake);
  EXPECT_FALSE(r->value.kv_cache_awake);
  EXPECT_TRUE(r->value.needs_publication);
  ASSERT_EQ(script->wakes.size(), 1u);
  EXPECT_TRUE(script->wakes[0].weights);
  EXPECT_FALSE(script->wakes[0].kv_cache);
}

TEST_F(engine_test, BootstrapLifecycleSleepOneWakeAllGenerates) {
  attach();
  ASSERT_TRUE(sleep(1)->ok());
  auto w = wake();
  ASSERT_TRUE(w->ok()) << render(w->error);
  EXPECT_EQ(w->value.sleep_level, 0u);
  EXPECT_FALSE(w->value.needs_publication);
  auto g = generate();
  ASSERT_TRUE(g->ok()) << render(g->error);
  EXPECT_EQ(g->value.model_version, 0u);
  EXPECT_EQ(script->log,
            (std::vector<std::string>{"describe", "sleep", "wake_up", "generate"}));
}

TEST_F(engine_test, SteadyStateLifecyclePublishesAndGeneratesWithNewVersion) {
  attach();
  ASSERT_TRUE(generate()->ok()); // first rollout with the checkpoint
  auto s2 = sleep(2);
  ASSERT_TRUE(s2->ok());
  EXPECT_TRUE(s2->value.needs_publication);
  auto ww = wake(wake_tags::only_weights());
  ASSERT_TRUE(ww->ok());
  EXPECT_TRUE(ww->value.weights_awake);
  EXPECT_FALSE(ww->value.kv_cache_awake);
  auto h = header(1);
  auto i = init();
  ASSERT_TRUE(i->ok()) << render(i->error);
  auto st = start(h);
  ASSERT_TRUE(st->ok()) << render(st->error);
  EXPECT_TRUE(st->value.update_open);
  for (std::uint32_t k = 0; k < chunk_count; ++k) {
    auto a = update(chunk(h, k));
    ASSERT_TRUE(a->ok()) << render(a->error);
    EXPECT_EQ(a->value.chunk_index, k);
    EXPECT_EQ(a->value.tensors_loaded, tensors_per_chunk);
  }
  auto c = finish(fin(h));
  ASSERT_TRUE(c->ok()) << render(c->error);
  EXPECT_EQ(c->value.model_version, 1u);
  EXPECT_EQ(c->value.receipts.size(), 2u);
  auto rel = release();
  ASSERT_TRUE(rel->ok()) << render(rel->error);
  EXPECT_EQ(state_of(rel->value), "IDLE");
  EXPECT_EQ(rel->value.committed_version, 1u);
  EXPECT_FALSE(rel->value.needs_publication);
  EXPECT_FALSE(rel->value.update_open);
  EXPECT_REFIT_ERROR(generate()->error, errc::asleep, "generate"); // KV cache still asleep
  auto wk = wake(wake_tags::only_kv_cache());
  ASSERT_TRUE(wk->ok()) << render(wk->error);
  EXPECT_TRUE(wk->value.kv_cache_awake);
  auto g = generate(gen_req(2, 2));
  ASSERT_TRUE(g->ok()) << render(g->error);
  EXPECT_EQ(g->value.model_version, 1u);
  for (const auto& s : g->value.samples)
    EXPECT_EQ(s.model_version, 1u);
  EXPECT_EQ(script->log,
            (std::vector<std::string>{"describe", "generate", "sleep", "wake_up",
                                      "init_weight_transfer", "start_weight_update",
                                      "update_weights", "update_weights", "update_weights",
                                      "finish_weight_update", "release_ipc", "wake_up",
                                      "generate"}));
  EXPECT_EQ(script->releases, std::vector<std::string>{"pub-v1"});
  expect_not_poisoned();
}

TEST_F(engine_test, ResetPrefixCacheForwardsTheRuntimeAnswer) {
  attach();
  auto r = ask<std::uint64_t>(engine, reset_pc_atom::value);
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_EQ(r->value, 7u);
  EXPECT_EQ(state_of(status()), "IDLE");
}

TEST_F(engine_test, ResetPrefixCacheFailureBreaksAndPoisons) {
  attach();
  script->fail["reset_prefix_cache"] =
    make_refit_error(errc::runtime_internal, "reset_prefix_cache", "boom");
  auto r = ask<std::uint64_t>(engine, reset_pc_atom::value);
  EXPECT_REFIT_ERROR(r->error, errc::runtime_internal, "reset_prefix_cache");
  expect_poisoned("reset_prefix_cache");
}

// ================================================================ weight transfer: init/start

TEST_F(engine_test, InitBeforeWeightsAreAwakeIsRefused) {
  attach();
  ASSERT_TRUE(sleep(2)->ok());
  EXPECT_REFIT_ERROR(init()->error, errc::asleep, "init_weight_transfer");
  EXPECT_EQ(script->count("init_weight_transfer"), 0u);
}

TEST_F(engine_test, InitWithoutTransportOrBuffersIsInvalid) {
  attach();
  auto x = tinit();
  x.buffer_count = 0;
  EXPECT_REFIT_ERROR(init(x)->error, errc::invalid_argument, "init_weight_transfer");
  x = tinit();
  x.transport.clear();
  EXPECT_REFIT_ERROR(init(x)->error, errc::invalid_argument, "init_weight_transfer");
  EXPECT_EQ(script->count("init_weight_transfer"), 0u);
  expect_not_poisoned();
}

TEST_F(engine_test, InitAnswerWithOtherTransportIsPoisoned) {
  attach();
  script->tamper_init = [](std::string& t) { t = "cuda_ipc"; };
  EXPECT_REFIT_ERROR(init()->error, errc::validation_failed, "init_weight_transfer.transport");
  expect_poisoned("init_weight_transfer.transport");
}

TEST_F(engine_test, InitWhileUpdateOpenIsRefused) {
  attach();
  open_update(header(1));
  EXPECT_REFIT_ERROR(init()->error, errc::update_open, "init_weight_transfer");
  EXPECT_EQ(script->count("init_weight_transfer"), 1u);
  expect_not_poisoned();
}

TEST_F(engine_test, StartBeforeInitIsInvalidState) {
  attach();
  EXPECT_REFIT_ERROR(start(header(1))->error, errc::invalid_state, "start_weight_update");
  EXPECT_EQ(script->count("start_weight_update"), 0u);
  EXPECT_FALSE(status().update_open);
  expect_not_poisoned();
}

TEST_F(engine_test, HeaderWithWrongProtocolVersionIsRefused) {
  attach();
  auto h = header(1);
  h.protocol_version = wire::protocol_version + 1;
  expect_bad_header(h, "header.protocol_version");
}

TEST_F(engine_test, HeaderWithEmptyPublicationIdIsRefused) {
  attach();
  auto h = header(1);
  h.publication_id.clear();
  expect_bad_header(h, "header.publication_id");
}

TEST_F(engine_test, HeaderWithVersionNotAboveCommittedIsRefused) {
  attach();
  expect_bad_header(header(0), "header.model_version");
}

TEST_F(engine_test, HeaderWithTpMismatchIsRefused) {
  attach();
  auto h = header(1);
  h.tp_world_size = 1;
  h.device_uuids.pop_back();
  expect_bad_header(h, "header.tp_world_size");
}

TEST_F(engine_test, HeaderWithSwappedUuidOrderIsRefused) {
  attach();
  auto h = header(1);
  std::swap(h.device_uuids[0], h.device_uuids[1]);
  expect_bad_header(h, "header.device_uuids[0]");
}

TEST_F(engine_test, HeaderWithWrongUuidCountIsRefused) {
  attach();
  auto h = header(1);
  h.device_uuids.push_back("GPU-33333333");
  expect_bad_header(h, "header.device_uuids");
}

TEST_F(engine_test, HeaderWithShortFingerprintIsRefused) {
  attach();
  auto h = header(1);
  h.manifest_fingerprint = "abc123";
  expect_bad_header(h, "header.manifest_fingerprint");
}

TEST_F(engine_test, HeaderWithNonHexFingerprintIsRefused) {
  attach();
  auto h = header(1);
  h.manifest_fingerprint[10] = 'g';
  expect_bad_header(h, "header.manifest_fingerprint");
}

TEST_F(engine_test, SecondStartWhileOpenIsRefused) {
  attach();
  open_update(header(1));
  auto h2 = header(2);
  EXPECT_REFIT_ERROR(start(h2)->error, errc::update_open, "start_weight_update");
  EXPECT_EQ(script->count("start_weight_update"), 1u);
  EXPECT_EQ(script->header.publication_id, "pub-v1");
  auto s = status();
  EXPECT_TRUE(s.update_open);
  EXPECT_EQ(state_of(s), "IDLE");
  expect_not_poisoned();
}

TEST_F(engine_test, StartAnswerForOtherPublicationIsPoisoned) {
  attach();
  ASSERT_TRUE(init()->ok());
  script->tamper_start = [](std::string& id) { id = "pub-other"; };
  EXPECT_REFIT_ERROR(start(header(1))->error, errc::validation_failed,
                     "start_weight_update.publication_id");
  expect_poisoned("start_weight_update.publication_id");
}

TEST_F(engine_test, StartErrorFromRuntimeIsPoisoned) {
  attach();
  ASSERT_TRUE(init()->ok());
  script->fail["start_weight_update"] =
    make_refit_error(errc::runtime_invalid_state, "start_weight_update", "no transfer engine");
  EXPECT_REFIT_ERROR(start(header(1))->error, errc::runtime_invalid_state, "start_weight_update");
  expect_poisoned("start_weight_update");
}

// ================================================================ weight transfer: chunks

TEST_F(engine_test, UpdateWithoutOpenUpdateIsInvalidState) {
  attach();
  EXPECT_REFIT_ERROR(update(chunk(header(1), 0))->error, errc::invalid_state, "update_weights");
  EXPECT_EQ(script->count("update_weights"), 0u);
  EXPECT_EQ(state_of(status()), "IDLE");
  expect_not_poisoned();
}

TEST_F(engine_test, UpdateWithWrongPublicationIdPoisons) {
  attach();
  auto h = header(1);
  open_update(h);
  auto c = chunk(h, 0);
  c.publication_id = "pub-other";
  EXPECT_REFIT_ERROR(update(c)->error, errc::invalid_argument, "update_weights.publication_id");
  EXPECT_EQ(script->count("update_weights"), 0u);
  expect_poisoned("update_weights.publication_id");
}

TEST_F(engine_test, UpdateWithOutOfOrderChunkPoisons) {
  attach();
  auto h = header(1);
  open_update(h);
  ASSERT_TRUE(update(chunk(h, 0))->ok());
  EXPECT_REFIT_ERROR(update(chunk(h, 2))->error, errc::invalid_argument,
                     "update_weights.chunk_index");
  EXPECT_EQ(script->count("update_weights"), 1u);
  expect_poisoned("update_weights.chunk_index");
}

TEST_F(engine_test, UpdateWithRepeatedChunkPoisons) {
  attach();
  auto h = header(1);
  open_update(h);
  ASSERT_TRUE(update(chunk(h, 0))->ok());
  EXPECT_REFIT_ERROR(update(chunk(h, 0))->error, errc::invalid_argument,
                     "update_weights.chunk_index");
  expect_poisoned("update_weights.chunk_index");
}

TEST_F(engine_test, UpdateWithFirstFlagOnLaterChunkPoisons) {
  attach();
  auto h = header(1);
  open_update(h);
  ASSERT_TRUE(update(chunk(h, 0))->ok());
  auto c = chunk(h, 1);
  c.is_first = true;
  EXPECT_REFIT_ERROR(update(c)->error, errc::invalid_argument, "update_weights.chunk_index");
  expect_poisoned("update_weights.chunk_index");
}

TEST_F(engine_test, AckMismatchIsPoisoned) {
  attach();
  auto h = header(1);
  open_update(h);
  script->tamper_ack = [](chunk_ack& a) { a.tensors_loaded -= 1; };
  EXPECT_REFIT_ERROR(update(chunk(h, 0))->error, errc::validation_failed, "update_weights.ack");
  expect_poisoned("update_weights.ack");
}

TEST_F(engine_test, AckForOtherChunkIsPoisoned) {
  attach();
  auto h = header(1);
  open_update(h);
  script->tamper_ack = [](chunk_ack& a) { a.chunk_index = 1; };
  EXPECT_REFIT_ERROR(update(chunk(h, 0))->error, errc::validation_failed, "update_weights.ack");
  expect_poisoned("update_weights.ack");
}

TEST_F(engine_test, SafeLookingRuntimeErrorDuringUpdateStillPoisons) {
  attach();
  auto h = header(1);
  open_update(h);
  script->fail["update_weights"] =
    make_refit_error(errc::runtime_invalid_argument, "update_weights", "bad dtype");
  EXPECT_REFIT_ERROR(update(chunk(h, 0))->error, errc::runtime_invalid_argument,
                     "update_weights");
  expect_poisoned("update_weights");
}

// ================================================================ weight transfer: finish

TEST_F(engine_test, FinishWithoutOpenUpdateIsInvalidState) {
  attach();
  EXPECT_REFIT_ERROR(finish(fin(header(1)))->error, errc::invalid_state, "finish_weight_update");
  EXPECT_EQ(script->count("finish_weight_update"), 0u);
  expect_not_poisoned();
}

TEST_F(engine_test, FinishForOtherPublicationPoisons) {
  attach();
  auto h = header(1);
  load_all(h);
  auto req = fin(h);
  req.publication_id = "pub-other";
  EXPECT_REFIT_ERROR(finish(req)->error, errc::invalid_argument, "finish_weight_update");
  EXPECT_EQ(script->count("finish_weight_update"), 0u);
  expect_poisoned("finish_weight_update");
  EXPECT_EQ(status().committed_version, 0u);
}

TEST_F(engine_test, ForgedCommitWithWrongPublicationIdIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.publication_id = "pub-forged"; },
                       "commit.publication_id");
}

TEST_F(engine_test, ForgedCommitWithWrongVersionIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.model_version = 2; }, "commit.model_version");
}

TEST_F(engine_test, ForgedCommitWithoutPrefixCacheResetIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.prefix_cache_reset = false; },
                       "commit.prefix_cache_reset");
}

TEST_F(engine_test, ForgedCommitWithMissingReceiptIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.receipts.pop_back(); }, "commit.receipts");
}

TEST_F(engine_test, ForgedReceiptWithWrongPublicationIdIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.receipts[0].publication_id = "pub-v0"; },
                       "commit.receipts[0].publication_id");
}

TEST_F(engine_test, ForgedReceiptWithWrongVersionIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.receipts[1].model_version = 0; },
                       "commit.receipts[1].model_version");
}

TEST_F(engine_test, ForgedReceiptWithWrongUuidIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.receipts[1].device_uuid = "GPU-forged"; },
                       "commit.receipts[1].device_uuid");
}

TEST_F(engine_test, ForgedReceiptWithWrongTpRankIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.receipts[1].tp_rank = 0; },
                       "commit.receipts[1].tp_rank");
}

TEST_F(engine_test, ForgedReceiptWithWrongFingerprintIsPoisoned) {
  expect_forged_commit(
    [](commit_result& c) { c.receipts[0].manifest_fingerprint = std::string(64, 'f'); },
    "commit.receipts[0].manifest_fingerprint");
}

TEST_F(engine_test, ForgedReceiptWithWrongTpSizeIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.receipts[0].tp_world_size = 1; },
                       "commit.receipts[0].tp_world_size");
}

TEST_F(engine_test, ForgedReceiptWithoutResidentTensorsIsPoisoned) {
  expect_forged_commit([](commit_result& c) { c.receipts[0].resident_tensor_count = 0; },
                       "commit.receipts[0].resident_tensor_count");
}

TEST_F(engine_test, SuccessfulFinishAndReleaseCommitTheVersion) {
  attach();
  ASSERT_TRUE(sleep(2)->ok());
  ASSERT_TRUE(wake(wake_tags::only_weights())->ok());
  auto h = header(3);
  load_all(h);
  auto c = finish(fin(h));
  ASSERT_TRUE(c->ok()) << render(c->error);
  EXPECT_EQ(c->value.publication_id, "pub-v3");
  EXPECT_EQ(c->value.model_version, 3u);
  ASSERT_EQ(c->value.receipts.size(), 2u);
  EXPECT_EQ(c->value.receipts[1].device_uuid, fake_device_uuids()[1]);
  EXPECT_EQ(c->value.receipts[1].resident_tensor_count, chunk_count * tensors_per_chunk);
  auto s = status();
  EXPECT_EQ(s.committed_version, 0u) << "committed only once the IPC imports are released";
  EXPECT_TRUE(s.needs_publication);
  EXPECT_FALSE(s.update_open);
  auto r = release();
  ASSERT_TRUE(r->ok()) << render(r->error);
  s = status();
  EXPECT_EQ(s.committed_version, 3u);
  EXPECT_FALSE(s.needs_publication);
  EXPECT_EQ(state_of(s), "IDLE");
  expect_not_poisoned();
}

TEST_F(engine_test, GenerateBetweenFinishAndReleaseIsRefused) {
  attach();
  auto h = header(1);
  load_all(h);
  ASSERT_TRUE(finish(fin(h))->ok());
  EXPECT_REFIT_ERROR(generate()->error, errc::update_open, "generate");
  EXPECT_REFIT_ERROR(sleep(1)->error, errc::update_open, "sleep");
  EXPECT_REFIT_ERROR(init()->error, errc::update_open, "init_weight_transfer");
  EXPECT_EQ(script->count("generate"), 0u);
}

TEST_F(engine_test, ReleaseReturnsToIdleAndAllowsGeneration) {
  attach();
  auto h = header(1);
  load_all(h);
  ASSERT_TRUE(finish(fin(h))->ok());
  auto r = release();
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_EQ(state_of(r->value), "IDLE");
  EXPECT_FALSE(r->value.update_open);
  EXPECT_EQ(r->value.committed_version, 1u);
  EXPECT_EQ(script->releases, std::vector<std::string>{"pub-v1"});
  auto g = generate();
  ASSERT_TRUE(g->ok()) << render(g->error);
  EXPECT_EQ(g->value.model_version, 1u);
  EXPECT_EQ(g->value.samples[0].model_version, 1u);
}

TEST_F(engine_test, ReleaseBeforeInitIsInvalidState) {
  attach();
  EXPECT_REFIT_ERROR(release()->error, errc::invalid_state, "release_ipc");
  EXPECT_EQ(script->count("release_ipc"), 0u);
  expect_not_poisoned();
}

TEST_F(engine_test, ReleaseWhileUpdateOpenIsRefusedAndDoesNotWedgeTheEngine) {
  attach();
  auto h = header(1);
  open_update(h);
  EXPECT_REFIT_ERROR(release()->error, errc::update_open, "release_ipc");
  EXPECT_EQ(script->count("release_ipc"), 0u);
  // The publication can still complete, be released, and generation resumes.
  for (std::uint32_t k = 0; k < chunk_count; ++k)
    ASSERT_TRUE(update(chunk(h, k))->ok());
  ASSERT_TRUE(finish(fin(h))->ok());
  auto r = release();
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_TRUE(generate()->ok());
}

TEST_F(engine_test, ReleaseFailureIsPoisoned) {
  attach();
  auto h = header(1);
  load_all(h);
  ASSERT_TRUE(finish(fin(h))->ok());
  script->fail["release_ipc"] = make_refit_error(errc::runtime_internal, "release_ipc", "leak");
  EXPECT_REFIT_ERROR(release()->error, errc::runtime_internal, "release_ipc");
  expect_poisoned("release_ipc");
  EXPECT_EQ(status().committed_version, 0u) << "a failure before release changes nothing";
}

TEST_F(engine_test, ConsecutivePublicationsIncreaseTheVersion) {
  attach();
  publish(header(1));
  publish(header(2));
  EXPECT_EQ(status().committed_version, 2u);
  auto h = header(2);
  h.publication_id = "pub-again";
  expect_bad_header(h, "header.model_version", 3);
}

// ================================================================ poison / DOWN / re-attach

TEST_F(engine_test, PoisonRequestBreaksAndPoisonsTheProxy) {
  attach(1, [](fake_script& sc) { sc.defer_poison = true; });
  auto r = poison("trainer saw a NaN");
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_EQ(state_of(r->value), "BROKEN");
  EXPECT_TRUE(r->value.needs_publication);
  ASSERT_EQ(script->poison_reasons.size(), 1u);
  EXPECT_TRUE(contains(script->poison_reasons[0], "trainer saw a NaN"));
  EXPECT_EQ(state_of(status()), "BROKEN");
  EXPECT_REFIT_ERROR(generate()->error, errc::broken, "generate");
  EXPECT_REFIT_ERROR(init()->error, errc::broken, "init_weight_transfer");
  release_held();
  auto s = status();
  EXPECT_EQ(state_of(s), "DETACHED");
  EXPECT_TRUE(contains(s.last_error, "refit.poisoned at runtime")) << s.last_error;
  EXPECT_FALSE(script->alive);
}

TEST_F(engine_test, PoisonDuringOpenUpdateClosesIt) {
  attach();
  open_update(header(1));
  ASSERT_TRUE(poison("abort publication")->ok());
  auto s = status();
  EXPECT_EQ(state_of(s), "DETACHED");
  EXPECT_FALSE(s.update_open);
  EXPECT_TRUE(s.needs_publication);
  EXPECT_EQ(s.committed_version, 0u);
}

TEST_F(engine_test, LateSuccessAfterPoisonDoesNotReviveBrokenConnection) {
  attach(1, [](fake_script& sc) {
    sc.hold.insert("generate");
    sc.defer_poison = true;
  });
  auto g = generate();
  ASSERT_FALSE(g->done);
  // The engine is poisoned while the answer is already on its way.
  // The probe runs before the proxy, so the engine handles the poison first and then the
  // generate answer the proxy released; the poison reaches the proxy after that (deferred).
  auto p = send_request<engine_status>(engine, poison_atom::value, std::string("abort"));
  caf::anon_send(proxy, release_held_atom::value);
  sched.run();
  ASSERT_TRUE(p->ok());
  ASSERT_TRUE(g->done);
  ASSERT_EQ(script->poison_reasons.size(), 1u);
  EXPECT_EQ(state_of(status()), "BROKEN"); // BROKEN is terminal until DOWN
  EXPECT_REFIT_ERROR(generate()->error, errc::broken, "generate");
  release_held();
  EXPECT_EQ(state_of(status()), "DETACHED");
}

TEST_F(engine_test, PoisonDuringAttachDescribeKeepsBroken) {
  attach(1, [](fake_script& sc) {
    sc.hold.insert("describe");
    sc.defer_poison = true;
  });
  ASSERT_EQ(state_of(status()), "INFLIGHT");
  // The engine handles the poison first, then the (valid) describe answer.
  auto p = send_request<engine_status>(engine, poison_atom::value, std::string("abort"));
  caf::anon_send(proxy, release_held_atom::value);
  sched.run();
  ASSERT_TRUE(p->ok());
  EXPECT_EQ(script->poison_reasons.size(), 1u);
  EXPECT_EQ(state_of(status()), "BROKEN");
  release_held();
  EXPECT_EQ(state_of(status()), "DETACHED");
}

TEST_F(engine_test, AttachDescribeTimeoutBreaksAndPoisons) {
  attach(1, [](fake_script& sc) {
    sc.hold.insert("describe");
    sc.defer_poison = true;
  });
  // describe 100 + startup 100 + kill grace 10 + 5 s
  advance(milliseconds(5209));
  EXPECT_EQ(state_of(status()), "INFLIGHT");
  advance(milliseconds(1));
  auto s = status();
  EXPECT_EQ(state_of(s), "BROKEN");
  EXPECT_EQ(script->poison_reasons.size(), 1u);
  release_held();
  EXPECT_EQ(state_of(status()), "DETACHED");
}

TEST_F(engine_test, DescribeTimeoutAfterDownLeavesEngineDetached) {
  attach(1, [](fake_script& sc) { sc.hold.insert("describe"); });
  auto reason = make_refit_error(errc::runtime_exited, "runtime", "died during startup");
  send_exit(proxy, reason);
  sched.run();
  ASSERT_EQ(state_of(status()), "DETACHED");
  advance(std::chrono::seconds(10)); // the engine's describe request times out now
  auto s = status();
  EXPECT_EQ(state_of(s), "DETACHED");
  EXPECT_EQ(s.last_error, render(reason));
  EXPECT_REFIT_ERROR(generate()->error, errc::not_attached, "generate");
}

TEST_F(engine_test, ProxyDownDetachesWithLastError) {
  attach();
  auto reason = make_refit_error(errc::runtime_exited, "runtime", "exit status 9");
  send_exit(proxy, reason);
  sched.run();
  auto s = status();
  EXPECT_EQ(state_of(s), "DETACHED");
  EXPECT_EQ(s.last_error, render(reason));
  EXPECT_EQ(s.incarnation, 1u);
  EXPECT_TRUE(s.needs_publication);
  EXPECT_FALSE(s.weights_awake);
  EXPECT_FALSE(s.kv_cache_awake);
  EXPECT_REFIT_ERROR(generate()->error, errc::not_attached, "generate");
}

TEST_F(engine_test, ProxyDownDuringOpenUpdateClosesIt) {
  attach();
  open_update(header(1));
  send_exit(proxy, make_refit_error(errc::runtime_exited, "runtime", "segfault"));
  sched.run();
  auto s = status();
  EXPECT_EQ(state_of(s), "DETACHED");
  EXPECT_FALSE(s.update_open);
  EXPECT_REFIT_ERROR(update(chunk(header(1), 0))->error, errc::not_attached, "update_weights");
}

TEST_F(engine_test, LateTimeoutAfterDetachLeavesEngineDetached) {
  attach(1, [](fake_script& sc) { sc.hold.insert("generate"); });
  auto g = generate();
  send_exit(proxy, make_refit_error(errc::runtime_exited, "runtime", "killed"));
  sched.run();
  EXPECT_EQ(state_of(status()), "DETACHED");
  advance(generate_backstop());
  ASSERT_TRUE(g->done);
  EXPECT_TRUE(g->error);
  EXPECT_EQ(state_of(status()), "DETACHED");
}

TEST_F(engine_test, ReattachNeedsFullPublicationAndKeepsCommittedVersion) {
  attach(1);
  publish(header(1));
  ASSERT_EQ(status().committed_version, 1u);
  send_exit(proxy, make_refit_error(errc::runtime_exited, "runtime", "crash"));
  sched.run();
  auto second = attach(2);
  auto s = status();
  EXPECT_EQ(state_of(s), "IDLE");
  EXPECT_EQ(s.incarnation, 2u);
  EXPECT_TRUE(s.needs_publication);
  EXPECT_EQ(s.committed_version, 1u);
  EXPECT_REFIT_ERROR(generate()->error, errc::needs_publication, "generate");
  EXPECT_EQ(second->count("generate"), 0u);
  // Not even a re-publication of the committed version is accepted.
  ASSERT_TRUE(init()->ok());
  EXPECT_REFIT_ERROR(start(header(1))->error, errc::invalid_argument, "header.model_version");
  // A full publication of a new version makes generation possible again.
  auto h = header(2);
  ASSERT_TRUE(start(h)->ok());
  for (std::uint32_t k = 0; k < chunk_count; ++k)
    ASSERT_TRUE(update(chunk(h, k))->ok());
  ASSERT_TRUE(finish(fin(h))->ok());
  EXPECT_REFIT_ERROR(generate()->error, errc::update_open, "generate");
  ASSERT_TRUE(release()->ok());
  auto g = generate();
  ASSERT_TRUE(g->ok()) << render(g->error);
  EXPECT_EQ(g->value.model_version, 2u);
  EXPECT_EQ(status().committed_version, 2u);
}

TEST_F(engine_test, LateAnswerFromReplacedRuntimeIsNotDelivered) {
  auto first = attach(1, [](fake_script& sc) { sc.hold.insert("generate"); });
  auto first_proxy = proxy;
  auto g = generate();
  ASSERT_FALSE(g->done);
  attach(2);
  caf::anon_send(first_proxy, release_held_atom::value);
  sched.run();
  ASSERT_TRUE(g->done);
  EXPECT_REFIT_ERROR(g->error, errc::broken, "runtime");
  auto s = status();
  EXPECT_EQ(state_of(s), "IDLE");
  EXPECT_EQ(s.incarnation, 2u);
  EXPECT_TRUE(s.needs_publication);
  EXPECT_TRUE(first->poison_reasons.empty());
}

} // namespace
