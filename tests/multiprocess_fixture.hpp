// The multi-process test fixture: recipes, `refit-coordinator serve` and trainer processes as
// children, a raw CAF client of the serve wire protocol. Included by test_multiprocess.cpp and
// test_serve_hostile.cpp (one test binary each).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "actors/sync_coordinator.hpp"
#include "child_process.hpp"
#include "runtime/system/bootstrap.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/system/network.hpp"
#include "runtime/control/protocol_version.hpp"

namespace {

using namespace refit;
using namespace refit::testing;
using namespace std::chrono_literals;
using json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string coordinator_exe = REFIT_COORDINATOR_EXE;
const std::string trainer_exe = REFIT_TEST_TRAINER_EXE;

struct recipe_options {
  std::uint32_t port = 0;
  bool embedded = false;
  std::string trainer_faults;          // YAML flow sequence for trainer.faults
  std::uint32_t gate_deadline_ms = 30000;
  std::uint32_t barrier_ms = 60000;
  std::uint32_t republish_attempts = 1;
  std::uint32_t join_timeout_ms = 10000;
  std::string tls;                     // YAML flow map for serve.tls
  std::string runtime_faults;          // YAML flow sequence for runtime.faults
  std::string serve_extra;             // more serve keys, ", key: value, ..."
  std::string runtime_extra;           // more runtime keys, ", key: value, ..."
};

std::uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

class MultiProcess : public ::testing::Test {
protected:
  std::string dir;
  std::string token;
  config::refit_config tiny = config::load_file(std::string(REFIT_SOURCE_DIR) + "/configs/tiny-synthetic.yaml");
  std::unique_ptr<child_process> coordinator;
  std::uint16_t port = 0;
  std::string serving_line; // what refit-coordinator serve printed once listening

  void SetUp() override {
    std::random_device rd;
    token = "refit-test-secret-" + std::to_string(rd()) + std::to_string(rd());
    dir = ::testing::TempDir() + "refit-mp-" + std::to_string(::getpid()) + "-"
          + ::testing::UnitTest::GetInstance()->current_test_info()->name() + "/";
    std::filesystem::create_directories(dir);
  }

  void TearDown() override {
    if (coordinator) {
      coordinator->signal(SIGTERM);
      coordinator->wait(30s);
    }
    if (!HasFailure()) // logs of a failed test stay for a look
      std::filesystem::remove_all(dir);
  }

  std::string write_recipe(const std::string& name, const recipe_options& o) {
    std::string path = dir + name;
    std::ofstream(path)
      << "model: " << config::model_to_yaml(tiny.model) << "\n"
      << "runtime: {executable: " << REFIT_RUNTIME_EXE
      << ", tp_size: 2, devices: [cpu:0, cpu:1], kill_grace_ms: 300"
      << (o.runtime_faults.empty() ? "" : ", faults: " + o.runtime_faults) << o.runtime_extra << "}\n"
      << "supervisor: {max_restarts: 3, backoff_initial_ms: 20, backoff_max_ms: 100}\n"
      << "trainer: {lr: 0.001, init_scale: 0.02"
      << (o.trainer_faults.empty() ? "" : ", faults: " + o.trainer_faults) << "}\n"
      << "publication: {buffer_bytes: 65536, buffer_count: 2, verify: true, gate_deadline_ms: "
      << o.gate_deadline_ms << ", memory_headroom_bytes: 1048576, republish_attempts: "
      << o.republish_attempts << "}\n"
      << "job: {seed: 1234}\n"
      << "serve: {host: 127.0.0.1, port: " << o.port << ", token_env: REFIT_TEST_TOKEN, world_size: 2"
      << ", embedded: " << (o.embedded ? "true" : "false") << ", publish_barrier_ms: " << o.barrier_ms
      << ", join_timeout_ms: " << o.join_timeout_ms
      << (o.tls.empty() ? "" : ", tls: " + o.tls) << o.serve_extra << "}\n";
    return path;
  }

