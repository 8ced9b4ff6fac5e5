// The BPE model of a byte-level tokenizer.json: vocabulary, merges by rank, and the merge of
// one pre-token piece (its raw bytes; each byte starts as the token of its ByteLevel code
// point). Merging is HF's: repeatedly the lowest-rank adjacent pair, leftmost first, through
// a priority queue over a linked list of symbols. Results are cached per piece.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "runtime/tokenizer/json_file.hpp"

namespace refit::tokenizer {

class bpe_model {
public:
  // Reads tokenizer.json's "model" object (type BPE). Refuses what it does not implement.
  explicit bpe_model(const json_node& model);
  bpe_model(bpe_model&& other) noexcept;

  // Appends the ids of one piece (raw bytes) to `out`.
  void encode_piece(std::string_view bytes, std::vector<std::int32_t>& out) const;

  const std::unordered_map<std::string, std::int32_t>& vocab() const { return vocab_; }
  std::int32_t max_id() const { return max_id_; }

private:
  struct merge {
    std::uint64_t key = 0; // (left << 32) | right, 0 = empty slot (ids are < 2^31)
    std::uint32_t rank = 0;
    std::int32_t new_id = 0;
  };
  void add_merge(std::int32_t a, std::int32_t b, std::uint32_t rank, std::int32_t new_id);
  const merge* find_merge(std::int32_t a, std::int32_t b) const;
  void merge_word(std::string_view bytes, std::vector<std::int32_t>& out) const;

  std::unordered_map<std::string, std::int32_t> vocab_;
  std::int32_t max_id_ = -1;
  std::int32_t byte_ids_[256];
  bool ignore_merges_ = false;
  std::vector<merge> table_; // open addressing, power-of-two size
  std::uint64_t mask_ = 0;

  static constexpr std::size_t cache_capacity = 1u << 17;
  static constexpr std::size_t cache_max_piece = 256;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>> cache_;
};

} // namespace refit::tokenizer
