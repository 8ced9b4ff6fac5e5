// --trace: the recorder (off records nothing, bounded, spans nest, names escaped), the
// runtime's events across the control channel (appended to responses, checked on ingest),
// and refit-bench publish --trace end to end: valid JSON with a track per trainer rank and TP
// worker, per-chunk events for every chunk of every publication, well nested, and the child's
// timestamps consistent with the parent's; an unwritable path is refused before anything runs.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "actors/runtime_proxy.hpp"
#include "messages/control.pb.h"
#include "run_command.hpp"
#include "runtime/control/trace_wire.hpp"
#include "runtime/trace/chrome_json.hpp"
#include "runtime/trace/trace.hpp"

namespace {

using json = nlohmann::json;
namespace trace = refit::trace;
namespace tracks = refit::trace::tracks;
namespace pb = refit::control::v1;
namespace fs = std::filesystem;

// A fresh directory under the build's temp dir, removed at the end.
struct temp_dir {
  fs::path path;
  temp_dir() {
    char tmpl[] = "/tmp/refit-test-trace-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string bench_exe() {
  std::string runtime = REFIT_RUNTIME_EXE;
  return runtime.substr(0, runtime.rfind('/') + 1) + "refit-bench";
}

std::string tiny_config() { return std::string(REFIT_SOURCE_DIR) + "/configs/tiny-synthetic.yaml"; }

json read_json(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str()); // throws on invalid JSON
}

// One complete event of a written trace, in integer nanoseconds (ts and dur are microseconds
// with three decimals).
struct span_ev {
  std::string name;
  long long start = 0, end = 0;
  json args;
};

long long ns(const json& us) { return std::llround(us.get<double>() * 1000.0); }

// Complete events per (pid, tid), in start order.
std::map<std::pair<int, int>, std::vector<span_ev>> spans_by_track(const json& t) {
  std::map<std::pair<int, int>, std::vector<span_ev>> out;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] != "X")
      continue;
    span_ev s;
    s.name = e["name"];
    s.start = ns(e["ts"]);
    s.end = s.start + ns(e["dur"]);
    s.args = e.value("args", json::object());
    out[{e["pid"].get<int>(), e["tid"].get<int>()}].push_back(std::move(s));
  }
  for (auto& [track, v] : out)
    std::stable_sort(v.begin(), v.end(), [](const span_ev& a, const span_ev& b) {
      return a.start != b.start ? a.start < b.start : a.end > b.end;
    });
  return out;
}

// "" if every two complete events of a track are nested or disjoint, else the first overlap.
std::string nesting_violation(const std::vector<span_ev>& v) {
  std::vector<const span_ev*> stack;
  for (const auto& s : v) {
    while (!stack.empty() && stack.back()->end <= s.start)
      stack.pop_back();
    if (!stack.empty() && s.end > stack.back()->end)
      return s.name + " [" + std::to_string(s.start) + ", " + std::to_string(s.end)
             + ") overlaps " + stack.back()->name + " [" + std::to_string(stack.back()->start)
             + ", " + std::to_string(stack.back()->end) + ")";
    stack.push_back(&s);
  }
  return "";
}

std::map<std::pair<int, int>, std::string> thread_names(const json& t) {
  std::map<std::pair<int, int>, std::string> out;
  for (const auto& e : t["traceEvents"])
    if (e["ph"] == "M" && e["name"] == "thread_name")
      out[{e["pid"].get<int>(), e["tid"].get<int>()}] = e["args"]["name"];
  return out;
}

std::vector<span_ev> named(const std::vector<span_ev>& v, const std::string& name) {
  std::vector<span_ev> out;
  for (const auto& s : v)
    if (s.name == name)
      out.push_back(s);
  return out;
}

// ------------------------------------------------------------------ recorder and writer