  // Starts `refit-coordinator serve` and reads the port it prints.
  void start_coordinator(const std::string& recipe, std::uint16_t on_port = 0) {
    coordinator = std::make_unique<child_process>(
      std::vector<std::string>{coordinator_exe, "serve", "-c", recipe, "--port", std::to_string(on_port)},
      dir + "coordinator-" + std::to_string(++coordinators_) + ".stderr",
      std::vector<std::pair<std::string, std::string>>{{"REFIT_TEST_TOKEN", token}});
    auto line = coordinator->read_line(60s);
    ASSERT_TRUE(line) << "no 'serving' line; stderr:\n" << coordinator->stderr_text();
    serving_line = *line;
    auto at = line->find("127.0.0.1:");
    ASSERT_NE(at, std::string::npos) << *line;
    port = static_cast<std::uint16_t>(std::stoi(line->substr(at + 10)));
  }

  std::unique_ptr<child_process> spawn_trainer(const std::string& recipe, std::uint32_t rank,
                                               std::vector<std::string> extra = {},
                                               const std::string& secret = "") {
    std::vector<std::string> argv{trainer_exe, "--config", recipe, "--rank", std::to_string(rank),
                                  "--port", std::to_string(port)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<child_process>(
      argv, dir + "trainer-" + std::to_string(rank) + "-" + std::to_string(++trainers_) + ".stderr",
      std::vector<std::pair<std::string, std::string>>{
        {"REFIT_TEST_TOKEN", secret.empty() ? token : secret}});
  }

  // Spawns a trainer and waits until it joined.
  std::unique_ptr<child_process> trainer(const std::string& recipe, std::uint32_t rank,
                                         std::vector<std::string> extra = {}) {
    auto t = spawn_trainer(recipe, rank, std::move(extra));
    auto line = read_json(*t, 60s);
    EXPECT_EQ(line.value("event", ""), "connected")
      << line.dump() << "\n" << t->stderr_text()
      << (coordinator ? "\ncoordinator:\n" + coordinator->stderr_text() : std::string());
    return t;
  }

  // Spawns rank 0, then rank 1, each waiting until it joined.
  std::pair<std::unique_ptr<child_process>, std::unique_ptr<child_process>> trainers(const std::string& recipe) {
    auto t0 = trainer(recipe, 0);
    auto t1 = trainer(recipe, 1);
    return {std::move(t0), std::move(t1)};
  }

  static json read_json(child_process& p, std::chrono::milliseconds timeout) {
    auto line = p.read_line(timeout);
    if (!line)
      return json{{"event", "<no answer>"}};
    return json::parse(*line);
  }

  static json command(child_process& p, const std::string& cmd, std::chrono::milliseconds timeout = 120s) {
    p.send(cmd);
    return read_json(p, timeout);
  }

  // Every trainer publishes `version`; returns their answers in rank order.
  static std::vector<json> publish_all(const std::vector<child_process*>& ts, std::uint64_t version) {
    for (auto* t : ts)
      t->send("publish " + std::to_string(version));
    std::vector<json> out;
    for (auto* t : ts)
      out.push_back(read_json(*t, 180s));
    return out;
  }

  // The result is the committed `version`, every TP worker's resident bytes equal the trainer's
  // weights at `step` (checked here, independently of the coordinator's verifier).
  void expect_byte_exact(const json& r, std::uint64_t version, std::uint64_t step) {
    ASSERT_TRUE(r.value("ok", false)) << r.dump();
    EXPECT_EQ(r["version"], version);
    EXPECT_EQ(r["trainer_ranks"], 2);
    EXPECT_EQ(r["tp"], 2);
    EXPECT_GT(r["chunks"].get<int>(), 1) << "64 KiB buffers force several chunks";
    auto expected = expected_resident_checksums(
      tiny.model, 2, {tiny.job.seed, tiny.trainer.lr, tiny.trainer.init_scale}, step);
    ASSERT_EQ(r["receipts"].size(), 2u);
    for (std::uint32_t w = 0; w < 2; ++w) {
      const auto& got = r["receipts"][w];
      EXPECT_EQ(got["tp_rank"], w);
      ASSERT_EQ(got["checksums"].size(), expected[w].checksums.size());
      for (std::size_t i = 0; i < expected[w].checksums.size(); ++i) {
        EXPECT_EQ(got["checksums"][i][0], expected[w].checksums[i].name);
        EXPECT_EQ(got["checksums"][i][1], expected[w].checksums[i].digest)
          << "TP worker " << w << " " << expected[w].checksums[i].name << " at step " << step;
      }
    }
  }

  pid_t runtime_pid(pid_t parent) {
    for (int i = 0; i < 200; ++i) {
      auto kids = children_named(parent, "refit-runtime");
      if (kids.size() == 1)
        return kids.front();
      std::this_thread::sleep_for(25ms);
    }
    ADD_FAILURE() << "no single refit-runtime child of " << parent;
    return -1;
  }

  static bool gone_within(pid_t pid, std::chrono::milliseconds timeout) {
    auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      if (!process_alive(pid))
        return true;
      std::this_thread::sleep_for(20ms);
    }
    return false;
  }

