#include "runtime/tokenizer/bpe.hpp"

#include <cstdint>
#include <algorithm>
#include <queue>

#include "runtime/tokenizer/byte_level.hpp"

namespace refit::tokenizer {

namespace {

std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
         static_cast<std::uint32_t>(b) | (1ull << 63); // the high bit keeps 0 free as "empty"
}

std::uint64_t mix(std::uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  return k;
}

void refuse_non_default(const json_node& model, const char* key, const char* what) {
  auto n = model.find(key);
  if (!n)
    return;
  const auto& v = n->value();
  bool is_default = (v.is_string() && v.get_ref<const std::string&>().empty()) ||
                    (v.is_boolean() && !v.get<bool>());
  if (!is_default)
    n->fail(std::string("unsupported ") + what + " (only the default is implemented)");
}

} // namespace

bpe_model::bpe_model(const json_node& model) {
  const auto& type = model.at("type").str();
  if (type != "BPE")
    model.at("type").fail("unsupported model type '" + type + "' (only BPE is implemented)");
  if (auto d = model.find("dropout"))
    d->fail("unsupported BPE dropout (must be null)");
  if (auto u = model.find("unk_token"))
    u->fail("unsupported unk_token (must be null)");
  refuse_non_default(model, "continuing_subword_prefix", "continuing_subword_prefix");
  refuse_non_default(model, "end_of_word_suffix", "end_of_word_suffix");
  refuse_non_default(model, "byte_fallback", "byte_fallback");
  ignore_merges_ = model.flag("ignore_merges", false);
  (void)model.flag("fuse_unk", false); // only meaningful with unk_token

  auto vocab = model.at("vocab");
  if (!vocab.is_object())
    vocab.fail("expected an object {token: id}");
  std::unordered_map<std::int32_t, const std::string*> seen;
  vocab_.reserve(vocab.size());
  for (auto it = vocab.value().begin(); it != vocab.value().end(); ++it) {
    json_node idn(it.value(), vocab.path() + "." + it.key(), vocab.file());
    auto id = idn.integer();
    if (id < 0 || id > max_token_id)
      idn.fail("token id " + std::to_string(id) + " is out of range [0, "
               + std::to_string(max_token_id) + "]");
    auto [pos, fresh] = seen.emplace(static_cast<std::int32_t>(id), &it.key());
    if (!fresh)
      idn.fail("id " + std::to_string(id) + " also belongs to token '" + *pos->second + "'");
    vocab_.emplace(it.key(), static_cast<std::int32_t>(id));
    max_id_ = std::max(max_id_, static_cast<std::int32_t>(id));
  }
  const auto& alphabet = byte_level_alphabet::get();
  for (int b = 0; b < 256; ++b) {
    auto f = vocab_.find(alphabet.utf8(static_cast<unsigned char>(b)));
    byte_ids_[b] = f == vocab_.end() ? -1 : f->second;
  }

  auto merges = model.at("merges");
  if (!merges.is_array())
    merges.fail("expected an array of merges");
  const std::size_t n = merges.size();
  std::size_t cap = 16;
  while (cap < n * 2 + 16)
    cap <<= 1;
  table_.assign(cap, merge{});
  mask_ = cap - 1;
  bool pairs = n > 0 && merges.value()[0].is_array();
  auto lookup = [&](const json_node& where, const std::string& tok) {
    auto f = vocab_.find(tok);
    if (f == vocab_.end())
      where.fail("merge names token '" + tok + "' that is not in model.vocab");
    return f->second;
  };
  for (std::size_t r = 0; r < n; ++r) {
    auto m = merges.at(r);
    std::string a, b;
    if (pairs) {
      if (!m.is_array() || m.size() != 2)
        m.fail("expected a pair [\"a\", \"b\"] like the first merge");
      a = m.at(std::size_t{0}).str();
      b = m.at(std::size_t{1}).str();
    } else {
      if (!m.is_string())
        m.fail("expected a string \"a b\" like the first merge");
      const auto& s = m.str();
      auto sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        m.fail("a merge string must be two tokens separated by one space");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    }
    auto ia = lookup(m, a);
    auto ib = lookup(m, b);
    auto inew = lookup(m, a + b);
    add_merge(ia, ib, static_cast<std::uint32_t>(r), inew);
  }
}

