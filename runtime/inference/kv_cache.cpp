#include "runtime/inference/kv_cache.hpp"

#include <stdexcept>
#include <string>

namespace refit::inference {

block_pool::block_pool(std::uint32_t capacity, std::uint32_t block_size)
  : capacity_(capacity), block_size_(block_size), refs_(capacity, 0), lru_pos_(capacity),
    in_lru_(capacity, false), entry_of_(capacity, entries_.end()) {
  if (block_size == 0)
    throw std::invalid_argument("block_pool: block_size must be >= 1");
  free_.reserve(capacity);
  for (std::uint32_t b = capacity; b > 0; --b)
    free_.push_back(b - 1); // block 0 is handed out first
}

std::uint32_t block_pool::available() const {
  return static_cast<std::uint32_t>(free_.size() + lru_.size());
}

void block_pool::check(std::uint32_t block, const char* what) const {
  if (block >= capacity_)
    throw std::logic_error(std::string("block_pool::") + what + ": block "
                           + std::to_string(block) + " out of range "
                           + std::to_string(capacity_));
}

void block_pool::uncache(std::uint32_t block) {
  auto it = entry_of_[block];
  if (it == entries_.end())
    return;
  entries_.erase(it);
  entry_of_[block] = entries_.end();
}

std::uint32_t block_pool::allocate() {
  std::uint32_t block;
  if (!free_.empty()) {
    block = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    block = lru_.front();
    lru_.pop_front();
    in_lru_[block] = false;
    uncache(block);
    ++evictions_;
  } else {
    throw std::logic_error("block_pool: all " + std::to_string(capacity_)
                           + " KV blocks are in use");
  }
  refs_[block] = 1;
  return block;
}

void block_pool::retain(std::uint32_t block) {
  check(block, "retain");
  if (refs_[block] == 0) {
    if (!in_lru_[block])
      throw std::logic_error("block_pool::retain: block " + std::to_string(block)
                             + " is free");
    lru_.erase(lru_pos_[block]);
    in_lru_[block] = false;
  }
  ++refs_[block];
}

void block_pool::release(std::uint32_t block) {
  check(block, "release");
  if (refs_[block] == 0)
    throw std::logic_error("block_pool::release: block " + std::to_string(block)
                           + " is not referenced");
  if (--refs_[block] != 0)
    return;
  if (entry_of_[block] != entries_.end()) {
    lru_pos_[block] = lru_.insert(lru_.end(), block);
    in_lru_[block] = true;
  } else {
    free_.push_back(block);
  }
}

std::vector<std::uint32_t> block_pool::match_prefix(const std::int32_t* tokens,
                                                    std::size_t max_blocks) {
  std::vector<std::uint32_t> blocks;
  std::uint64_t parent = 0;
  for (std::size_t b = 0; b < max_blocks; ++b) {
    const std::int32_t* first = tokens + b * block_size_;
    auto found = entries_.find(key{parent, std::vector<std::int32_t>(first, first + block_size_)});
    if (found == entries_.end())
      break;
    retain(found->second.block);
    blocks.push_back(found->second.block);
    parent = found->second.id;
  }
  return blocks;
}

void block_pool::insert_prefix(const std::int32_t* tokens, std::size_t full_blocks,
                               const std::vector<std::uint32_t>& blocks) {
  if (full_blocks > blocks.size())
    throw std::logic_error("block_pool::insert_prefix: more full blocks than blocks");
  std::uint64_t parent = 0;
  for (std::size_t b = 0; b < full_blocks; ++b) {
    const std::int32_t* first = tokens + b * block_size_;
    key k{parent, std::vector<std::int32_t>(first, first + block_size_)};
    auto found = entries_.find(k);
    if (found != entries_.end()) {
      parent = found->second.id;
      continue;
    }
    const std::uint32_t block = blocks[b];
    check(block, "insert_prefix");
    if (entry_of_[block] != entries_.end())
      break; // the block is cached under another chain (cannot happen for computed blocks)
    const entry e{next_entry_id_++, block};
    entry_of_[block] = entries_.emplace(std::move(k), e).first;
    parent = e.id;
  }
}

std::uint64_t block_pool::clear_prefix_cache() {
  const std::uint64_t dropped = entries_.size();
  for (std::uint32_t block : lru_) {
    in_lru_[block] = false;
    free_.push_back(block);
  }
  lru_.clear();
  entries_.clear();
  for (auto& it : entry_of_)
    it = entries_.end();
  return dropped;
}

} // namespace refit::inference