TEST(TraceRecorder, OffRecordsNothing) {
  trace::enable();
  trace::disable();
  {
    trace::span s("work", {{"n", 1}});
    EXPECT_FALSE(s.active());
    s.arg("more", 2);
  }
  trace::instant(tracks::sync_coordinator(), "instant");
  trace::counter(tracks::trainer_rank(0), "c", {{"v", 1}});
  trace::complete(tracks::sync_coordinator(), "async", trace::start());
  EXPECT_EQ(trace::start(), 0);
  EXPECT_EQ(trace::statistics().recorded, 0u);
  EXPECT_TRUE(trace::drain().empty());
}

TEST(TraceRecorder, BoundedDropsAndCountsTheRest) {
  trace::enable(3);
  for (int i = 0; i < 5; ++i)
    trace::instant(tracks::sync_coordinator(), "i", {{"i", i}});
  const auto st = trace::statistics();
  EXPECT_EQ(st.recorded, 3u);
  EXPECT_EQ(st.dropped, 2u);
  auto events = trace::drain();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(std::get<std::int64_t>(events[2].args.at(0).v), 2); // the oldest are kept
  trace::disable();
}

TEST(TraceRecorder, SpansNestOnTheirThreadsTracksAndCarryArguments) {
  trace::enable();
  std::thread worker([] {
    trace::set_thread_track(tracks::tp_worker(1));
    trace::span outer("load", {{"chunk", 7u}, {"what", "x"}});
    {
      trace::span inner("copy", {{"ratio", 0.5}, {"ok", true}});
      inner.arg("bytes", std::uint64_t{1} << 40);
    }
  });
  worker.join();
  trace::disable();
  const json t = trace::to_chrome_json(trace::drain());
  const auto names = thread_names(t);
  EXPECT_EQ(names.at({tracks::runtime_pid, 1}), "tp worker 1");
  const auto spans = spans_by_track(t);
  const auto& v = spans.at({tracks::runtime_pid, 1});
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].name, "load");
  EXPECT_EQ(v[1].name, "copy");
  EXPECT_LE(v[0].start, v[1].start);
  EXPECT_GE(v[0].end, v[1].end);
  EXPECT_EQ(nesting_violation(v), "");
  EXPECT_EQ(v[0].args["chunk"], 7);
  EXPECT_EQ(v[0].args["what"], "x");
  EXPECT_EQ(v[1].args["ratio"], 0.5);
  EXPECT_EQ(v[1].args["ok"], true);
  EXPECT_EQ(v[1].args["bytes"], std::int64_t{1} << 40);
}

TEST(TraceWriter, EscapesNamesAndReplacesInvalidUtf8) {
  trace::enable();
  const std::string nasty = "q\"uote\\back\nline\ttab\x01 ctl </script> \xc3\xa9";
  trace::instant(tracks::sync_coordinator(), nasty, {{"key \"k\"", nasty}});
  trace::instant(tracks::sync_coordinator(), std::string("bad \xff\xfe utf8"));
  trace::disable();
  const std::string text = trace::dump(trace::to_chrome_json(trace::drain()));
  const json t = json::parse(text); // valid JSON
  std::vector<json> instants;
  for (const auto& e : t["traceEvents"])
    if (e["ph"] == "i")
      instants.push_back(e);
  ASSERT_EQ(instants.size(), 2u);
  EXPECT_EQ(instants[0]["name"], nasty);
  EXPECT_EQ(instants[0]["args"]["key \"k\""], nasty);
  EXPECT_EQ(instants[1]["name"], "bad \xef\xbf\xbd\xef\xbf\xbd utf8"); // U+FFFD each
}

TEST(TraceWriter, UnwritablePathIsRefusedNamingIt) {
  try {
    trace::output_file f("/nonexistent-dir/trace.json");
    FAIL() << "opened an unwritable path";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'/nonexistent-dir/trace.json'"), std::string::npos)
      << e.what();
  }
  temp_dir dir;
  EXPECT_THROW(trace::output_file f(dir.path.string()), std::runtime_error); // a directory
}

// ------------------------------------------------------------------ across the control channel

