// Deterministic replay (CTest label `faults`): a real faulty run with the refit-runtime child is
// recorded in the actor journal and refit-replay reproduces it; a tampered or reordered entry
// makes refit-replay fail naming that entry; truncated, garbage or inconsistent journals are
// rejected with an error that names where (exit 2).
#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>

#include "publication_fixture.hpp"
#include "run_command.hpp"
#include "runtime/journal/journal_file.hpp"
#include "runtime/system/replay.hpp"

using namespace refit;
using namespace refit::testing;
using ::testing::HasSubstr;

namespace {

std::string temp_path(const std::string& tag) {
  return "/tmp/refit-replay-test-" + std::to_string(::getpid()) + "-" + tag + ".journal";
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

command_result replay_exe(const std::string& path) {
  return run_command(std::string(REFIT_REPLAY_EXE) + " '" + path + "' 2>&1");
}

std::vector<journal::element> encode(const caf::message& m) {
  return journal::encode(m, [](const caf::actor_addr&) { return std::string("?"); });
}

// A real run with the refit-runtime child and the journal on: the first attempt of version 1
// loses its runtime (SIGKILL in the second update_weights), the fresh runtime gets the
// republish; then generation and a second publication.
class RecordedRun : public Publication {
protected:
  std::string path = temp_path("run");

  ~RecordedRun() override { std::remove(path.c_str()); }

  void record(bool second_publication) {
    cfg.journal.enabled = true;
    cfg.journal.path = path;
    cfg.publication.republish_attempts = 1;
    cfg.runtime.faults = {{"update_weights", "sigkill", 1, 1}};
    start();
    auto res = publish(1);
    ASSERT_TRUE(res) << render(res.error());
    ASSERT_EQ(res->attempts, 2u);
    generate_request req;
    req.prompts = {{72, 101, 108, 108, 111}};
    req.params.n = 2;
    req.params.max_tokens = 4;
    req.params.seed = 7;
    auto gen = ask<generate_result>(rollout.engine, generate_atom::value, req);
    ASSERT_TRUE(gen) << render(gen.error());
    for (const auto& s : gen->samples)
      EXPECT_EQ(s.model_version, 1u);
    if (second_publication) {
      step_all();
      auto again = publish(2);
      ASSERT_TRUE(again) << render(again.error());
    }
    // Stop everything so the journal holds the whole run, shutdown included.
    auto sink = rollout.journal;
    TearDown();
    std::dynamic_pointer_cast<journal::recorder>(sink)->flush();
  }
};

TEST_F(RecordedRun, FaultyRunWithTheRuntimeChildReplays) {
  record(true);
  auto j = journal::read_file(path);
  // The journal saw the runtime die and the supervisor attach the next one.
  auto has = [&](journal::kind k, const std::string& type_part) {
    return std::any_of(j.entries.begin(), j.entries.end(), [&](const journal::entry& e) {
      return e.k == k && e.type.find(type_part) != std::string::npos;
    });
  };
  EXPECT_TRUE(has(journal::kind::input_process_exit, "down_msg"));
  EXPECT_TRUE(has(journal::kind::input_supervisor, "'attach'"));
  EXPECT_TRUE(has(journal::kind::input_rank_report, "rank_report"));
  EXPECT_TRUE(has(journal::kind::input_worker, "'done'"));
  EXPECT_TRUE(has(journal::kind::input_exit, "exit_msg"));
  EXPECT_TRUE(has(journal::kind::value, "publication_id"));
  auto out = replay_exe(path);
  EXPECT_EQ(out.exit_code, 0) << out.out;
  EXPECT_THAT(out.out, HasSubstr("reproduced " + std::to_string(j.entries.size()) + " entries"));
  EXPECT_THAT(out.out, HasSubstr("publications committed 2, failed attempts 1"));
  std::printf("%s", out.out.c_str()); // the replay time of the recorded run
}

// Rewrites the journal with `f` applied to its entries and returns refit-replay's answer.
template <class F>
command_result replay_modified(const journal::file& j, const std::string& path, F f) {
  auto copy = j;
  f(copy.entries);
  write_bytes(path, journal::serialize(copy));
  return replay_exe(path);
}

std::size_t find_entry(const std::vector<journal::entry>& es, journal::kind k,
                       const std::string& type) {
  for (std::size_t i = 0; i < es.size(); ++i)
    if (es[i].k == k && es[i].type == type)
      return i;
  ADD_FAILURE() << "no " << journal::to_string(k) << " " << type << " entry";
  return 0;
}

TEST_F(RecordedRun, TamperedOrReorderedEntriesAreNamed) {
  record(false);
  auto j = journal::read_file(path);
  auto modified = temp_path("modified");

  // An output: the chunk the engine sent to the runtime, one tensor offset changed.
  auto i = find_entry(j.entries, journal::kind::output_send, "'update', weight_chunk");
  auto seq = j.entries[i].seq;
  auto out = replay_modified(j, modified, [&](std::vector<journal::entry>& es) {
    caf::message m;
    ASSERT_EQ(journal::decode(es[i].elements, {}, m), "");
    auto chunk = m.get_as<weight_chunk>(1);
    chunk.tensors.at(0).offset += 256;
    es[i].elements = encode(caf::make_message(update_atom::value, chunk));
  });
  EXPECT_EQ(out.exit_code, 1) << out.out;
  EXPECT_THAT(out.out, HasSubstr("first difference at seq " + std::to_string(seq) + " "));
  EXPECT_THAT(out.out, HasSubstr("expected: seq " + std::to_string(seq) + " OUTPUT_SEND"));

  // An input: the runtime acknowledges another tensor count. The engine now rejects the ack,
  // so the entry right after it differs.
  i = find_entry(j.entries, journal::kind::input_runtime, "chunk_ack");
  out = replay_modified(j, modified, [&](std::vector<journal::entry>& es) {
    caf::message m;
    ASSERT_EQ(journal::decode(es[i].elements, {}, m), "");
    auto ack = m.get_as<chunk_ack>(0);
    ack.tensors_loaded += 1;
    es[i].elements = encode(caf::make_message(ack));
  });
  EXPECT_EQ(out.exit_code, 1) << out.out;
  EXPECT_THAT(out.out, HasSubstr("first difference at seq " + std::to_string(j.entries[i + 1].seq) + " "));
  EXPECT_THAT(out.out, HasSubstr("update_weights.ack")) << "the actual entry shows the rejection";

  // Two entries swapped (seq numbers kept increasing): a rank report moved before the state
  // transition of the step it follows.
  i = find_entry(j.entries, journal::kind::input_rank_report, "'report', rank_report");
  auto k = i + 1;
  while (k < j.entries.size() && j.entries[k].k != journal::kind::output_transition)
    ++k;
  ASSERT_LT(k + 1, j.entries.size());
  out = replay_modified(j, modified, [&](std::vector<journal::entry>& es) {
    std::swap(es[k], es[k + 1]);
    std::swap(es[k].seq, es[k + 1].seq);
  });
  EXPECT_EQ(out.exit_code, 1) << out.out;
  EXPECT_THAT(out.out, HasSubstr("first difference at seq " + std::to_string(j.entries[k].seq) + " "));

  // The unmodified journal still replays.
  out = replay_exe(path);
  EXPECT_EQ(out.exit_code, 0) << out.out;
  std::remove(modified.c_str());
}

// -------------------------------------------------------------------------------- codec

TEST(JournalCodec, EveryElementTypeRoundTripsBitExactly) {
  publication_result res;
  res.publication_id = "pub-1";
  res.seconds = 0.1 + 0.2; // not representable in a short decimal
  res.receipts.push_back(receipt{"pub-1", 1, 2, "ab", 1, "GPU-x", 7, {{"w", "00ff"}}});
  res.recovered_errors = {"refit.runtime_exited at update_weights: peer closed"};
  rank_report rr;
  rr.phase = phase_id{"pub-1", 2, 3};
  rr.tensors = {tensor_meta{"t", {-1, 2}, 1, 256, 8}};
  generate_result gen;
  gen.samples.push_back(sample{0, {1}, {2, 3}, {-0.5f, -1e-30f}, "length", true, 4});
  auto err = make_refit_error(errc::gate_failed, "materialize[1] of pub-1", "rank 1: x");
  auto msg = caf::make_message(update_atom::value, res, rr, gen, std::vector<rank_report>{rr},
                               std::uint32_t{7}, std::uint64_t{1} << 63, true, -0.0, err,
                               caf::error{});
  auto elements = encode(msg);
  caf::message back;
  ASSERT_EQ(journal::decode(elements, {}, back), "");
  EXPECT_EQ(encode(back), elements);
  EXPECT_EQ(back.get_as<publication_result>(1).seconds, 0.1 + 0.2);
  EXPECT_EQ(render(back.get_as<caf::error>(9)), render(err));
  EXPECT_FALSE(back.get_as<caf::error>(10));
  EXPECT_EQ(journal::signature(elements),
            "'update', publication_result, rank_report, generate_result, vector<rank_report>, "
            "u32, u64, bool, double, error, error");
}

TEST(JournalCodec, HostileBytesAreBoundedErrors) {
  caf::message m;
  // A 10-byte varint length (CAF's own deserializer would shift a 32-bit value by 35 bits).
  auto err = journal::decode({{"string", std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 10)}},
                             {}, m);
  EXPECT_THAT(err, HasSubstr("elements[0] (string): string of 18446744073709551615 bytes exceeds"));
  err = journal::decode({{"string", std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f", 10)}},
                        {}, m);
  EXPECT_THAT(err, HasSubstr("varint overflows 64 bits"));
  err = journal::decode({{"vector<rank_report>", std::string("\x80\x80\x80\x80\x10", 5)}}, {}, m);
  EXPECT_THAT(err, HasSubstr("sequence count 4294967296 exceeds the 0 bytes left"));
  err = journal::decode({{"bool", std::string("\x02", 1)}}, {}, m);
  EXPECT_THAT(err, HasSubstr("bool byte 2 is neither 0 nor 1"));
  err = journal::decode({{"u64", "1234567"}}, {}, m);
  EXPECT_THAT(err, HasSubstr("truncated: 8-byte value, 7 bytes left"));
  err = journal::decode({{"u32", "12345"}}, {}, m);
  EXPECT_THAT(err, HasSubstr("1 bytes left after the value"));
  err = journal::decode({{"?std::thread", "x"}}, {}, m);
  EXPECT_THAT(err, HasSubstr("unknown element type"));
  // An error whose context holds an error whose context holds ...: bounded depth.
  auto e = make_refit_error(errc::busy, "a", "b");
  for (int i = 0; i < 6; ++i)
    e = caf::error{e.code(), e.category(), caf::make_message(e)};
  err = journal::decode(encode(caf::make_message(e)), {}, m);
  EXPECT_THAT(err, HasSubstr("errors nested deeper than"));
  // Rendering never throws on bad bytes; it names the problem.
  EXPECT_THAT(journal::render(std::vector<journal::element>{{"rank_info", "\x01"}}),
              HasSubstr("<truncated"));
}

// -------------------------------------------------------------------------------- malformed

// A small valid journal without processes: the driver asks the engine for its status.
journal::file tiny_journal() {
  journal::file f;
  f.header = journal::make_header(config::to_yaml(tiny_config(2)), 1234);
  journal::entry in;
  in.seq = 1;
  in.k = journal::kind::input_driver;
  in.actor = "RolloutEngine";
  in.peer = "outside";
  in.message_id = caf::make_message_id(1).integer_value(); // request 1, normal priority
  in.elements = encode(caf::make_message(status_atom::value));
  in.type = journal::signature(in.elements);
  journal::entry reply;
  reply.seq = 2;
  reply.k = journal::kind::output_reply;
  reply.actor = "RolloutEngine";
  reply.peer = "outside";
  reply.message_id = caf::message_id{in.message_id}.response_id().integer_value();
  reply.elements = encode(caf::make_message(engine_status{}));
  reply.type = journal::signature(reply.elements);
  f.entries = {in, reply};
  return f;
}

journal::journal_error parse_error(const std::string& bytes) {
  try {
    journal::parse(bytes, "j");
  } catch (const journal::journal_error& e) {
    return e;
  }
  ADD_FAILURE() << "accepted";
  return journal::journal_error("", 0, 0, "");
}

TEST(ReplayJournal, TinyJournalReplaysAndAWrongReplyDiverges) {
  auto f = tiny_journal();
  auto res = replay::run(f);
  EXPECT_TRUE(res.ok) << res.divergence;
  EXPECT_EQ(res.inputs, 1u);
  EXPECT_EQ(res.outputs, 1u);
  EXPECT_EQ(res.unrecorded_tail, 0u);
  // A journal that ends inside a step (the recorder died) is checked up to its end.
  auto cut = f;
  cut.entries.pop_back();
  res = replay::run(cut);
  EXPECT_TRUE(res.ok) << res.divergence;
  EXPECT_EQ(res.unrecorded_tail, 1u);
  engine_status wrong;
  wrong.committed_version = 5;
  f.entries[1].elements = encode(caf::make_message(wrong));
  res = replay::run(f);
  EXPECT_FALSE(res.ok);
  EXPECT_EQ(res.diverged_seq, 2u);
  EXPECT_THAT(res.divergence, HasSubstr("expected: seq 2 OUTPUT_REPLY RolloutEngine -> outside"));
  EXPECT_THAT(res.divergence, HasSubstr("actual:   seq 2 OUTPUT_REPLY"));
}

TEST(ReplayJournal, AForgedReplyIsMalformedNotObeyed) {
  // A "rank reply" to a request the coordinator never sent: replay refuses to deliver it.
  auto f = tiny_journal();
  journal::entry forged;
  forged.seq = 3;
  forged.k = journal::kind::input_rank_reply;
  forged.actor = "SyncCoordinator";
  forged.peer = "rank0";
  forged.message_id = caf::make_message_id(7).response_id().integer_value();
  forged.elements = encode(caf::make_message(rank_info{}));
  forged.type = journal::signature(forged.elements);
  f.entries.push_back(forged);
  try {
    replay::run(f, "j");
    ADD_FAILURE() << "replayed a forged reply";
  } catch (const journal::journal_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("j: entry seq 3: field 'message_id': a reply from rank0 to a "
                                    "request SyncCoordinator did not send"));
    EXPECT_EQ(e.seq, 3u);
  }
}

TEST(ReplayJournal, TruncatedJournalNamesTheOffset) {
  auto bytes = journal::serialize(tiny_journal());
  auto header_bytes = journal::serialize(tiny_journal().header).size();
  auto e = parse_error(bytes.substr(0, bytes.size() - 3));
  EXPECT_THAT(e.what(), HasSubstr("truncated: the record needs"));
  EXPECT_THAT(e.what(), HasSubstr("at byte offset"));
  EXPECT_GT(e.offset, header_bytes - 1);
  e = parse_error(bytes.substr(0, header_bytes / 2));
  EXPECT_THAT(e.what(), HasSubstr("j: header at byte offset 0: truncated"));
  e = parse_error("");
  EXPECT_THAT(e.what(), HasSubstr("the file is empty"));
}

TEST(ReplayJournal, GarbageIsRejected) {
  auto e = parse_error("RFT1 this is not a journal at all");
  EXPECT_THAT(e.what(), HasSubstr("j: header at byte offset 0:"));
  e = parse_error(std::string("\xff\xff\xff\xff\xff\xff\x01", 7));
  EXPECT_THAT(e.what(), HasSubstr("length prefix is longer than 5 bytes"));
  e = parse_error(std::string("\xff\xff\xff\x7f", 4));
  EXPECT_THAT(e.what(), HasSubstr("exceeds the limit"));
  e = parse_error(std::string("\x05\xff\xff\xff\xff\xff", 6));
  EXPECT_THAT(e.what(), HasSubstr("does not parse as refit.journal.v1.Record"));
}

TEST(ReplayJournal, InconsistentEntriesNameSeqAndField) {
  auto f = tiny_journal();
  auto g = f;
  g.entries[1].seq = 1;
  auto e = parse_error(journal::serialize(g));
  EXPECT_THAT(e.what(), HasSubstr("entry seq 1 at byte offset"));
  EXPECT_THAT(e.what(), HasSubstr("field 'seq': is not above the previous entry's seq 1"));
  EXPECT_EQ(e.field, "seq");
  g = f;
  g.entries[0].k = static_cast<journal::kind>(42);
  e = parse_error(journal::serialize(g));
  EXPECT_THAT(e.what(), HasSubstr("entry seq 1 at byte offset"));
  EXPECT_THAT(e.what(), HasSubstr("field 'kind': unknown kind 42"));
  g = f;
  g.entries[1].actor = "TrainerRank";
  e = parse_error(journal::serialize(g));
  EXPECT_THAT(e.what(), HasSubstr("entry seq 2"));
  EXPECT_THAT(e.what(), HasSubstr("field 'actor'"));
  g = f;
  g.entries[0].elements[0].type = "pointer";
  e = parse_error(journal::serialize(g));
  EXPECT_THAT(e.what(), HasSubstr("field 'elements[0].type': unknown element type 'pointer'"));
  g = f;
  g.header.config_yaml += "# edited\n";
  e = parse_error(journal::serialize(g));
  EXPECT_THAT(e.what(), HasSubstr("header at byte offset 0: field 'config_digest'"));
  g = f;
  g.header.format_version = 9;
  e = parse_error(journal::serialize(g));
  EXPECT_THAT(e.what(), HasSubstr("unsupported journal format version 9"));
  auto bytes = journal::serialize(f.entries[0]) + journal::serialize(f.header);
  e = parse_error(bytes);
  EXPECT_THAT(e.what(), HasSubstr("an entry before the journal header"));
  bytes = journal::serialize(f) + journal::serialize(f.header);
  e = parse_error(bytes);
  EXPECT_THAT(e.what(), HasSubstr("a second header"));
}

TEST(ReplayJournal, RefitReplayExitCodes) {
  auto path = temp_path("exit");
  auto f = tiny_journal();
  write_bytes(path, journal::serialize(f));
  auto out = replay_exe(path);
  EXPECT_EQ(out.exit_code, 0) << out.out;
  EXPECT_THAT(out.out, HasSubstr("reproduced 2 entries (1 inputs, 0 transitions, 1 outputs"));
  // Undecodable bytes of a recorded input: malformed, naming the entry and the element.
  auto g = f;
  g.entries[0].elements.push_back({"u64", "abc"});
  g.entries[0].type = journal::signature(g.entries[0].elements);
  write_bytes(path, journal::serialize(g));
  out = replay_exe(path);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_THAT(out.out, HasSubstr("entry seq 1: field 'elements': elements[1] (u64): truncated"));
  // Truncated file.
  auto bytes = journal::serialize(f);
  write_bytes(path, bytes.substr(0, bytes.size() - 1));
  out = replay_exe(path);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_THAT(out.out, HasSubstr("refit-replay: malformed journal: " + path + ": record at byte offset"));
  // A config that does not validate.
  g = f;
  g.header = journal::make_header("model: {hidden_size: 1}\n", 1);
  write_bytes(path, journal::serialize(g));
  out = replay_exe(path);
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_THAT(out.out, HasSubstr("the header's config is invalid"));
  // Divergence.
  g = f;
  engine_status other;
  other.connection = 1;
  g.entries[1].elements = encode(caf::make_message(other));
  write_bytes(path, journal::serialize(g));
  out = replay_exe(path);
  EXPECT_EQ(out.exit_code, 1) << out.out;
  EXPECT_THAT(out.out, HasSubstr("diverged: first difference at seq 2"));
  // No such file; no argument.
  out = replay_exe(path + ".missing");
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_THAT(out.out, HasSubstr("cannot open"));
  out = run_command(std::string(REFIT_REPLAY_EXE) + " 2>&1");
  EXPECT_EQ(out.exit_code, 2) << out.out;
  std::remove(path.c_str());
  // Not a regular file: refused at once (refit-replay /dev/zero used to grow without bound),
  // and a directory is named as one.
  out = replay_exe("/dev/zero");
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_THAT(out.out, HasSubstr("journal '/dev/zero': is a character device, not a regular file"));
  out = replay_exe("/tmp");
  EXPECT_EQ(out.exit_code, 2) << out.out;
  EXPECT_THAT(out.out, HasSubstr("journal '/tmp': is a directory"));
}

TEST(ReplayJournal, AJournalOverTheSizeCapIsRefusedUnread) {
  const auto path = temp_path("huge");
  { std::ofstream(path).close(); }
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(5ull << 30)), 0); // sparse 5 GiB
  try {
    journal::read_file(path);
    ADD_FAILURE() << "read a 5 GiB journal";
  } catch (const journal::journal_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("has 5368709120 bytes, more than the 4294967296-byte cap"));
  }
  std::remove(path.c_str());
}

} // namespace
