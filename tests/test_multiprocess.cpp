// Multi-process deployment end to end on CPU: `refit-coordinator serve` (or rank 0's process
// with serve.embedded) + trainer processes written against the public embedding API + the
// refit-runtime child, all talking through CAF's middleman. Byte-exact publications, a trainer
// SIGKILLed during chunk materialization, refused joins (token, protocol version, interface), a
// coordinator restart while ranks wait, the publish barrier, TLS; no process is left behind.
#include "multiprocess_fixture.hpp"

namespace {

TEST_F(MultiProcess, TwoTrainerProcessesPublishByteExactVersions) {
  auto recipe = write_recipe("recipe.yaml", {});
  start_coordinator(recipe);
  auto rt = runtime_pid(coordinator->pid());
  auto [t0, t1] = trainers(recipe);
  double seconds = 0;
  for (std::uint64_t v = 1; v <= 3; ++v) {
    EXPECT_EQ(command(*t0, "step")["step"], v);
    EXPECT_EQ(command(*t1, "step")["step"], v);
    auto res = publish_all({t0.get(), t1.get()}, v);
    expect_byte_exact(res[0], v, v);
    expect_byte_exact(res[1], v, v);
    EXPECT_EQ(res[0]["publication_id"], res[1]["publication_id"]) << "one collective publication";
    seconds += res[0]["seconds"].get<double>();
  }
  std::printf("[ measured ] multi-process publication of the tiny model (2 trainer processes, "
              "TP 2): mean %.2f ms over 3 versions\n", seconds / 3 * 1000.0);
  // A version that is not above the committed one is refused on every rank, nothing runs.
  auto stale = publish_all({t0.get(), t1.get()}, 3);
  EXPECT_EQ(stale[0]["error"]["code"], "invalid_argument") << stale[0].dump();
  EXPECT_EQ(stale[1]["error"]["code"], "invalid_argument");
  EXPECT_EQ(children_named(coordinator->pid(), "refit-runtime"), std::vector<pid_t>{rt})
    << "the runtime was never restarted";
  quit(t0);
  quit(t1);
  auto log = coordinator->stderr_text();
  EXPECT_THAT(log, HasSubstr("membership complete: 2 ranks, epoch 1"));
  EXPECT_THAT(log, HasSubstr("rank 0 (pid "));
  EXPECT_THAT(log, Not(HasSubstr(token))) << "the shared secret is never logged";
  stop_coordinator_cleanly();
  EXPECT_FALSE(process_alive(rt));
}

TEST_F(MultiProcess, TrainersGenerateSleepAndWakeThroughTheCoordinator) {
  auto recipe = write_recipe("recipe.yaml", {});
  start_coordinator(recipe);
  auto [t0, t1] = trainers(recipe);
  // The runtime starts from its generated step-0 checkpoint: version 0.
  auto before = command(*t1, "generate 1 4 0 hello");
  ASSERT_TRUE(before.value("ok", false)) << before.dump();
  EXPECT_EQ(before["samples"][0]["model_version"], 0);
  ASSERT_TRUE(publish_all({t0.get(), t1.get()}, 1)[0].value("ok", false));
  auto g = command(*t1, "generate 2 6 0.8 The quick brown fox");
  ASSERT_TRUE(g.value("ok", false)) << g.dump();
  EXPECT_EQ(g["model_version"], 1);
  ASSERT_EQ(g["samples"].size(), 2u);
  for (const auto& smp : g["samples"]) {
    EXPECT_EQ(smp["model_version"], 1);
    EXPECT_EQ(smp["token_ids"].size(), smp["logprobs"].size());
    EXPECT_GE(smp["token_ids"].size(), 1u);
    for (const auto& lp : smp["logprobs"])
      EXPECT_LE(lp.get<double>(), 0.0);
  }
  // Greedy generation is reproducible, from either rank.
  auto a = command(*t0, "generate 1 6 0 same prompt");
  auto b = command(*t1, "generate 1 6 0 same prompt");
  ASSERT_TRUE(a.value("ok", false)) << a.dump();
  EXPECT_EQ(a["samples"][0]["token_ids"], b["samples"][0]["token_ids"]);

  // Rank 0 waits at the barrier of version 2: the publication is open, generation is refused.
  t0->send("publish 2");
  auto st = command(*t1, "status");
  for (int i = 0; i < 100 && !st.value("publishing", false); ++i) {
    std::this_thread::sleep_for(20ms);
    st = command(*t1, "status");
  }
  EXPECT_TRUE(st.value("publishing", false)) << st.dump();
  auto refused = command(*t1, "generate 1 4 0 hello");
  EXPECT_EQ(refused["error"]["code"], "update_open") << refused.dump();
  EXPECT_THAT(refused["error"]["message"].get<std::string>(), HasSubstr("version 2 is open"));
  EXPECT_TRUE(command(*t1, "publish 2").value("ok", false));
  EXPECT_TRUE(read_json(*t0, 60s).value("ok", false));
  auto after = command(*t0, "generate 1 4 0 hello");
  EXPECT_EQ(after["model_version"], 2) << after.dump();

  // Sleep and wake from the trainer side; generation needs the runtime awake.
  auto slept = command(*t0, "sleep 1");
  ASSERT_TRUE(slept.value("ok", false)) << slept.dump();
  EXPECT_EQ(slept["sleep_level"], 1);
  EXPECT_EQ(command(*t1, "generate 1 4 0 hello")["error"]["code"], "asleep");
  auto woke = command(*t1, "wake");
  ASSERT_TRUE(woke.value("ok", false)) << woke.dump();
  EXPECT_TRUE(woke["weights_awake"].get<bool>());
  EXPECT_TRUE(command(*t1, "generate 1 4 0 hello").value("ok", false));
  quit(t0);
  quit(t1);
}

TEST_F(MultiProcess, TrainerKilledDuringMaterializationFailsEveryRankAndRejoins) {
  recipe_options o;
  o.gate_deadline_ms = 20000; // detection must come from the lost connection, not the deadline
  auto recipe = write_recipe("recipe.yaml", o);
  o.trainer_faults = "[{rank: 1, kind: never_report, chunk: 1}]"; // rank 1 holds materialize[1]
  auto stalling = write_recipe("stalling.yaml", o);
  start_coordinator(recipe);
  auto old_runtime = runtime_pid(coordinator->pid());
  raw_client client(plain_serve(token));
  auto registry = client.connect(port);
  ASSERT_TRUE(registry) << render(registry.error());

  auto t0 = trainer(recipe, 0);
  auto t1 = trainer(stalling, 1);
  command(*t0, "step");
  command(*t1, "step");
  t0->send("publish 1");
  t1->send("publish 1");
  // The publication is loading chunks: rank 1 sits on materialize[1], rank 0 waits for it in
  // the all-gather.
  wait_status(client, *registry, token,
              [](const registry_status& s) {
                return s.publishing
                       && s.coordinator.state == static_cast<std::uint8_t>(publication_state::loading);
              },
              20s);
  std::this_thread::sleep_for(300ms);
  auto killed_at = std::chrono::steady_clock::now();
  t1->signal(SIGKILL);
  auto res = read_json(*t0, 60s);
  auto detected = std::chrono::steady_clock::now() - killed_at;
  ASSERT_FALSE(res.value("ok", true)) << res.dump();
  EXPECT_EQ(res["error"]["code"], "rank_lost") << res.dump();
  EXPECT_EQ(res["error"]["where"], "rank 1");
  EXPECT_THAT(res["error"]["message"].get<std::string>(), HasSubstr("the publication failed: refit.gate_failed"));
  EXPECT_THAT(res["error"]["message"].get<std::string>(), HasSubstr("the runtime was poisoned"));
  EXPECT_LT(detected, 10s) << "a dead trainer process is detected at once, not at the 20 s gate deadline";
  EXPECT_EQ(t1->wait(5s), 128 + SIGKILL);
  t1.reset();

  // The runtime was poisoned and restarted once (republish_attempts 1 does not republish
  // without the rank); the old process group is gone.
  auto st = wait_status(client, *registry, token,
                        [](const registry_status& s) {
                          return s.engine.incarnation == 2 && s.engine.conn() == connection_state::idle;
                        },
                        30s);
  EXPECT_EQ(st.rank_losses, 1u);
  EXPECT_FALSE(st.complete);
  EXPECT_EQ(st.committed_version, 0u);
  EXPECT_TRUE(gone_within(old_runtime, 5s)) << "the poisoned runtime was reaped";
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(client.status(*registry, token)->engine.incarnation, 2u) << "no second restart";

  // Rank 1 rejoins (a fresh process, caught up to step 1); the same version publishes.
  t1 = trainer(recipe, 1, {"--start-step", "1"});
  auto again = publish_all({t0.get(), t1.get()}, 1);
  expect_byte_exact(again[0], 1, 1);
  expect_byte_exact(again[1], 1, 1);
  EXPECT_EQ(again[0]["attempts"], 1);
  command(*t0, "step");
  command(*t1, "step");
  auto next = publish_all({t0.get(), t1.get()}, 2);
  expect_byte_exact(next[0], 2, 2);
  EXPECT_THAT(coordinator->stderr_text(), HasSubstr("rank 1 (pid "));
  EXPECT_THAT(coordinator->stderr_text(), HasSubstr("membership complete: 2 ranks, epoch 2"));
  quit_and_stop(t0, t1);
}

TEST_F(MultiProcess, RuntimeFaultIsRepublishedWithTheRemoteRanks) {
  recipe_options o;
  o.runtime_faults = "[{command: update_weights, kind: sigkill, after: 1}]";
  auto recipe = write_recipe("recipe.yaml", o);
  start_coordinator(recipe);
  auto first = runtime_pid(coordinator->pid());
  auto [t0, t1] = trainers(recipe);
  command(*t0, "step");
  command(*t1, "step");
  auto res = publish_all({t0.get(), t1.get()}, 1);
  expect_byte_exact(res[0], 1, 1);
  expect_byte_exact(res[1], 1, 1);
  EXPECT_EQ(res[0]["attempts"], 2) << "the killed runtime was replaced and the version republished";
  EXPECT_TRUE(gone_within(first, 5s));
  quit_and_stop(t0, t1);
}

TEST_F(MultiProcess, RankLostWhileOthersWaitAtTheBarrier) {
  auto recipe = write_recipe("recipe.yaml", {});
  start_coordinator(recipe);
  auto [t0, t1] = trainers(recipe);
  t0->send("publish 1");
  std::this_thread::sleep_for(300ms);
  t1->signal(SIGKILL);
  auto res = read_json(*t0, 30s);
  EXPECT_EQ(res["error"]["code"], "rank_lost") << res.dump();
  EXPECT_THAT(res["error"]["message"].get<std::string>(), HasSubstr("nothing was published"));
  t1->wait(5s);
  quit_and_stop(t0);
}

TEST_F(MultiProcess, FrozenTrainerIsDeclaredGoneByHeartbeats) {
  auto recipe = write_recipe("recipe.yaml", {});
  start_coordinator(recipe);
  auto [t0, t1] = trainers(recipe);
  t1->signal(SIGSTOP); // alive, connection open, but silent
  auto t = std::chrono::steady_clock::now();
  auto res = command(*t0, "publish 1", 60s);
  auto took = std::chrono::steady_clock::now() - t;
  EXPECT_EQ(res["error"]["code"], "rank_lost") << res.dump();
  EXPECT_THAT(res["error"]["message"].get<std::string>(), HasSubstr("remote_link_unreachable"));
  EXPECT_GT(took, 5s) << "declared dead by the BASP connection timeout (10 s), not at once";
  EXPECT_LT(took, 30s);
  t1->signal(SIGKILL);
  t1->wait(5s);
  quit_and_stop(t0);
}

TEST_F(MultiProcess, BarrierTimeoutNamesTheRankThatNeverPublished) {
  recipe_options o;
  o.barrier_ms = 1500;
  auto recipe = write_recipe("recipe.yaml", o);
  start_coordinator(recipe);
  auto [t0, t1] = trainers(recipe);
  auto t = std::chrono::steady_clock::now();
  auto res = command(*t0, "publish 1", 30s);
  EXPECT_EQ(res["error"]["code"], "barrier_timeout") << res.dump();
  EXPECT_THAT(res["error"]["message"].get<std::string>(), HasSubstr("rank(s) 1 did not call publish(1)"));
  EXPECT_LT(std::chrono::steady_clock::now() - t, 10s);
  auto ok = publish_all({t0.get(), t1.get()}, 1);
  expect_byte_exact(ok[0], 1, 0);
  quit_and_stop(t0, t1);
}

TEST_F(MultiProcess, WrongTokenIsRefusedInTheHandshakeAndLogged) {
  auto recipe = write_recipe("recipe.yaml", {});
  start_coordinator(recipe);
  const std::string wrong = "not-the-shared-secret-42";
  auto intruder = spawn_trainer(recipe, 0, {}, wrong);
  auto res = read_json(*intruder, 30s);
  EXPECT_EQ(res["event"], "error") << res.dump();
  EXPECT_EQ(res["error"]["code"], "unauthorized");
  EXPECT_EQ(res["error"]["where"], "handshake.token");
  EXPECT_THAT(res["error"]["message"].get<std::string>(), HasSubstr("different shared secrets"));
  EXPECT_EQ(intruder->wait(10s), 3);

  // A raw client with the wrong secret does not get a BASP connection at all.
  raw_client impostor(plain_serve(wrong));
  auto refused = impostor.connect(port);
  ASSERT_FALSE(refused);
  EXPECT_EQ(static_cast<errc>(refused.error().code()), errc::unauthorized) << render(refused.error());
  EXPECT_EQ(error_where(refused.error()), "handshake.token");

  // The right secret: admitted; the hello's token field is no longer used (protocol 2).
  raw_client client(plain_serve(token));
  auto registry = client.connect(port);
  ASSERT_TRUE(registry) << render(registry.error());
  EXPECT_FALSE(client.hello(*registry, wire::serve_protocol_version, "")) << "no secret on the wire";
  // The listener counts a failed handshake when it sees the peer close: wait for both.
  auto status = wait_status(client, *registry, "",
                            [](const registry_status& s) { return s.refusals >= 2; }, 10s);
  EXPECT_EQ(status.refusals, 2u) << "the two failed handshakes";
  EXPECT_TRUE(status.members.empty()) << "nothing joined";

  auto log = coordinator->stderr_text();
  EXPECT_THAT(log, HasSubstr("refused a connection from 127.0.0.1:"));
  EXPECT_THAT(log, HasSubstr("instead of proving the shared secret"));
  EXPECT_THAT(log, Not(HasSubstr(wrong)));
  EXPECT_THAT(log, Not(HasSubstr(token)));
  // The refused attempts left nothing behind: real ranks still join and publish.
  auto [t0, t1] = trainers(recipe);
  auto ok = publish_all({t0.get(), t1.get()}, 1);
  expect_byte_exact(ok[1], 1, 0);
  quit_and_stop(t0, t1);
}

// Another wire protocol: a hello or join with another version, or a client expecting another
// RankRegistry interface, is refused with a typed error.
using other_registry_interface =
  caf::typed_actor<caf::replies_to<hello_atom, std::uint32_t, std::string, std::string>::with<welcome>>;

TEST_F(MultiProcess, ProtocolVersionMismatchIsRefused) {
  auto recipe = write_recipe("recipe.yaml", {});
  start_coordinator(recipe);
  raw_client client(plain_serve(token));
  auto registry = client.connect(port);
  ASSERT_TRUE(registry) << render(registry.error());
  const auto other = wire::serve_protocol_version + 1;
  auto hello = client.hello(*registry, other, token);
  EXPECT_EQ(static_cast<errc>(hello.code()), errc::protocol_mismatch) << render(hello);
  EXPECT_EQ(error_where(hello), "hello.protocol_version");
  EXPECT_THAT(error_message(hello), HasSubstr("refit wire protocol " + std::to_string(wire::serve_protocol_version)));

  join_request req;
  req.protocol_version = other;
  req.world = 2;
  auto join_err = client.join(*registry, req);
  EXPECT_EQ(static_cast<errc>(join_err.code()), errc::protocol_mismatch) << render(join_err);
  EXPECT_EQ(error_where(join_err), "join.protocol_version");

  auto mismatched = net::connect_as<other_registry_interface>(client.sys(), client.serve(),
                                                              "127.0.0.1", port, 10s);
  ASSERT_FALSE(mismatched);
  EXPECT_EQ(static_cast<errc>(mismatched.error().code()), errc::protocol_mismatch)
    << render(mismatched.error());
  EXPECT_THAT(coordinator->stderr_text(), HasSubstr("protocol version " + std::to_string(other)));
  stop_coordinator_cleanly();
}

TEST_F(MultiProcess, JoinRefusalsNameTheField) {
  auto recipe = write_recipe("recipe.yaml", {});
  start_coordinator(recipe);
  auto t0 = trainer(recipe, 0);
  raw_client client(plain_serve(token));
  auto registry = client.connect(port);
  ASSERT_TRUE(registry) << render(registry.error());
  join_request good;
  good.protocol_version = wire::serve_protocol_version;
  good.rank = 1;
  good.world = 2;
  good.manifest_fingerprint = model::structural_manifest(model::expected_key_stream(tiny.model));
  good.pid = ::getpid();
  good.collective_endpoint = "memfd:1:1";
  auto expect_refused = [&](join_request req, errc code, const std::string& where,
                            const std::string& text) {
    auto err = client.join(*registry, req);
    EXPECT_EQ(static_cast<errc>(err.code()), code) << render(err);
    EXPECT_EQ(error_where(err), where) << render(err);
    EXPECT_THAT(error_message(err), HasSubstr(text));
  };
  auto r = good;
  r.world = 3;
  expect_refused(r, errc::join_refused, "join.world", "serves 2 trainer ranks");
  r = good;
  r.rank = 2;
  expect_refused(r, errc::join_refused, "join.rank", "out of range");
  r = good;
  r.rank = 0;
  expect_refused(r, errc::join_refused, "join.rank", "already joined by pid " + std::to_string(t0->pid()));
  r = good;
  r.manifest_fingerprint = std::string(64, '0');
  expect_refused(r, errc::join_refused, "join.manifest_fingerprint", "differs from the coordinator's");
  expect_refused(good, errc::invalid_argument, "join", "no rank or host actor");
  // Publishing for a rank this client did not join as is refused too.
  caf::error err;
  {
    caf::scoped_actor self{client.sys()};
    self->request(*registry, 10s, publish_atom::value, publish_request{0, 1, 1})
      .receive([](publication_result&) {}, [&](caf::error& e) { err = std::move(e); });
  }
  EXPECT_EQ(static_cast<errc>(err.code()), errc::unauthorized) << render(err);
  auto st = client.status(*registry, token);
  ASSERT_TRUE(st);
  ASSERT_EQ(st->members.size(), 1u);
  EXPECT_EQ(st->members[0].pid, t0->pid());
  EXPECT_EQ(st->refusals, 6u);
  quit_and_stop(t0);
}

TEST_F(MultiProcess, NothingListeningIsUnreachableWithinTheJoinTimeout) {
  recipe_options o;
  o.join_timeout_ms = 1500;
  auto recipe = write_recipe("recipe.yaml", o);
  port = free_port(); // nobody listens there
  auto t = std::chrono::steady_clock::now();
  auto lone = spawn_trainer(recipe, 0);
  auto res = read_json(*lone, 30s);
  auto took = std::chrono::steady_clock::now() - t;
  EXPECT_EQ(res["error"]["code"], "coordinator_unreachable") << res.dump();
  EXPECT_GE(took, 1300ms) << "refused connections are retried for serve.join_timeout_ms";
  EXPECT_LT(took, 10s);
  EXPECT_EQ(lone->wait(10s), 3);
}

TEST_F(MultiProcess, TrainersStartedBeforeTheCoordinatorJoinOnceItListens) {
  recipe_options o;
  o.port = free_port();
  auto recipe = write_recipe("recipe.yaml", o);
  port = static_cast<std::uint16_t>(o.port);
  auto early0 = spawn_trainer(recipe, 0);
  auto early1 = spawn_trainer(recipe, 1);
  std::this_thread::sleep_for(500ms);
  start_coordinator(recipe, static_cast<std::uint16_t>(o.port));
  EXPECT_EQ(read_json(*early0, 30s)["event"], "connected");
  EXPECT_EQ(read_json(*early1, 30s)["event"], "connected");
  auto res = publish_all({early0.get(), early1.get()}, 1);
  expect_byte_exact(res[0], 1, 0);
  quit_and_stop(early0, early1);
}

TEST_F(MultiProcess, CoordinatorRestartWhileRanksWaitIsATypedErrorNotAHang) {
  auto recipe = write_recipe("recipe.yaml", {});
  start_coordinator(recipe);
  auto first_runtime = runtime_pid(coordinator->pid());
  auto [t0, t1] = trainers(recipe);
  expect_byte_exact(publish_all({t0.get(), t1.get()}, 1)[0], 1, 0);
  t0->send("publish 2"); // rank 1 does not: rank 0 waits at the barrier
  std::this_thread::sleep_for(300ms);
  auto killed_at = std::chrono::steady_clock::now();
  coordinator->signal(SIGKILL);
  ASSERT_EQ(coordinator->wait(10s), 128 + SIGKILL);
  auto res = read_json(*t0, 60s);
  EXPECT_LT(std::chrono::steady_clock::now() - killed_at, 15s) << "no hang";
  EXPECT_EQ(res["error"]["code"], "coordinator_lost") << res.dump();
  EXPECT_THAT(res["error"]["where"].get<std::string>(), HasSubstr("127.0.0.1:" + std::to_string(port)));
  auto later = command(*t1, "publish 2", 30s);
  EXPECT_EQ(later["error"]["code"], "coordinator_lost") << later.dump();
  EXPECT_TRUE(gone_within(first_runtime, 5s)) << "the runtime dies with its coordinator";

  // The coordinator comes back on the same port; fresh trainer processes join it.
  auto old_port = port;
  coordinator.reset();
  start_coordinator(recipe, old_port);
  EXPECT_EQ(port, old_port);
  quit(t0);
  quit(t1);
  auto [n0, n1] = trainers(recipe);
  expect_byte_exact(publish_all({n0.get(), n1.get()}, 1)[0], 1, 0);
  quit_and_stop(n0, n1);
}

TEST_F(MultiProcess, EmbeddedCoordinatorInRankZerosProcess) {
  recipe_options o;
  o.embedded = true;
  o.port = free_port();
  auto recipe = write_recipe("recipe.yaml", o);
  port = static_cast<std::uint16_t>(o.port);
  auto t0 = trainer(recipe, 0); // starts the runtime and the registry in its own process
  auto rt = runtime_pid(t0->pid());
  auto t1 = trainer(recipe, 1);
  for (std::uint64_t v = 1; v <= 2; ++v) {
    command(*t0, "step");
    command(*t1, "step");
    auto res = publish_all({t0.get(), t1.get()}, v);
    expect_byte_exact(res[0], v, v);
    expect_byte_exact(res[1], v, v);
  }
  EXPECT_THAT(t0->stderr_text(), HasSubstr("coordinator: membership complete: 2 ranks, epoch 1"));
  quit(t1);
  quit(t0);
  EXPECT_TRUE(gone_within(rt, 5s)) << "rank 0 shut its runtime down";
}

TEST_F(MultiProcess, TlsWithMutualCertificates) {
  if (std::system("openssl version > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "no openssl command to make certificates";
  std::string cmd =
    "cd " + dir + " && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=refit-test-ca"
    " -keyout ca.key -out ca.pem > gen.log 2>&1"
    " && openssl req -newkey rsa:2048 -nodes -subj /CN=refit-node -keyout node.key -out node.csr"
    " >> gen.log 2>&1 && openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial"
    " -days 1 -out node.pem >> gen.log 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "certificate generation failed (see " << dir << "gen.log)";
  recipe_options o;
  o.tls = "{enabled: true, certificate: " + dir + "node.pem, key: " + dir + "node.key, cafile: " + dir + "ca.pem}";
  auto recipe = write_recipe("recipe.yaml", o);
  start_coordinator(recipe);
  EXPECT_THAT(serving_line, HasSubstr("tls on"));
  auto [t0, t1] = trainers(recipe);
  auto res = publish_all({t0.get(), t1.get()}, 1);
  expect_byte_exact(res[0], 1, 0);
  expect_byte_exact(res[1], 1, 0);
  // A client without TLS does not get in (and does not hang).
  raw_client plain(plain_serve(token));
  auto t = std::chrono::steady_clock::now();
  auto registry = plain.connect(port);
  ASSERT_FALSE(registry);
  EXPECT_EQ(static_cast<errc>(registry.error().code()), errc::coordinator_unreachable)
    << render(registry.error());
  EXPECT_LT(std::chrono::steady_clock::now() - t, 15s);
  quit_and_stop(t0, t1);
}

} // namespace