TEST(TraceWire, EventsRideOnResponsesAndAreCheckedOnIngest) {
  // Child side: a response plus what the runtime recorded.
  trace::enable();
  trace::set_thread_track(tracks::runtime_server());
  { trace::span s("update_weights", {{"request_id", 9}}); }
  trace::instant(tracks::tp_worker(1), "tick");
  pb::Response rsp;
  rsp.set_protocol_version(1);
  rsp.set_request_id(9);
  rsp.set_command(pb::COMMAND_UPDATE_WEIGHTS);
  rsp.set_ok(true);
  rsp.mutable_update_weights()->set_chunk_index(3);
  std::string payload = rsp.SerializeAsString();
  refit::wire::append_trace(payload, 1 << 20);
  EXPECT_EQ(trace::statistics().recorded, 0u); // drained into the payload

  pb::Response got;
  ASSERT_TRUE(got.ParseFromString(payload));
  EXPECT_EQ(got.update_weights().chunk_index(), 3u); // the result is untouched
  ASSERT_EQ(got.trace().events_size(), 2);

  // A forged track and an unknown phase are refused and counted.
  auto* forged = got.mutable_trace()->add_events();
  forged->set_name("forged");
  forged->set_phase("X");
  forged->set_ts_ns(1);
  forged->set_tid(5000);
  auto* unknown = got.mutable_trace()->add_events();
  unknown->set_name("begin");
  unknown->set_phase("B");
  unknown->set_ts_ns(1);

  // Parent side.
  trace::enable();
  EXPECT_EQ(refit::wire::ingest_trace(got), 2u);
  EXPECT_EQ(trace::statistics().dropped, 2u);
  auto events = trace::drain();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].name, "update_weights");
  EXPECT_TRUE(events[0].where == tracks::runtime_server());
  EXPECT_EQ(events[1].name, "tick");
  EXPECT_TRUE(events[1].where == tracks::tp_worker(1));
  trace::disable();
}

TEST(TraceRecorder, ThreadsWithoutATrackGetARowEach) {
  trace::enable();
  auto work = [] { trace::span s("untracked"); };
  std::thread a(work), b(work);
  a.join();
  b.join();
  trace::disable();
  auto events = trace::drain();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].where.pid, tracks::other_pid);
  EXPECT_EQ(events[1].where.pid, tracks::other_pid);
  EXPECT_NE(events[0].where.tid, events[1].where.tid);
}

TEST(TraceWire, TheFrameBoundIsKeptAndOverflowCounted) {
  trace::enable();
  for (int i = 0; i < 1000; ++i)
    trace::instant(tracks::tp_worker(0), "event with a long enough name", {{"i", i}});
  pb::Response rsp;
  rsp.set_ok(true);
  std::string payload = rsp.SerializeAsString();
  const std::size_t bound = 4096;
  refit::wire::append_trace(payload, bound);
  EXPECT_LE(payload.size(), bound);
  pb::Response got;
  ASSERT_TRUE(got.ParseFromString(payload));
  EXPECT_GT(got.trace().events_size(), 0);
  EXPECT_EQ(static_cast<std::uint64_t>(got.trace().events_size()) + got.trace().dropped(), 1000u);
  trace::disable();
}

TEST(TraceWire, NothingIsAppendedAndTheRuntimeIsNotAskedWhenOff) {
  trace::disable();
  pb::Response rsp;
  rsp.set_ok(true);
  std::string payload = rsp.SerializeAsString();
  const std::string before = payload;
  refit::wire::append_trace(payload, 1 << 20);
  EXPECT_EQ(payload, before);

  refit::runtime_proxy_options opts;
  auto args = refit::runtime_arguments(opts);
  EXPECT_EQ(std::count(args.begin(), args.end(), "--trace"), 0);
  trace::enable();
  args = refit::runtime_arguments(opts);
  EXPECT_EQ(std::count(args.begin(), args.end(), "--trace"), 1);
  trace::disable();
}

// ------------------------------------------------------------------ refit-bench publish --trace

