// Journal files (messages/journal.proto): a stream of records, each a base-128 varint byte
// count and one serialized refit.journal.v1.Record; first one Header, then Entries with
// strictly increasing seq. The recorder writes them on a thread it owns; the reader treats the
// file as untrusted input and names the byte offset, the entry's seq and the field of the
// first problem.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/journal/journal.hpp"

namespace refit::journal {

constexpr std::uint32_t format_version = 7; // 2: rank_info.pid, publication_header.producer_pids;
                                            // 3: rank_info.weight_source, publication_spec.tp /
                                            //    verify, rank_report.digest_terms
                                            // 4: generate_result.stats, score_request /
                                            //    score_result
                                            // 5: the direct mode in publication_spec /
                                            //    rank_report / publication_result, the
                                            //    engine's counters in generation_stats
                                            // 6: generation_stats.decode_steps_ahead /
                                            //    decode_rows_dropped (pipelined decode)
                                            // 7: generation_stats.preload_gemms
// Upper bound of one record (a rank report or chunk of a large model stays far below).
constexpr std::uint64_t max_record_bytes = 64u << 20;

struct header {
  std::uint32_t format_version = journal::format_version;
  std::string config_yaml;
  std::string config_digest; // hex SHA-256 of config_yaml
  std::uint64_t seed = 0;
  std::string writer;
};

struct file {
  journal::header header;
  std::vector<entry> entries;
};

// A malformed journal. what() is "<origin>: <where>: <problem>", where names the record
// (header, or the entry's seq when it could be read) and its byte offset.
struct journal_error : std::runtime_error {
  journal_error(const std::string& what, std::uint64_t offset, std::uint64_t seq,
                std::string field)
    : std::runtime_error(what), offset(offset), seq(seq), field(std::move(field)) {}
  std::uint64_t offset; // of the record's length prefix
  std::uint64_t seq;    // 0: header or not known
  std::string field;    // "" when the record as a whole is bad
};

// Parses a whole journal (throws journal_error).
file parse(const std::string& bytes, const std::string& origin = "<journal>");
file read_file(const std::string& path);

// Serializes a journal (the writer's format; used by tests that tamper with one).
std::string serialize(const file& f);
std::string serialize(const header& h);
std::string serialize(const entry& e);

// A header for `config_yaml` (digest computed).
header make_header(const std::string& config_yaml, std::uint64_t seed);

// A sink that appends every entry to `path` (truncated first) on a writer thread it owns.
class recorder : public sink {
public:
  ~recorder() override;
  // Blocks until everything journaled so far is written and flushed.
  virtual void flush() = 0;
  // Entries journaled so far.
  virtual std::uint64_t entries() const = 0;
};

// Opens `path` for writing and writes `h`. Throws std::runtime_error naming the path.
std::shared_ptr<recorder> record_to_file(const std::string& path, const header& h);

} // namespace refit::journal