  void stop_coordinator_cleanly() {
    ASSERT_TRUE(coordinator);
    auto rt = children_named(coordinator->pid(), "refit-runtime");
    coordinator->signal(SIGTERM);
    auto rc = coordinator->wait(60s);
    ASSERT_TRUE(rc) << "refit-coordinator did not exit on SIGTERM";
    EXPECT_EQ(*rc, 0) << coordinator->stderr_text();
    EXPECT_THAT(coordinator->stderr_text(), HasSubstr("runtime shut down cleanly"));
    for (auto pid : rt)
      EXPECT_TRUE(gone_within(pid, 5s)) << "orphaned refit-runtime " << pid;
    coordinator.reset();
  }

  static void quit(std::unique_ptr<child_process>& t) {
    t->send("quit");
    auto rc = t->wait(30s);
    EXPECT_TRUE(rc && *rc == 0) << "trainer did not quit cleanly: " << t->stderr_text();
    t.reset();
  }

  // The trainers quit (in this order), then the coordinator stops cleanly.
  template <class... Trainers>
  void quit_and_stop(Trainers&... ts) {
    (quit(ts), ...);
    stop_coordinator_cleanly();
  }

  int coordinators_ = 0;
  int trainers_ = 0;
};

// A CAF client of its own, speaking the wire protocol directly (no embedding API).
class raw_client {
public:
  explicit raw_client(const config::serve_config& serve) : serve_(serve) {
    configure(cfg_);
    net::configure_network(cfg_, serve);
    sys_ = std::make_unique<caf::actor_system>(cfg_);
  }
  caf::actor_system& sys() { return *sys_; }
  const config::serve_config& serve() const { return serve_; }

  caf::expected<rank_registry_actor> connect(std::uint16_t port) {
    return net::connect_registry(*sys_, serve_, "127.0.0.1", port, 10s);
  }

  caf::error hello(const rank_registry_actor& r, std::uint32_t version, const std::string& token) {
    caf::scoped_actor self{*sys_};
    caf::error err;
    self->request(r, 10s, hello_atom::value, version, token)
      .receive([](welcome&, consensus_gate_actor&) {}, [&](caf::error& e) { err = std::move(e); });
    return err;
  }

  // Joins with `req` but no rank or host actor behind it: what the registry answers.
  caf::error join(const rank_registry_actor& r, const join_request& req) {
    caf::scoped_actor self{*sys_};
    caf::error err;
    self->request(r, 10s, join_atom::value, req, trainer_rank_actor{}, trainer_host_actor{})
      .receive([](join_ack&) {}, [&](caf::error& e) { err = std::move(e); });
    return err;
  }

  caf::expected<registry_status> status(const rank_registry_actor& r, const std::string& token) {
    caf::scoped_actor self{*sys_};
    caf::expected<registry_status> out{caf::error{}};
    self->request(r, 10s, status_atom::value, token)
      .receive([&](registry_status& s) { out = std::move(s); },
               [&](caf::error& e) { out = std::move(e); });
    return out;
  }

private:
  config::serve_config serve_;
  caf::actor_system_config cfg_;
  std::unique_ptr<caf::actor_system> sys_;
};

// A client's serve section: plain TCP, proving `secret` in the serve handshake.
config::serve_config plain_serve(const std::string& secret) {
  config::serve_config s;
  s.present = true;
  s.token = secret;
  return s;
}

// Polls the registry status until `pred` holds (or `timeout`).
template <class Pred>
registry_status wait_status(raw_client& c, const rank_registry_actor& r, const std::string& token,
                            Pred pred, std::chrono::milliseconds timeout) {
  registry_status last;
  auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (auto s = c.status(r, token)) {
      last = *s;
      if (pred(last))
        return last;
    }
    std::this_thread::sleep_for(20ms);
  }
  ADD_FAILURE() << "registry status never matched; last error: " << last.last_error;
  return last;
}

} // namespace