TEST(TraceBench, PublicationTraceHasEveryTrackChunkAndConsistentClocks) {
  temp_dir dir;
  const fs::path file = dir.path / "publish.json";
  const unsigned iterations = 2;
  auto r = refit::testing::run_command(bench_exe() + " publish --config " + tiny_config()
                                       + " --iterations " + std::to_string(iterations)
                                       + " --json --bound-reps 1 --trace " + file.string()
                                       + " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const json report = json::parse(r.out);
  const int chunks = report["chunks"];
  const int ranks = report["trainer_ranks"];
  const int tp = report["tp"];
  ASSERT_GT(chunks, 1);

  const json t = read_json(file);
  ASSERT_TRUE(t.contains("traceEvents"));
  EXPECT_EQ(t["otherData"]["dropped_events"], 0);
  const auto names = thread_names(t);
  for (int r = 0; r < ranks; ++r)
    EXPECT_EQ(names.at({tracks::trainer_pid, r}), "trainer rank " + std::to_string(r));
  for (int w = 0; w < tp; ++w)
    EXPECT_EQ(names.at({tracks::runtime_pid, w}), "tp worker " + std::to_string(w));

  const auto spans = spans_by_track(t);
  for (const auto& [track, v] : spans)
    EXPECT_EQ(nesting_violation(v), "") << "track " << names.at(track);

  const auto& coord = spans.at({tracks::coordinator_pid, 0});
  const auto pubs = named(coord, "publication");
  ASSERT_EQ(pubs.size(), iterations);
  EXPECT_EQ(named(coord, "commit").size(), iterations);
  EXPECT_EQ(named(coord, "release").size(), iterations);
  const auto updates = named(coord, "update_weights");
  ASSERT_EQ(updates.size(), iterations * chunks);

  // Per publication p (in time order) and chunk k: the coordinator's update_weights request.
  auto update_of = [&](std::size_t p, int k) -> const span_ev& {
    return updates.at(p * chunks + k);
  };
  for (std::size_t p = 0; p < iterations; ++p)
    for (int k = 0; k < chunks; ++k) {
      ASSERT_EQ(update_of(p, k).args["chunk"], k);
      EXPECT_GE(update_of(p, k).start, pubs[p].start);
      EXPECT_LE(update_of(p, k).end, pubs[p].end);
    }

  // Every trainer rank materialized and gathered every chunk of every publication, before the
  // coordinator sent that chunk to the runtime.
  for (int r = 0; r < ranks; ++r) {
    const auto& v = spans.at({tracks::trainer_pid, r});
    const auto mats = named(v, "materialize");
    const auto gathers = named(v, "gather");
    ASSERT_EQ(mats.size(), iterations * chunks) << "rank " << r;
    ASSERT_EQ(gathers.size(), iterations * chunks) << "rank " << r;
    EXPECT_EQ(named(v, "prepare").size(), iterations);
    EXPECT_EQ(named(v, "manifest").size(), iterations);
    for (std::size_t p = 0; p < iterations; ++p)
      for (int k = 0; k < chunks; ++k) {
        const auto& m = mats[p * chunks + k];
        EXPECT_EQ(m.args["chunk"], k);
        EXPECT_EQ(gathers[p * chunks + k].args["chunk"], k);
        EXPECT_LE(m.end, update_of(p, k).start) << "rank " << r << " chunk " << k;
      }
  }

  // Every TP worker (in the refit-runtime child: its own clock readings) loaded and copied
  // every chunk inside the parent's update_weights request for it.
  for (int w = 0; w < tp; ++w) {
    const auto& v = spans.at({tracks::runtime_pid, w});
    const auto loads = named(v, "load");
    const auto copies = named(v, "copy");
    ASSERT_EQ(loads.size(), iterations * chunks) << "worker " << w;
    ASSERT_EQ(copies.size(), iterations * chunks) << "worker " << w;
    EXPECT_EQ(named(v, "receipt").size(), iterations);
    EXPECT_EQ(named(v, "unmap").size(), iterations);
    for (std::size_t p = 0; p < iterations; ++p)
      for (int k = 0; k < chunks; ++k) {
        const auto& l = loads[p * chunks + k];
        EXPECT_EQ(l.args["chunk"], k);
        EXPECT_GT(copies[p * chunks + k].args["bytes"].get<long long>(), 0);
        EXPECT_GE(l.start, update_of(p, k).start) << "worker " << w << " chunk " << k;
        EXPECT_LE(l.end, update_of(p, k).end) << "worker " << w << " chunk " << k;
      }
  }

  // The gate's rounds: prepare, every chunk's materialize and transfer, manifest, final.
  EXPECT_EQ(spans.at({tracks::coordinator_pid, 1}).size(), iterations * chunks);
  EXPECT_EQ(spans.at({tracks::coordinator_pid, 2}).size(), iterations * chunks);
  EXPECT_EQ(spans.at({tracks::coordinator_pid, 3}).size(), 3 * iterations);
  // The control requests, and the control server's side of each update_weights.
  EXPECT_EQ(named(spans.at({tracks::coordinator_pid, 4}), "update_weights").size(),
            iterations * chunks);
  EXPECT_EQ(named(spans.at({tracks::runtime_pid, tracks::runtime_server_tid}), "update_weights")
              .size(),
            iterations * chunks);
}

TEST(TraceCoordinator, EveryTpWorkerHasOneSpanPerGenerateRequest) {
  temp_dir dir;
  const fs::path file = dir.path / "job.json";
  auto r = refit::testing::run_command(std::string(REFIT_COORDINATOR_EXE) + " -c " + tiny_config()
                                       + " -n 1 --json --trace " + file.string() + " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const json t = read_json(file);
  const auto spans = spans_by_track(t);
  for (const auto& [track, v] : spans)
    EXPECT_EQ(nesting_violation(v), "");
  // The bootstrap generation (version 0) and the one after publication 1.
  const auto requests = named(spans.at({tracks::coordinator_pid, 4}), "generate");
  ASSERT_EQ(requests.size(), 2u);
  for (std::uint32_t w = 0; w < 2; ++w) {
    const auto gens = named(spans.at({tracks::runtime_pid, static_cast<int>(w)}), "generate");
    ASSERT_EQ(gens.size(), 2u) << "worker " << w;
    for (std::size_t i = 0; i < gens.size(); ++i) {
      EXPECT_GE(gens[i].start, requests[i].start);
      EXPECT_LE(gens[i].end, requests[i].end);
      EXPECT_GT(gens[i].args["generated_tokens"].get<long long>(), 0);
      EXPECT_GT(gens[i].args["prompts"].get<long long>(), 0);
      // Inside each request: the engine's admission rounds (prefill) and one decode_step
      // per generated token after the first, each inside the request's span.
      std::size_t prefills = 0, steps = 0;
      for (const auto& e : spans.at({tracks::runtime_pid, static_cast<int>(w)})) {
        if (e.start < gens[i].start || e.end > gens[i].end)
          continue;
        if (e.name == "prefill")
          ++prefills;
        if (e.name == "decode_step") {
          ++steps;
          EXPECT_GT(e.args["batch"].get<long long>(), 0);
          EXPECT_FALSE(e.args["cuda_graph"].get<bool>()) << "no CUDA graphs on the CPU";
        }
      }
      EXPECT_GE(prefills, 1u) << "worker " << w << " request " << i;
      EXPECT_GE(steps, 1u) << "worker " << w << " request " << i;
    }
  }
}

TEST(TraceBench, UnwritableTracePathIsRefusedBeforeAnythingRuns) {
  auto r = refit::testing::run_command(bench_exe() + " publish --config " + tiny_config()
                                       + " --json --trace /nonexistent-dir/t.json 2>&1");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("cannot write the trace file '/nonexistent-dir/t.json'"),
            std::string::npos)
    << r.out;
  EXPECT_EQ(r.out.find("refit-runtime["), std::string::npos) << "a runtime was started: " << r.out;
  EXPECT_EQ(r.out.find("\"seconds\""), std::string::npos) << r.out;
}

TEST(TraceBench, TracingOffWritesNothing) {
  temp_dir dir;
  auto r = refit::testing::run_command("cd " + dir.path.string() + " && " + bench_exe()
                                       + " publish --config " + tiny_config()
                                       + " --iterations 1 --json --bound-reps 1 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(fs::is_empty(dir.path));
}

} // namespace
