// Block bookkeeping of a worker's KV arena and its prefix cache (pure C++).
//
// The arena (the worker's KV region of kv_cache_bytes) is cut into `capacity` blocks of
// kv_geometry::block_bytes(). Blocks are reference counted: a sequence holds a reference to
// every block of its block table; samples of one prompt share the prompt's full blocks.
//
// Prefix cache: full blocks of prompts are registered under the exact token chain that
// produced them (key: the entry of the previous block + this block's tokens), so a later
// prompt reuses the longest cached chain of full blocks. Cached blocks whose reference count
// drops to zero stay cached and are evicted least-recently-released first (a sequence releases
// its deepest blocks first) when the arena needs room. Entry ids are never reused, so an
// evicted parent can never make a stale child reachable again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <utility>
#include <vector>

namespace refit::inference {

class block_pool {
public:
  block_pool(std::uint32_t capacity, std::uint32_t block_size);

  std::uint32_t capacity() const { return capacity_; }
  std::uint32_t block_size() const { return block_size_; }
  // Blocks an allocation can get now: free ones plus unreferenced cached ones.
  std::uint32_t available() const;

  // A block with reference count 1 (evicts the least recently released cached block when
  // no free block is left). Throws std::logic_error when every block is referenced.
  std::uint32_t allocate();
  void retain(std::uint32_t block);
  void release(std::uint32_t block);
  std::uint32_t refcount(std::uint32_t block) const { return refs_.at(block); }

  // The blocks (retained for the caller) of the longest cached chain of full blocks that
  // prefixes tokens[0 .. max_blocks * block_size).
  std::vector<std::uint32_t> match_prefix(const std::int32_t* tokens, std::size_t max_blocks);
  // Registers the first `full_blocks` blocks of a prompt whose KV is computed (tokens holds at
  // least full_blocks * block_size ids). Chains already cached keep their block; ours then
  // stays private.
  void insert_prefix(const std::int32_t* tokens, std::size_t full_blocks,
                     const std::vector<std::uint32_t>& blocks);
  // Drops every entry (unreferenced cached blocks become free); returns how many.
  std::uint64_t clear_prefix_cache();
  std::uint64_t prefix_entries() const { return entries_.size(); }
  std::uint64_t evictions() const { return evictions_; }

private:
  using key = std::pair<std::uint64_t, std::vector<std::int32_t>>; // (parent entry id, tokens)
  struct entry {
    std::uint64_t id = 0;
    std::uint32_t block = 0;
  };
  using entry_map = std::map<key, entry>;

  void check(std::uint32_t block, const char* what) const;
  void uncache(std::uint32_t block);

  const std::uint32_t capacity_;
  const std::uint32_t block_size_;
  std::vector<std::uint32_t> refs_;
  std::vector<std::uint32_t> free_;                   // stack of free blocks
  std::list<std::uint32_t> lru_;                      // unreferenced cached blocks, oldest first
  std::vector<std::list<std::uint32_t>::iterator> lru_pos_;
  std::vector<bool> in_lru_;
  entry_map entries_;
  std::vector<entry_map::iterator> entry_of_;         // per block; entries_.end() if uncached
  std::uint64_t next_entry_id_ = 1;                   // 0 is the root
  std::uint64_t evictions_ = 0;
};

} // namespace refit::inference
