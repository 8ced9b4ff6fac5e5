#include "runtime/journal/journal_file.hpp"

#include "runtime/fileio/read_file.hpp"

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "messages/journal.pb.h"
#include "runtime/model/digest.hpp"

namespace refit::journal {

namespace pb = refit::journal::v1;

namespace {

std::string frame(const pb::Record& rec) {
  std::string body;
  rec.SerializeToString(&body);
  std::string out;
  std::uint64_t n = body.size();
  while (n >= 0x80) {
    out.push_back(static_cast<char>((n & 0x7F) | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
  return out + body;
}

pb::Record to_proto(const header& h) {
  pb::Record rec;
  auto* p = rec.mutable_header();
  p->set_format_version(h.format_version);
  p->set_config_yaml(h.config_yaml);
  p->set_config_digest(h.config_digest);
  p->set_seed(h.seed);
  p->set_writer(h.writer);
  return rec;
}

pb::Record to_proto(const entry& e) {
  pb::Record rec;
  auto* p = rec.mutable_entry();
  p->set_seq(e.seq);
  p->set_kind(static_cast<pb::Kind>(e.k));
  p->set_actor(e.actor);
  p->set_type(e.type);
  p->set_peer(e.peer);
  p->set_message_id(e.message_id);
  for (const auto& x : e.elements) {
    auto* el = p->add_elements();
    el->set_type(x.type);
    el->set_data(x.data);
  }
  return rec;
}

const char* const journaled_actors[] = {"SyncCoordinator", "ConsensusGate", "RolloutEngine"};

// Parsing state: where we are, for error messages.
struct cursor {
  const std::string& origin;
  const std::string& bytes;
  std::size_t pos = 0;
  std::size_t record_start = 0;
  std::uint64_t seq = 0; // of the record being read, once known

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    std::string where = seq != 0 ? "entry seq " + std::to_string(seq)
                                 : (record_start == 0 ? std::string("header")
                                                      : std::string("record"));
    where += " at byte offset " + std::to_string(record_start);
    if (!field.empty())
      where += ": field '" + field + "'";
    throw journal_error(origin + ": " + where + ": " + problem, record_start, seq, field);
  }
};

// The length prefix of the record at c.pos (c.record_start = c.pos).
std::uint64_t read_length(cursor& c) {
  std::uint64_t n = 0;
  for (int shift = 0;; shift += 7) {
    if (c.pos >= c.bytes.size())
      c.fail("", "truncated: the file ends inside a record's length prefix");
    if (shift > 28)
      c.fail("", "the length prefix is longer than 5 bytes (not a journal, or corrupt)");
    auto b = static_cast<std::uint8_t>(c.bytes[c.pos++]);
    n |= static_cast<std::uint64_t>(b & 0x7F) << shift;
    if ((b & 0x80) == 0)
      break;
  }
  if (n > max_record_bytes)
    c.fail("", "record length " + std::to_string(n) + " exceeds the limit of "
                 + std::to_string(max_record_bytes) + " bytes (not a journal, or corrupt)");
  if (n > c.bytes.size() - c.pos)
    c.fail("", "truncated: the record needs " + std::to_string(n) + " bytes, only "
                 + std::to_string(c.bytes.size() - c.pos) + " remain");
  return n;
}

entry from_proto(const pb::Entry& p, cursor& c, std::uint64_t previous_seq) {
  entry e;
  e.seq = p.seq();
  c.seq = e.seq;
  if (e.seq == 0)
    c.fail("seq", "is 0 (sequence numbers start at 1)");
  if (e.seq <= previous_seq)
    c.fail("seq", "is not above the previous entry's seq " + std::to_string(previous_seq));
  auto k = static_cast<int>(p.kind());
  if (k <= 0 || k > max_kind)
    c.fail("kind", "unknown kind " + std::to_string(k));
  e.k = static_cast<kind>(k);
  e.actor = p.actor();
  bool known = false;
  for (const char* a : journaled_actors)
    known = known || e.actor == a;
  if (!known)
    c.fail("actor", "'" + e.actor + "' is not a journaled actor (SyncCoordinator, ConsensusGate, "
                                    "RolloutEngine)");
  e.type = p.type();
  if (e.type.empty())
    c.fail("type", "is empty");
  e.peer = p.peer();
  if ((is_processed(e.k) || e.k == kind::output_send || e.k == kind::output_reply)
      && e.peer.empty())
    c.fail("peer", "is empty for a " + std::string(to_string(e.k)) + " entry");
  e.message_id = p.message_id();
  for (int i = 0; i < p.elements_size(); ++i) {
    const auto& el = p.elements(i);
    auto field = "elements[" + std::to_string(i) + "].type";
    if (!known_element_type(el.type()))
      c.fail(field, "unknown element type '" + el.type().substr(0, 64) + "'");
    e.elements.push_back({el.type(), el.data()});
  }
  if (is_processed(e.k) && e.elements.empty())
    c.fail("elements", "a processed message has no elements");
  return e;
}

class file_recorder final : public recorder {
public:
  file_recorder(const std::string& path, const header& h) : path_(path) {
    out_.open(path, std::ios::binary | std::ios::trunc);
    if (!out_)
      throw std::runtime_error("cannot open journal file '" + path + "' for writing: "
                               + std::strerror(errno));
    pending_.push_back(frame(to_proto(h)));
    thread_ = std::thread([this] { run(); });
  }

  ~file_recorder() override {
    {
      std::lock_guard<std::mutex> guard(qmtx_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void flush() override {
    std::unique_lock<std::mutex> lock(qmtx_);
    auto target = queued_;
    done_cv_.wait(lock, [&] { return written_ >= target || failed_; });
  }

  std::uint64_t entries() const override {
    std::lock_guard<std::mutex> guard(qmtx_);
    return queued_;
  }

protected:
  void emit(entry e) override {
    auto bytes = frame(to_proto(e));
    {
      std::lock_guard<std::mutex> guard(qmtx_);
      pending_.push_back(std::move(bytes));
      ++queued_;
    }
    cv_.notify_all();
  }

private:
  void run() {
    for (;;) {
      std::deque<std::string> batch;
      bool stop = false;
      std::uint64_t count = 0;
      {
        std::unique_lock<std::mutex> lock(qmtx_);
        cv_.wait(lock, [this] { return stop_ || !pending_.empty(); });
        batch.swap(pending_);
        stop = stop_;
        count = queued_;
      }
      for (const auto& b : batch)
        out_.write(b.data(), static_cast<std::streamsize>(b.size()));
      out_.flush();
      {
        std::lock_guard<std::mutex> guard(qmtx_);
        failed_ = failed_ || !out_;
        written_ = count;
      }
      done_cv_.notify_all();
      if (stop)
        return;
    }
  }

  std::string path_;
  std::ofstream out_;
  mutable std::mutex qmtx_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  std::deque<std::string> pending_;
  std::uint64_t queued_ = 0;  // entries handed to the writer
  std::uint64_t written_ = 0; // entries written and flushed
  bool failed_ = false;
  bool stop_ = false;
  std::thread thread_; // last: started after the other members exist
};

} // namespace

recorder::~recorder() = default;

std::string serialize(const header& h) {
  return frame(to_proto(h));
}

std::string serialize(const entry& e) {
  return frame(to_proto(e));
}

std::string serialize(const file& f) {
  std::string out = serialize(f.header);
  for (const auto& e : f.entries)
    out += serialize(e);
  return out;
}

header make_header(const std::string& config_yaml, std::uint64_t seed) {
  header h;
  h.config_yaml = config_yaml;
  h.config_digest = model::sha256_hex(config_yaml.data(), config_yaml.size());
  h.seed = seed;
  h.writer = "refit 0.1.0";
  return h;
}

file parse(const std::string& bytes, const std::string& origin) {
  file out;
  cursor c{origin, bytes};
  if (bytes.empty())
    c.fail("", "the file is empty (no journal header)");
  bool have_header = false;
  std::uint64_t previous_seq = 0;
  while (c.pos < bytes.size()) {
    c.record_start = c.pos;
    c.seq = 0;
    auto n = read_length(c);
    pb::Record rec;
    if (!rec.ParseFromArray(bytes.data() + c.pos, static_cast<int>(n)))
      c.fail("", "the record does not parse as refit.journal.v1.Record");
    c.pos += n;
    if (rec.has_header()) {
      if (have_header)
        c.fail("header", "a second header");
      const auto& h = rec.header();
      if (h.format_version() != format_version)
        c.fail("format_version", "unsupported journal format version "
                                   + std::to_string(h.format_version()) + " (this reader reads "
                                   + std::to_string(format_version) + ")");
      auto digest = model::sha256_hex(h.config_yaml().data(), h.config_yaml().size());
      if (h.config_digest() != digest)
        c.fail("config_digest", "does not match the SHA-256 of config_yaml (the config text was "
                                "changed or damaged)");
      out.header.format_version = h.format_version();
      out.header.config_yaml = h.config_yaml();
      out.header.config_digest = h.config_digest();
      out.header.seed = h.seed();
      out.header.writer = h.writer();
      have_header = true;
    } else if (rec.has_entry()) {
      if (!have_header)
        c.fail("", "an entry before the journal header");
      out.entries.push_back(from_proto(rec.entry(), c, previous_seq));
      previous_seq = out.entries.back().seq;
    } else {
      c.fail("", "the record holds neither a header nor an entry");
    }
  }
  return out;
}

file read_file(const std::string& path) {
  std::string text;
  try {
    text = fileio::read_regular_file(path, fileio::max_journal_bytes, "journal");
  } catch (const fileio::file_error& e) {
    throw journal_error(e.what(), 0, 0, "");
  }
  return parse(text, path);
}

std::shared_ptr<recorder> record_to_file(const std::string& path, const header& h) {
  return std::make_shared<file_recorder>(path, h);
}

} // namespace refit::journal
