// A trainer process for the multi-process tests, written against the public embedding API only
// (refit/host.hpp). It joins as one rank, then takes commands on stdin, one per line, and
// answers each with one JSON line on stdout:
//   step              -> {"event":"step","step":N}
//   publish V         -> {"event":"published","ok":true,"version":V,...,"receipts":[...]}
//                        or {"event":"published","ok":false,"error":{...},"ms":...}
//   quit              -> exits 0 after closing the host
// On start it prints {"event":"connected",...} or {"event":"error","stage":"connect",...}
// (and exits 3).
#include <refit/host.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

namespace {

using json = nlohmann::json;

json error_json(const refit::api::error& e) {
  return {{"code", e.code}, {"where", e.where}, {"message", e.message}, {"text", e.text}};
}

void emit(const json& j) {
  std::cout << j.dump() << std::endl;
}

} // namespace

int main(int argc, char** argv) {
  refit::api::host_options options;
  refit::api::rank_spec spec;
  std::uint64_t start_step = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    std::string value = argv[i + 1];
    if (flag == "--config")
      options.config_path = value;
    else if (flag == "--rank")
      spec.rank = static_cast<std::uint32_t>(std::stoul(value));
    else if (flag == "--world")
      spec.world = static_cast<std::uint32_t>(std::stoul(value));
    else if (flag == "--port")
      options.coordinator_port = std::stoi(value);
    else if (flag == "--start-step")
      start_step = std::stoull(value);
    else if (flag == "--runtime")
      options.runtime_executable = value;
    else {
      std::cerr << "unknown flag " << flag << std::endl;
      return 2;
    }
  }
  auto created = refit::api::host::create(options);
  if (!created) {
    emit({{"event", "error"}, {"stage", "create"}, {"error", error_json(created.failure())}});
    return 3;
  }
  auto& host = *created.value();
  auto weights = host.recipe_weights();
  weights.start_step = start_step;
  auto t0 = std::chrono::steady_clock::now();
  refit::api::error e = host.register_rank(spec);
  if (!e)
    e = host.register_weights(weights);
  if (!e)
    e = host.connect();
  if (e) {
    emit({{"event", "error"}, {"stage", "connect"}, {"error", error_json(e)}});
    return 3;
  }
  emit({{"event", "connected"},
        {"rank", host.rank()},
        {"world", host.world()},
        {"pid", ::getpid()},
        {"ms", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count()}});
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "quit")
      break;
    if (cmd == "step") {
      auto s = host.step();
      if (s)
        emit({{"event", "step"}, {"step", s.value()}});
      else
        emit({{"event", "step"}, {"error", error_json(s.failure())}});
    } else if (cmd == "publish") {
      std::uint64_t version = 0;
      in >> version;
      auto t = std::chrono::steady_clock::now();
      auto r = host.publish(version);
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      if (!r) {
        emit({{"event", "published"}, {"ok", false}, {"error", error_json(r.failure())}, {"ms", ms}});
        continue;
      }
      const auto& p = r.value();
      json receipts = json::array();
      for (const auto& rc : p.receipts) {
        json sums = json::array();
        for (const auto& c : rc.checksums)
          sums.push_back({c.name, c.digest});
        receipts.push_back({{"tp_rank", rc.tp_rank}, {"device_uuid", rc.device_uuid},
                            {"resident_tensor_count", rc.resident_tensor_count},
                            {"checksums", sums}});
      }
      emit({{"event", "published"},
            {"ok", true},
            {"version", p.model_version},
            {"publication_id", p.publication_id},
            {"tensors", p.tensors},
            {"bytes", p.bytes},
            {"chunks", p.chunks},
            {"trainer_ranks", p.trainer_ranks},
            {"tp", p.tp},
            {"seconds", p.seconds},
            {"attempts", p.attempts},
            {"receipts", receipts},
            {"ms", ms}});
    } else if (cmd == "generate") {
      // generate <n> <max_tokens> <temperature> <text>: the text's bytes are the prompt.
      refit::api::sampling_params sp;
      in >> sp.n >> sp.max_tokens >> sp.temperature;
      std::string text;
      std::getline(in >> std::ws, text);
      std::vector<std::int32_t> prompt(text.begin(), text.end());
      auto g = host.generate({prompt}, sp);
      if (!g) {
        emit({{"event", "generated"}, {"ok", false}, {"error", error_json(g.failure())}});
        continue;
      }
      json samples = json::array();
      for (const auto& smp : g->samples)
        samples.push_back({{"token_ids", smp.token_ids},
                           {"logprobs", smp.logprobs},
                           {"finish_reason", smp.finish_reason},
                           {"model_version", smp.model_version}});
      emit({{"event", "generated"}, {"ok", true}, {"model_version", g->model_version},
            {"samples", samples}});
    } else if (cmd == "status") {
      auto st = host.status();
      if (!st) {
        emit({{"event", "status"}, {"ok", false}, {"error", error_json(st.failure())}});
        continue;
      }
      emit({{"event", "status"}, {"ok", true}, {"committed_version", st->committed_version},
            {"connection", st->connection}, {"publishing", st->publishing},
            {"sleep_level", st->sleep_level}, {"complete", st->complete}});
    } else if (cmd == "sleep" || cmd == "wake") {
      std::uint32_t arg = 1;
      in >> arg;
      auto st = cmd == "sleep" ? host.sleep(arg) : host.wake(true, true);
      if (!st) {
        emit({{"event", cmd}, {"ok", false}, {"error", error_json(st.failure())}});
        continue;
      }
      emit({{"event", cmd}, {"ok", true}, {"sleep_level", st->sleep_level},
            {"weights_awake", st->weights_awake}, {"kv_cache_awake", st->kv_cache_awake}});
    } else {
      emit({{"event", "error"}, {"stage", "command"}, {"line", line}});
    }
  }
  host.close();
  return 0;
}