bpe_model::bpe_model(bpe_model&& o) noexcept
    : vocab_(std::move(o.vocab_)), max_id_(o.max_id_), ignore_merges_(o.ignore_merges_),
      table_(std::move(o.table_)), mask_(o.mask_), cache_(std::move(o.cache_)) {
  std::copy(std::begin(o.byte_ids_), std::end(o.byte_ids_), byte_ids_);
}

void bpe_model::add_merge(std::int32_t a, std::int32_t b, std::uint32_t rank,
                          std::int32_t new_id) {
  auto key = pair_key(a, b);
  for (auto i = mix(key) & mask_;; i = (i + 1) & mask_) {
    if (table_[i].key == 0 || table_[i].key == key) {
      table_[i] = merge{key, rank, new_id}; // a repeated pair keeps its last rank, as in HF
      return;
    }
  }
}

const bpe_model::merge* bpe_model::find_merge(std::int32_t a, std::int32_t b) const {
  auto key = pair_key(a, b);
  for (auto i = mix(key) & mask_;; i = (i + 1) & mask_) {
    if (table_[i].key == key)
      return &table_[i];
    if (table_[i].key == 0)
      return nullptr;
  }
}

void bpe_model::encode_piece(std::string_view bytes, std::vector<std::int32_t>& out) const {
  if (bytes.empty())
    return;
  if (bytes.size() == 1) {
    auto id = byte_ids_[static_cast<unsigned char>(bytes[0])];
    if (id >= 0)
      out.push_back(id);
    return;
  }
  const bool cacheable = bytes.size() <= cache_max_piece;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(std::string(bytes));
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const auto mark = out.size();
  if (ignore_merges_) {
    auto it = vocab_.find(byte_level_alphabet::get().encode(bytes));
    if (it != vocab_.end())
      out.push_back(it->second);
    else
      merge_word(bytes, out);
  } else {
    merge_word(bytes, out);
  }
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() < cache_capacity)
      cache_.emplace(std::string(bytes),
                     std::vector<std::int32_t>(out.begin() + static_cast<long>(mark), out.end()));
  }
}

void bpe_model::merge_word(std::string_view bytes, std::vector<std::int32_t>& out) const {
  struct symbol {
    std::int32_t id;
    std::int32_t prev, next; // -1 at the ends
    bool alive;
  };
  struct candidate {
    std::uint32_t rank;
    std::int32_t pos;
    std::int32_t new_id;
    bool operator>(const candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  thread_local std::vector<symbol> sym;
  thread_local std::vector<candidate> heap_storage;
  sym.clear();
  for (unsigned char b : bytes) {
    auto id = byte_ids_[b];
    if (id < 0)
      continue; // no unk token: HF drops characters the vocabulary lacks
    auto i = static_cast<std::int32_t>(sym.size());
    sym.push_back(symbol{id, i - 1, -1, true});
    if (i > 0)
      sym[static_cast<std::size_t>(i - 1)].next = i;
  }
  heap_storage.clear();
  std::priority_queue<candidate, std::vector<candidate>, std::greater<candidate>> heap(
      std::greater<candidate>(), std::move(heap_storage));
  for (std::size_t i = 0; i + 1 < sym.size(); ++i)
    if (auto m = find_merge(sym[i].id, sym[i + 1].id))
      heap.push(candidate{m->rank, static_cast<std::int32_t>(i), m->new_id});
  while (!heap.empty()) {
    auto top = heap.top();
    heap.pop();
    auto& left = sym[static_cast<std::size_t>(top.pos)];
    if (!left.alive || left.next < 0)
      continue;
    auto& right = sym[static_cast<std::size_t>(left.next)];
    auto m = find_merge(left.id, right.id);
    if (!m || m->new_id != top.new_id)
      continue; // stale: the pair at this position changed since it was queued
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0)
      sym[static_cast<std::size_t>(right.next)].prev = top.pos;
    if (left.prev >= 0) {
      const auto& p = sym[static_cast<std::size_t>(left.prev)];
      if (auto pm = find_merge(p.id, left.id))
        heap.push(candidate{pm->rank, left.prev, pm->new_id});
    }
    if (left.next >= 0) {
      if (auto nm = find_merge(left.id, sym[static_cast<std::size_t>(left.next)].id))
        heap.push(candidate{nm->rank, top.pos, nm->new_id});
    }
  }
  for (std::int32_t i = sym.empty() ? -1 : 0; i >= 0; i = sym[static_cast<std::size_t>(i)].next)
    out.push_back(sym[static_cast<std::size_t>(i)].id);
}

} // namespace refit::tokenizer
