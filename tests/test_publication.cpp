// Tests of the publication building blocks: metadata-first chunk planning, dim-0 shards and
// the shard store, the in-process all-gather (including deadlines and abort) and the memfd
// host buffer transport (including a forked consumer and leak checks via /proc/self).
#include "model_configs.hpp"
#include "runtime/publication/chunk_plan.hpp"
#include "runtime/publication/collective.hpp"
#include "runtime/publication/host_buffer.hpp"
#include "runtime/publication/shard.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

using namespace refit::publication;
using refit::model::dtype;
using refit::model::model_config;
using refit::model::model_error;
using refit::model::param_meta;
using refit::model::synthetic_weights;

namespace {

using clock_type = std::chrono::steady_clock;
using namespace std::chrono_literals;

model_config tiny_config() {
  return refit::testing::tiny_model();
}

using refit::testing::qwen3_30b_a3b;

const synthetic_weights test_weights{7, 1e-3f, 0.02f};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::uint64_t align_up(std::uint64_t value, std::uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// Runs `f`, expecting a model_error; returns it (an empty error after a recorded failure).
template <class F>
model_error catch_model_error(F&& f) {
  try {
    f();
  } catch (const model_error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a model_error";
  return model_error("", "");
}

// Runs `f`, expecting a std::runtime_error; returns its message.
template <class F>
std::string runtime_error_message(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a std::runtime_error";
  return {};
}

bool all_zero(const std::byte* data, std::uint64_t size) {
  return std::all_of(data, data + size, [](std::byte b) { return b == std::byte{0}; });
}

// Checks every structural promise of a plan against the key stream it was made from.
void check_plan(const chunk_plan& plan, const std::vector<param_meta>& expected,
                std::uint64_t buffer_bytes, std::uint32_t world) {
  SCOPED_TRACE("buffer " + std::to_string(buffer_bytes) + " world " + std::to_string(world));
  EXPECT_EQ(plan.buffer_bytes, buffer_bytes);
  EXPECT_EQ(plan.tensor_count, expected.size());
  std::size_t next = 0;
  std::uint64_t total = 0;
  std::uint64_t largest_tensor = 0;
  std::uint64_t largest_slot = 0;
  for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
    const auto& ch = plan.chunks[c];
    EXPECT_EQ(ch.index, c);
    ASSERT_FALSE(ch.tensors.empty()) << "chunk " << c;
    EXPECT_EQ(ch.tensors.front().offset, 0u) << "chunk " << c;
    std::uint64_t end = 0;
    for (const auto& t : ch.tensors) {
      ASSERT_LT(next, expected.size());
      EXPECT_EQ(t.meta, expected[next]) << "chunk " << c << " tensor " << t.meta.name;
      ++next;
      EXPECT_EQ(t.offset % slot_alignment, 0u) << t.meta.name;
      EXPECT_GE(t.offset, end) << t.meta.name << " overlaps the previous slot";
      EXPECT_EQ(t.slot_bytes, world * shard_of(t.meta, world, 0).padded_bytes()) << t.meta.name;
      EXPECT_GE(t.slot_bytes, t.meta.nbytes()) << t.meta.name;
      EXPECT_LE(t.offset + t.slot_bytes, buffer_bytes) << t.meta.name;
      end = t.offset + t.slot_bytes;
      total += t.meta.nbytes();
      largest_tensor = std::max(largest_tensor, t.meta.nbytes());
      largest_slot = std::max(largest_slot, t.slot_bytes);
    }
    EXPECT_EQ(ch.bytes_used, end) << "chunk " << c;
    // Greedy: a chunk is closed only when the next slot would not have fit.
    if (c + 1 < plan.chunks.size()) {
      const std::uint64_t next_slot = plan.chunks[c + 1].tensors.front().slot_bytes;
      EXPECT_GT(align_up(ch.bytes_used, slot_alignment) + next_slot, buffer_bytes)
          << "chunk " << c << " was closed early";
    }
  }
  EXPECT_EQ(next, expected.size()) << "every tensor must appear exactly once";
  EXPECT_EQ(plan.total_tensor_bytes, total);
  EXPECT_EQ(plan.largest_tensor_bytes, largest_tensor);
  EXPECT_EQ(plan.largest_slot_bytes, largest_slot);
}

// One thread per rank; returns each rank's status.
std::vector<collective_status> run_ranks(std::uint32_t world,
                                         const std::function<collective_status(std::uint32_t)>& f) {
  std::vector<collective_status> statuses(world);
  std::vector<std::thread> threads;
  for (std::uint32_t r = 0; r < world; ++r)
    threads.emplace_back([&, r] { statuses[r] = f(r); });
  for (auto& t : threads)
    t.join();
  return statuses;
}

// Gather items of one chunk for one rank: outputs at the planned slots of `buffer`.
std::vector<gather_item> chunk_items(const chunk& ch, const shard_store& store, std::byte* buffer) {
  std::vector<gather_item> items;
  for (const auto& t : ch.tensors) {
    const std::size_t i = store.index_of(t.meta.name);
    items.push_back({store.data(i), store.spec(i).padded_bytes(), buffer + t.offset});
  }
  return items;
}

// Every rank's gathered chunk must hold each full tensor followed by zero padding.
void expect_chunk_gathered(const chunk& ch, const std::vector<std::vector<std::byte>>& buffers,
                           std::uint64_t step) {
  for (const auto& t : ch.tensors) {
    const auto full = full_tensor(t.meta, test_weights, step);
    for (std::size_t r = 0; r < buffers.size(); ++r) {
      const std::byte* slot = buffers[r].data() + t.offset;
      EXPECT_EQ(std::memcmp(slot, full.data(), full.size()), 0)
          << t.meta.name << " gathered on rank " << r;
      EXPECT_TRUE(all_zero(slot + full.size(), t.slot_bytes - full.size()))
          << t.meta.name << " padding on rank " << r;
    }
  }
}

struct tiny_ranks {
  std::vector<param_meta> params;
  std::vector<std::unique_ptr<shard_store>> stores;
  std::vector<std::vector<std::byte>> buffers;

  tiny_ranks(std::uint32_t world, std::uint64_t buffer_bytes)
    : params(refit::model::expected_key_stream(tiny_config())), buffers(world) {
    for (std::uint32_t r = 0; r < world; ++r) {
      stores.push_back(std::make_unique<shard_store>(params, world, r, test_weights));
      buffers[r].assign(buffer_bytes, std::byte{0xAB});
    }
  }
};

// One item gathering `shard` into `out`, for the error-path tests.
std::vector<gather_item> single_item(const std::vector<std::byte>& shard, std::vector<std::byte>& out) {
  return {{shard.data(), shard.size(), out.data()}};
}

std::set<std::string> open_fds() {
  std::set<std::string> fds;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd"))
    fds.insert(entry.path().filename().string());
  return fds;
}

std::size_t buffer_mappings() {
  std::ifstream maps("/proc/self/maps");
  std::size_t count = 0;
  for (std::string line; std::getline(maps, line);)
    count += contains(line, "memfd:refit-buffer") ? 1 : 0;
  return count;
}

std::set<std::string> dev_shm_entries() {
  std::set<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec))
    names.insert(entry.path().filename().string());
  return names;
}

void fill_pattern(std::byte* data, std::uint64_t size, std::uint8_t seed) {
  for (std::uint64_t i = 0; i < size; ++i)
    data[i] = static_cast<std::byte>((i * 131 + seed) & 0xFF);
}

bool has_pattern(const std::byte* data, std::uint64_t size, std::uint8_t seed) {
  for (std::uint64_t i = 0; i < size; ++i)
    if (data[i] != static_cast<std::byte>((i * 131 + seed) & 0xFF))
      return false;
  return true;
}

} // namespace

// ---------------------------------------------------------------------------------------
// Chunk planning
// ---------------------------------------------------------------------------------------

TEST(ChunkPlan, TinyModelEveryTensorOnceInOrderForManyBuffersAndWorlds) {
  const auto expected = refit::model::expected_key_stream(tiny_config());
  // embed_tokens over world 3 needs 3 * 86 rows * 128 bytes = 33024 bytes.
  for (std::uint64_t buffer : {33024ull, 40000ull, 64ull << 10, (100ull << 10) + 7, 4ull << 20}) {
    for (std::uint32_t world : {1u, 2u, 3u}) {
      const auto plan = plan_chunks(expected, buffer, world);
      check_plan(plan, expected, buffer, world);
    }
  }
}

TEST(ChunkPlan, SmallerBuffersNeedMoreChunksAndHugeBufferNeedsOne) {
  const auto expected = refit::model::expected_key_stream(tiny_config());
  const auto small = plan_chunks(expected, 40000, 2);
  const auto medium = plan_chunks(expected, 128 << 10, 2);
  const auto huge = plan_chunks(expected, 64 << 20, 2);
  EXPECT_GT(small.chunks.size(), medium.chunks.size());
  EXPECT_GT(medium.chunks.size(), 1u);
  EXPECT_EQ(huge.chunks.size(), 1u);
  EXPECT_EQ(huge.chunks[0].tensors.size(), expected.size());
}

TEST(ChunkPlan, TooSmallBufferThrowsNamingTensorAndBothSizes) {
  const auto expected = refit::model::expected_key_stream(tiny_config());
  const auto e = catch_model_error([&] { plan_chunks(expected, 16384, 1); });
  EXPECT_EQ(e.where, "model.embed_tokens.weight");
  EXPECT_TRUE(contains(e.what(), "32768")) << e.what(); // 256 x 64 bf16
  EXPECT_TRUE(contains(e.what(), "16384")) << e.what();
}

TEST(ChunkPlan, PaddingCountsTowardsTheSlot) {
  // 3 rows over world 2: 2 rows per rank, slot 4 rows although the tensor has 3.
  const std::vector<param_meta> expected{{"w", {3, 64}, dtype::bfloat16}};
  const auto plan = plan_chunks(expected, 1024, 2);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].tensors[0].slot_bytes, 4u * 128);
  EXPECT_EQ(plan.largest_slot_bytes, 512u);
  EXPECT_EQ(plan.largest_tensor_bytes, 384u);
  const auto e = catch_model_error([&] { plan_chunks(expected, 500, 2); });
  EXPECT_EQ(e.where, "w");
  EXPECT_TRUE(contains(e.what(), "512") && contains(e.what(), "500")) << e.what();
}

TEST(ChunkPlan, WorldZeroThrowsNamingTensor) {
  const auto expected = refit::model::expected_key_stream(tiny_config());
  const auto e = catch_model_error([&] { plan_chunks(expected, 1 << 20, 0); });
  EXPECT_EQ(e.where, "model.embed_tokens.weight");
  EXPECT_TRUE(contains(e.what(), "world 0")) << e.what();
}

TEST(ChunkPlan, EmptyInputYieldsNoChunks) {
  const auto plan = plan_chunks({}, 1 << 20, 2);
  EXPECT_TRUE(plan.chunks.empty());
  EXPECT_EQ(plan.tensor_count, 0u);
  EXPECT_EQ(plan.total_tensor_bytes, 0u);
  EXPECT_EQ(plan.buffer_bytes, 1u << 20);
}

TEST(ChunkPlan, Qwen3_30B_A3B_WithOneGiBBufferAndWorldTwo) {
  const auto expected = refit::model::expected_key_stream(qwen3_30b_a3b());
  ASSERT_EQ(expected.size(), 18867u);
  const std::uint64_t buffer = 1ull << 30;
  const auto started = clock_type::now();
  const auto plan = plan_chunks(expected, buffer, 2);
  const auto elapsed = clock_type::now() - started;
  // ~61 GB of payload: planning reads metadata only, so it is fast and allocates no payload.
  EXPECT_LT(elapsed, 2s);
  EXPECT_GT(plan.total_tensor_bytes, 60'000'000'000ull);
  EXPECT_EQ(plan.largest_tensor_bytes, 151936ull * 2048 * 2);
  check_plan(plan, expected, buffer, 2);

  std::uint64_t slot_total = 0;
  for (const auto& ch : plan.chunks)
    for (const auto& t : ch.tensors)
      slot_total += t.slot_bytes;
  const std::uint64_t lower = (slot_total + buffer - 1) / buffer;
  EXPECT_GE(plan.chunks.size(), lower);
  // Greedy: two neighbouring chunks together always overflow one buffer.
  EXPECT_LE(plan.chunks.size(), 2 * lower + 1);
  EXPECT_GE(plan.chunks.size(), 57u); // 61 GB / 1 GiB
  EXPECT_LE(plan.chunks.size(), 70u);
}

// ---------------------------------------------------------------------------------------
// Dim-0 shards
// ---------------------------------------------------------------------------------------

TEST(ShardOf, DivisibleRows) {
  const param_meta p{"w", {4, 8}, dtype::bfloat16};
  for (std::uint32_t rank = 0; rank < 2; ++rank) {
    const auto s = shard_of(p, 2, rank);
    EXPECT_EQ(s.row_bytes, 16u);
    EXPECT_EQ(s.rows_per_rank, 2u);
    EXPECT_EQ(s.row_begin, 2u * rank);
    EXPECT_EQ(s.real_rows, 2u);
    EXPECT_EQ(s.padded_bytes(), 32u);
    EXPECT_EQ(s.real_bytes(), 32u);
  }
}

TEST(ShardOf, NotDivisibleRowsPadTheLastRank) {
  const param_meta p{"w", {3, 4, 5}, dtype::float32};
  const auto r0 = shard_of(p, 2, 0);
  const auto r1 = shard_of(p, 2, 1);
  EXPECT_EQ(r0.row_bytes, 80u);
  EXPECT_EQ(r0.rows_per_rank, 2u);
  EXPECT_EQ(r0.real_rows, 2u);
  EXPECT_EQ(r1.rows_per_rank, 2u);
  EXPECT_EQ(r1.row_begin, 2u);
  EXPECT_EQ(r1.real_rows, 1u);
  EXPECT_EQ(r1.padded_bytes(), 160u);
  EXPECT_EQ(r1.real_bytes(), 80u);
}

TEST(ShardOf, OneDimensionalTensorShardsElements) {
  const param_meta p{"model.norm.weight", {5}, dtype::bfloat16};
  const auto r0 = shard_of(p, 2, 0);
  const auto r1 = shard_of(p, 2, 1);
  EXPECT_EQ(r0.row_bytes, 2u);
  EXPECT_EQ(r0.rows_per_rank, 3u);
  EXPECT_EQ(r0.real_rows, 3u);
  EXPECT_EQ(r1.row_begin, 3u);
  EXPECT_EQ(r1.real_rows, 2u);
  EXPECT_EQ(r1.padded_bytes(), 6u);
}

TEST(ShardOf, WorldLargerThanDim0LeavesARankWithoutRealRows) {
  const param_meta p{"w", {2, 3}, dtype::float16};
  const auto r2 = shard_of(p, 3, 2);
  EXPECT_EQ(r2.rows_per_rank, 1u);
  EXPECT_EQ(r2.row_begin, 2u);
  EXPECT_EQ(r2.real_rows, 0u);
  EXPECT_EQ(r2.real_bytes(), 0u);
  EXPECT_EQ(r2.padded_bytes(), 6u);
  EXPECT_EQ(shard_of(p, 5, 4).real_rows, 0u); // row_begin past dim0
  EXPECT_EQ(shard_of(p, 3, 1).real_rows, 1u);
}

TEST(ShardOf, RejectsBadWorldRankAndShape) {
  const param_meta p{"w", {4, 8}, dtype::bfloat16};
  auto e = catch_model_error([&] { shard_of(p, 0, 0); });
  EXPECT_EQ(e.where, "w");
  e = catch_model_error([&] { shard_of(p, 2, 2); });
  EXPECT_EQ(e.where, "w");
  EXPECT_TRUE(contains(e.what(), "rank 2") && contains(e.what(), "world 2")) << e.what();
  const param_meta negative{"neg", {4, -1}, dtype::bfloat16};
  e = catch_model_error([&] { shard_of(negative, 1, 0); });
  EXPECT_EQ(e.where, "neg");
}

// ---------------------------------------------------------------------------------------
// Shard store
// ---------------------------------------------------------------------------------------

TEST(ShardStore, ConcatenatedRealRowsEqualFullTensorAndPaddingIsZero) {
  const auto params = refit::model::expected_key_stream(tiny_config());
  for (std::uint32_t world : {1u, 2u, 3u}) {
    std::vector<std::unique_ptr<shard_store>> stores;
    for (std::uint32_t r = 0; r < world; ++r)
      stores.push_back(std::make_unique<shard_store>(params, world, r, test_weights));
    for (std::size_t i = 0; i < params.size(); ++i) {
      std::vector<std::byte> concatenated;
      for (const auto& store : stores) {
        const auto& spec = store->spec(i);
        const std::byte* shard = store->data(i);
        concatenated.insert(concatenated.end(), shard, shard + spec.real_bytes());
        EXPECT_TRUE(all_zero(shard + spec.real_bytes(), spec.padded_bytes() - spec.real_bytes()))
            << params[i].name << " padding, world " << world << " rank " << store->rank();
        EXPECT_EQ(reinterpret_cast<std::uintptr_t>(shard) % 64, 0u) << params[i].name;
      }
      EXPECT_EQ(concatenated, full_tensor(params[i], test_weights, 0))
          << params[i].name << " world " << world;
    }
  }
}

TEST(ShardStore, ApplyStepTwiceMatchesFullTensorAtStepTwo) {
  const auto params = refit::model::expected_key_stream(tiny_config());
  const std::uint32_t world = 3;
  std::vector<std::unique_ptr<shard_store>> stores;
  for (std::uint32_t r = 0; r < world; ++r) {
    stores.push_back(std::make_unique<shard_store>(params, world, r, test_weights));
    stores.back()->apply_step();
    stores.back()->apply_step();
    EXPECT_EQ(stores.back()->step(), 2u);
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto full = full_tensor(params[i], test_weights, 2);
    if (!contains(params[i].name, "norm.weight")) { // norms near 1.0 move below bf16 resolution
      EXPECT_NE(full, full_tensor(params[i], test_weights, 0)) << params[i].name;
    }
    std::vector<std::byte> concatenated;
    for (const auto& store : stores) {
      const auto& spec = store->spec(i);
      concatenated.insert(concatenated.end(), store->data(i), store->data(i) + spec.real_bytes());
      EXPECT_TRUE(all_zero(store->data(i) + spec.real_bytes(),
                           spec.padded_bytes() - spec.real_bytes()))
          << params[i].name;
    }
    EXPECT_EQ(concatenated, full) << params[i].name;
  }
}

TEST(ShardStore, IndexOfSpecsAndSize) {
  const auto params = refit::model::expected_key_stream(tiny_config());
  const shard_store store(params, 2, 1, test_weights);
  EXPECT_EQ(store.world(), 2u);
  EXPECT_EQ(store.rank(), 1u);
  EXPECT_EQ(store.step(), 0u);
  EXPECT_EQ(store.params(), params);
  std::uint64_t padded = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(store.index_of(params[i].name), i);
    const auto expected = shard_of(params[i], 2, 1);
    EXPECT_EQ(store.spec(i).row_begin, expected.row_begin);
    EXPECT_EQ(store.spec(i).padded_bytes(), expected.padded_bytes());
    padded += expected.padded_bytes();
  }
  EXPECT_GE(store.bytes(), padded);
  EXPECT_LT(store.bytes(), padded + 64 * params.size());
  const auto e = catch_model_error([&] { store.index_of("model.layers.9.mlp.gate.weight"); });
  EXPECT_EQ(e.where, "model.layers.9.mlp.gate.weight");
}

TEST(ShardStore, ShardsDifferBetweenRanksAndNamesTheWeights) {
  // The two halves of embed_tokens come from different element indices.
  const auto params = refit::model::expected_key_stream(tiny_config());
  const shard_store r0(params, 2, 0, test_weights);
  const shard_store r1(params, 2, 1, test_weights);
  const std::size_t embed = r0.index_of("model.embed_tokens.weight");
  EXPECT_NE(std::memcmp(r0.data(embed), r1.data(embed), r0.spec(embed).padded_bytes()), 0);
}

// ---------------------------------------------------------------------------------------
// local_collective
// ---------------------------------------------------------------------------------------

TEST(LocalCollective, GathersAChunkOfSeveralTensors) {
  const auto params = refit::model::expected_key_stream(tiny_config());
  for (std::uint32_t world : {1u, 2u, 3u}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::uint64_t buffer_bytes = 64 << 10;
    tiny_ranks ranks(world, buffer_bytes);
    const auto plan = plan_chunks(params, buffer_bytes, world);
    local_collective coll(world);
    EXPECT_EQ(coll.world(), world);
    int grouped_chunks = 0;
    for (const auto& ch : plan.chunks) {
      if (ch.tensors.size() < 3)
        continue; // the point is a grouped call; singletons are covered by the rounds test
      const auto statuses = run_ranks(world, [&](std::uint32_t r) {
        return coll.all_gather(r, chunk_items(ch, *ranks.stores[r], ranks.buffers[r].data()),
                               clock_type::now() + 10s);
      });
      for (const auto& s : statuses)
        EXPECT_TRUE(s.ok) << s.error;
      expect_chunk_gathered(ch, ranks.buffers, 0);
      ++grouped_chunks;
    }
    EXPECT_GT(grouped_chunks, 0);
  }
}

TEST(LocalCollective, TwoHundredRoundsStayCorrect) {
  const auto params = refit::model::expected_key_stream(tiny_config());
  for (std::uint32_t world : {2u, 3u}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::uint64_t buffer_bytes = 40000;
    tiny_ranks ranks(world, buffer_bytes);
    const auto plan = plan_chunks(params, buffer_bytes, world);
    ASSERT_GT(plan.chunks.size(), 3u);
    local_collective coll(world);
    std::uint64_t step = 0;
    for (int round = 0; round < 200; ++round) {
      if (round % 50 == 49) { // the trainer moves on: the next rounds gather new weights
        for (auto& store : ranks.stores)
          store->apply_step();
        ++step;
      }
      const auto& ch = plan.chunks[round % plan.chunks.size()];
      for (auto& buffer : ranks.buffers)
        std::fill(buffer.begin(), buffer.end(), std::byte{0xAB});
      const auto statuses = run_ranks(world, [&](std::uint32_t r) {
        return coll.all_gather(r, chunk_items(ch, *ranks.stores[r], ranks.buffers[r].data()),
                               clock_type::now() + 10s);
      });
      for (const auto& s : statuses)
        ASSERT_TRUE(s.ok) << "round " << round << ": " << s.error;
      expect_chunk_gathered(ch, ranks.buffers, step);
      if (HasFailure())
        FAIL() << "round " << round;
    }
  }
}

// The variable layout (registered tensors) is pushed when the ranks' pushes balance (per
// item, or over the call) and pulled otherwise; either way every rank ends with every piece.
TEST(LocalCollective, VariableLayoutIsByteExactPushedOrPulled) {
  const std::uint32_t world = 3;
  // Item sizes per rank: a Shard(0) split (40, 40, 32), and three tensors each held whole by
  // one rank (96 bytes: rank 0, 1, 2).
  struct item_spec {
    std::vector<std::uint64_t> bytes;
  };
  const std::vector<item_spec> all = {{{40, 40, 32}}, {{96, 0, 0}}, {{0, 96, 0}}, {{0, 0, 96}}};
  const auto run = [&](const std::vector<std::size_t>& which) {
    // shards[r][i]: rank r's piece of item i; outs[r][i]: rank r's output of item i.
    std::vector<std::vector<std::vector<std::byte>>> shards(world), outs(world);
    std::vector<std::vector<gather_item>> items(world);
    std::vector<std::vector<gather_piece>> pieces(which.size()); // item k's pieces, rank order
    for (std::uint32_t r = 0; r < world; ++r) {
      shards[r].resize(which.size());
      outs[r].resize(which.size());
    }
    for (std::size_t k = 0; k < which.size(); ++k) {
      const auto& spec = all[which[k]];
      std::uint64_t offset = 0;
      for (std::uint32_t q = 0; q < world; ++q) {
        pieces[k].push_back({offset, spec.bytes[q]});
        offset += spec.bytes[q];
      }
      for (std::uint32_t r = 0; r < world; ++r) {
        shards[r][k].resize(std::max<std::uint64_t>(spec.bytes[r], 1));
        fill_pattern(shards[r][k].data(), spec.bytes[r], static_cast<std::uint8_t>(17 * k + r + 1));
        outs[r][k].assign(offset, std::byte{0xEE});
      }
    }
    for (std::uint32_t r = 0; r < world; ++r)
      for (std::size_t k = 0; k < which.size(); ++k)
        items[r].emplace_back(shards[r][k].data(), all[which[k]].bytes[r], outs[r][k].data(),
                              pieces[k]);
    local_collective coll(world);
    const auto statuses = run_ranks(world, [&](std::uint32_t r) {
      return coll.all_gather(r, items[r], clock_type::now() + 10s);
    });
    for (const auto& st : statuses)
      ASSERT_TRUE(st.ok) << st.error;
    for (std::uint32_t r = 0; r < world; ++r)
      for (std::size_t k = 0; k < which.size(); ++k) {
        std::uint64_t offset = 0;
        for (std::uint32_t q = 0; q < world; ++q) {
          const std::uint64_t n = all[which[k]].bytes[q];
          EXPECT_EQ(std::memcmp(outs[r][k].data() + offset, shards[q][k].data(), n), 0)
            << "rank " << r << " item " << k << " piece of rank " << q;
          offset += n;
        }
      }
  };
  run({0});          // balanced item: pushed
  run({1});          // one rank holds everything: pulled
  run({1, 2, 3});    // unbalanced items that balance over the call: pushed
  run({0, 1, 2, 3}); // both kinds together
}

TEST(LocalCollective, InPlaceShardIsKept) {
  // NCCL-style in-place all-gather: each rank's shard already sits in its output slot.
  const std::uint32_t world = 2;
  const std::uint64_t shard_bytes = 100;
  std::vector<std::vector<std::byte>> outs(world, std::vector<std::byte>(world * shard_bytes));
  for (std::uint32_t r = 0; r < world; ++r)
    fill_pattern(outs[r].data() + r * shard_bytes, shard_bytes, static_cast<std::uint8_t>(r + 1));
  local_collective coll(world);
  const auto statuses = run_ranks(world, [&](std::uint32_t r) {
    std::vector<gather_item> items{{outs[r].data() + r * shard_bytes, shard_bytes, outs[r].data()}};
    return coll.all_gather(r, items, clock_type::now() + 10s);
  });
  for (std::uint32_t r = 0; r < world; ++r) {
    EXPECT_TRUE(statuses[r].ok) << statuses[r].error;
    for (std::uint32_t src = 0; src < world; ++src)
      EXPECT_TRUE(has_pattern(outs[r].data() + src * shard_bytes, shard_bytes,
                              static_cast<std::uint8_t>(src + 1)))
          << "rank " << r << " block " << src;
  }
}

TEST(LocalCollective, MismatchedShardSizesFailOnEveryRankThenAGoodRoundWorks) {
  const std::uint32_t world = 3;
  local_collective coll(world);
  std::vector<std::vector<std::byte>> shards{std::vector<std::byte>(64), std::vector<std::byte>(128),
                                             std::vector<std::byte>(64)};
  std::vector<std::vector<std::byte>> outs(world, std::vector<std::byte>(3 * 128));
  auto statuses = run_ranks(world, [&](std::uint32_t r) {
    return coll.all_gather(r, single_item(shards[r], outs[r]), clock_type::now() + 10s);
  });
  for (std::uint32_t r = 0; r < world; ++r) {
    EXPECT_FALSE(statuses[r].ok);
    EXPECT_TRUE(contains(statuses[r].error, "item 0")) << statuses[r].error;
    EXPECT_TRUE(contains(statuses[r].error, "rank 0 posted 64")) << statuses[r].error;
    EXPECT_TRUE(contains(statuses[r].error, "rank 1 posted 128")) << statuses[r].error;
    EXPECT_TRUE(contains(statuses[r].error, "all_gather rank " + std::to_string(r)))
        << statuses[r].error;
  }

  // A mismatch ends the round cleanly: the next round with agreeing ranks succeeds.
  for (std::uint32_t r = 0; r < world; ++r) {
    shards[r].assign(64, std::byte{0});
    fill_pattern(shards[r].data(), 64, static_cast<std::uint8_t>(r + 10));
  }
  statuses = run_ranks(world, [&](std::uint32_t r) {
    return coll.all_gather(r, single_item(shards[r], outs[r]), clock_type::now() + 10s);
  });
  for (std::uint32_t r = 0; r < world; ++r) {
    EXPECT_TRUE(statuses[r].ok) << statuses[r].error;
    for (std::uint32_t src = 0; src < world; ++src)
      EXPECT_TRUE(has_pattern(outs[r].data() + src * 64, 64, static_cast<std::uint8_t>(src + 10)));
  }
}

TEST(LocalCollective, MismatchedItemCountsFailOnEveryRank) {
  const std::uint32_t world = 2;
  local_collective coll(world);
  std::vector<std::byte> shard(32);
  std::vector<std::vector<std::byte>> outs(world, std::vector<std::byte>(64));
  const auto statuses = run_ranks(world, [&](std::uint32_t r) {
    std::vector<gather_item> items(r + 1, gather_item{shard.data(), shard.size(), outs[r].data()});
    return coll.all_gather(r, items, clock_type::now() + 10s);
  });
  for (const auto& s : statuses) {
    EXPECT_FALSE(s.ok);
    EXPECT_TRUE(contains(s.error, "rank 0 posted 1 items, rank 1 posted 2")) << s.error;
  }
}

TEST(LocalCollective, MissingRankGivesDeadlineErrorNamingItWithoutHanging) {
  const std::uint32_t world = 3;
  local_collective coll(world);
  std::vector<std::byte> shard(16);
  std::vector<std::vector<std::byte>> outs(world, std::vector<std::byte>(48));
  const auto started = clock_type::now();
  std::vector<collective_status> statuses(world);
  {
    std::thread r0([&] { statuses[0] = coll.all_gather(0, single_item(shard, outs[0]), started + 100ms); });
    std::thread r2([&] { statuses[2] = coll.all_gather(2, single_item(shard, outs[2]), started + 100ms); });
    r0.join();
    r2.join();
  }
  const auto elapsed = clock_type::now() - started;
  EXPECT_GE(elapsed, 90ms);
  EXPECT_LT(elapsed, 2s);
  for (std::uint32_t r : {0u, 2u}) {
    EXPECT_FALSE(statuses[r].ok);
    EXPECT_TRUE(contains(statuses[r].error, "rank 1 did not arrive within the deadline"))
        << statuses[r].error;
  }

  // The round is abandoned for everyone: the late rank fails at once, with the same reason.
  const auto late = coll.all_gather(1, single_item(shard, outs[1]), clock_type::now() + 10s);
  EXPECT_FALSE(late.ok);
  EXPECT_TRUE(contains(late.error, "aborted")) << late.error;
  EXPECT_TRUE(contains(late.error, "rank 1 did not arrive")) << late.error;

  coll.reset();
  const auto good = run_ranks(world, [&](std::uint32_t r) {
    return coll.all_gather(r, single_item(shard, outs[r]), clock_type::now() + 10s);
  });
  for (const auto& s : good)
    EXPECT_TRUE(s.ok) << s.error;
}

TEST(LocalCollective, SeveralMissingRanksAreAllNamed) {
  local_collective coll(3);
  std::vector<std::byte> shard(16);
  std::vector<std::byte> out(48);
  const auto s = coll.all_gather(0, single_item(shard, out), clock_type::now() + 20ms);
  EXPECT_FALSE(s.ok);
  EXPECT_TRUE(contains(s.error, "ranks 1, 2 did not arrive within the deadline")) << s.error;
}

TEST(LocalCollective, AbortWakesAWaitingRankThenResetAllowsAGoodRound) {
  const std::uint32_t world = 2;
  local_collective coll(world);
  std::vector<std::byte> shard(8, std::byte{5});
  std::vector<std::vector<std::byte>> outs(world, std::vector<std::byte>(16));
  collective_status waiting;
  const auto started = clock_type::now();
  std::thread r0([&] { waiting = coll.all_gather(0, single_item(shard, outs[0]), started + 30s); });
  std::this_thread::sleep_for(50ms);
  coll.abort("trainer rank 1 failed to materialize model.norm.weight");
  r0.join();
  EXPECT_LT(clock_type::now() - started, 2s);
  EXPECT_FALSE(waiting.ok);
  EXPECT_TRUE(contains(waiting.error, "trainer rank 1 failed to materialize model.norm.weight"))
      << waiting.error;

  const auto after = coll.all_gather(1, single_item(shard, outs[1]), clock_type::now() + 10s);
  EXPECT_FALSE(after.ok);
  EXPECT_TRUE(contains(after.error, "trainer rank 1 failed")) << after.error;

  coll.reset();
  const auto good = run_ranks(world, [&](std::uint32_t r) {
    return coll.all_gather(r, single_item(shard, outs[r]), clock_type::now() + 10s);
  });
  for (std::uint32_t r = 0; r < world; ++r) {
    EXPECT_TRUE(good[r].ok) << good[r].error;
    EXPECT_EQ(outs[r], std::vector<std::byte>(16, std::byte{5}));
  }
}

TEST(LocalCollective, RejectsBadRankAndWorld) {
  local_collective coll(2);
  std::vector<std::byte> shard(8);
  std::vector<std::byte> out(16);
  const auto s = coll.all_gather(2, single_item(shard, out), clock_type::now() + 1s);
  EXPECT_FALSE(s.ok);
  EXPECT_TRUE(contains(s.error, "out of range")) << s.error;
  EXPECT_THROW(local_collective(0), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------
// memfd host buffers
// ---------------------------------------------------------------------------------------

TEST(HostBuffer, PoolWritesAreReadThroughMappedBuffer) {
  const std::uint64_t bytes = (1 << 20) + 5;
  host_buffer_pool pool(2, bytes);
  EXPECT_EQ(pool.count(), 2u);
  EXPECT_EQ(pool.bytes(), bytes);
  const std::regex handle_format("memfd:" + std::to_string(getpid()) + ":[0-9]+");
  for (std::uint32_t i = 0; i < pool.count(); ++i) {
    EXPECT_TRUE(std::regex_match(pool.handle(i), handle_format)) << pool.handle(i);
    EXPECT_TRUE(all_zero(pool.data(i), bytes));
    fill_pattern(pool.data(i), bytes, static_cast<std::uint8_t>(i));
  }
  EXPECT_NE(pool.handle(0), pool.handle(1));
  const mapped_buffer m0(pool.handle(0), bytes, getpid());
  const mapped_buffer m1(pool.handle(1), 4096, getpid()); // a prefix is fine
  EXPECT_EQ(m0.size(), bytes);
  EXPECT_NE(m0.data(), pool.data(0)); // a separate mapping of the same memory
  EXPECT_TRUE(has_pattern(m0.data(), bytes, 0));
  EXPECT_TRUE(has_pattern(m1.data(), 4096, 1));

  // Shared memory: later producer writes are visible through the consumer mapping.
  fill_pattern(pool.data(0), bytes, 99);
  EXPECT_TRUE(has_pattern(m0.data(), bytes, 99));
  EXPECT_THROW(pool.data(2), std::out_of_range);
  EXPECT_THROW(pool.handle(2), std::out_of_range);
}

TEST(HostBuffer, ForkedChildMapsTheParentsHandle) {
  const std::uint64_t bytes = 3 * 4096 + 17;
  host_buffer_pool pool(1, bytes);
  fill_pattern(pool.data(0), bytes, 42);
  const std::string handle = pool.handle(0);
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    // The child opens the buffer through /proc/<parent>/fd/<fd>, like a rollout worker.
    int status = 0;
    try {
      const mapped_buffer m(handle, bytes, getppid());
      status = has_pattern(m.data(), bytes, 42) ? 0 : 1;
    } catch (...) {
      status = 2;
    }
    _exit(status);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "child did not exit normally";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: bytes differ, 2: mapping failed";
}

TEST(HostBuffer, MappingIsReadOnly) {
  host_buffer_pool pool(1, 4096);
  const mapped_buffer m(pool.handle(0), 4096, getpid());
  EXPECT_DEATH(const_cast<std::byte*>(m.data())[0] = std::byte{1}, "");
}

TEST(HostBuffer, MappingKeepsMemoryAliveAfterThePoolIsGone) {
  const std::uint64_t bytes = 8192;
  std::unique_ptr<host_buffer_pool> pool = std::make_unique<host_buffer_pool>(1, bytes);
  fill_pattern(pool->data(0), bytes, 3);
  const auto fds_with_pool = open_fds();
  const mapped_buffer m(pool->handle(0), bytes, getpid());
  EXPECT_EQ(open_fds(), fds_with_pool) << "the consumer must close its fd after mapping";
  pool.reset();
  EXPECT_TRUE(has_pattern(m.data(), bytes, 3));
  EXPECT_EQ(buffer_mappings(), 1u);
}

TEST(HostBuffer, NothingIsLeftAfterDestruction) {
  const auto fds_before = open_fds();
  const auto shm_before = dev_shm_entries();
  ASSERT_EQ(buffer_mappings(), 0u);
  {
    host_buffer_pool pool(3, 64 << 10);
    EXPECT_EQ(open_fds().size(), fds_before.size() + 3);
    EXPECT_EQ(buffer_mappings(), 3u);
    EXPECT_EQ(dev_shm_entries(), shm_before) << "memfd buffers must not appear in /dev/shm";
    mapped_buffer a(pool.handle(0), 64 << 10, getpid());
    mapped_buffer b(pool.handle(2), 1024, getpid());
    EXPECT_EQ(buffer_mappings(), 5u);
  }
  EXPECT_EQ(open_fds(), fds_before);
  EXPECT_EQ(buffer_mappings(), 0u);
  EXPECT_EQ(dev_shm_entries(), shm_before);
}

TEST(HostBuffer, MovedMappedBufferUnmapsOnce) {
  host_buffer_pool pool(2, 4096);
  fill_pattern(pool.data(0), 4096, 1);
  fill_pattern(pool.data(1), 4096, 2);
  {
    mapped_buffer a(pool.handle(0), 4096, getpid());
    mapped_buffer moved(std::move(a));
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_EQ(a.size(), 0u);
    EXPECT_TRUE(has_pattern(moved.data(), 4096, 1));
    mapped_buffer other(pool.handle(1), 4096, getpid());
    EXPECT_EQ(buffer_mappings(), 4u);
    other = std::move(moved); // other's own mapping is released
    EXPECT_EQ(buffer_mappings(), 3u);
    EXPECT_TRUE(has_pattern(other.data(), 4096, 1));
    std::vector<mapped_buffer> held;
    held.push_back(std::move(other));
    EXPECT_EQ(buffer_mappings(), 3u);
  }
  EXPECT_EQ(buffer_mappings(), 2u);
}

TEST(HostBuffer, MalformedHandlesAreRejected) {
  const std::string pid = std::to_string(getpid());
  const std::vector<std::string> malformed{
      "", "memfd:", "memfd:" + pid, "memfd:" + pid + ":", "memfd::3", "memfd:a:3",
      "memfd:" + pid + ":3x", "memfd:-" + pid + ":3", "memfd:" + pid + ":3:4",
      "shm:" + pid + ":3", " memfd:" + pid + ":3", "memfd:" + pid + ":+3",
      "memfd:99999999999999999999:3"};
  for (const auto& handle : malformed) {
    const auto message = runtime_error_message([&] { mapped_buffer(handle, 16, getpid()); });
    EXPECT_TRUE(contains(message, "malformed buffer handle '" + handle + "'")) << message;
  }
}

TEST(HostBuffer, DeadProducerIsAClearError) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0)
    _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  const std::string handle = "memfd:" + std::to_string(child) + ":3";
  const auto message = runtime_error_message([&] { mapped_buffer(handle, 16, child); });
  EXPECT_TRUE(contains(message, "'" + handle + "'")) << message;
  EXPECT_TRUE(contains(message, "/proc/" + std::to_string(child) + "/fd/3")) << message;
  EXPECT_TRUE(contains(message, "gone")) << message;
}

TEST(HostBuffer, WrongFdIsAClearError) {
  host_buffer_pool pool(1, 4096);
  const std::string closed = "memfd:" + std::to_string(getpid()) + ":1000000";
  auto message = runtime_error_message([&] { mapped_buffer(closed, 16, getpid()); });
  EXPECT_TRUE(contains(message, "'" + closed + "'")) << message;
  EXPECT_TRUE(contains(message, "gone")) << message;

  // An open fd that is not a buffer (a pipe: must not block in open()).
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const std::string pipe_handle = "memfd:" + std::to_string(getpid()) + ":" + std::to_string(fds[0]);
  message = runtime_error_message([&] { mapped_buffer(pipe_handle, 16, getpid()); });
  close(fds[0]);
  close(fds[1]);
  EXPECT_TRUE(contains(message, "'" + pipe_handle + "'")) << message;
  EXPECT_TRUE(contains(message, "not a memory buffer")) << message;
}

TEST(HostBuffer, TooLargeRequestNamesBothSizes) {
  host_buffer_pool pool(1, 4096);
  const auto fds_before = open_fds();
  const auto message = runtime_error_message([&] { mapped_buffer(pool.handle(0), 8192, getpid()); });
  EXPECT_TRUE(contains(message, pool.handle(0))) << message;
  EXPECT_TRUE(contains(message, "4096") && contains(message, "8192")) << message;
  EXPECT_EQ(open_fds(), fds_before) << "a failed mapping must not leak its fd";
  EXPECT_EQ(buffer_mappings(), 1u);
  const auto zero = runtime_error_message([&] { mapped_buffer(pool.handle(0), 0, getpid()); });
  EXPECT_TRUE(contains(zero, "0 bytes")) << zero;
}

// A producer cannot shrink (or grow) a pool buffer once its handle exists, so a consumer's
// mapping can never turn into SIGBUS; and a consumer maps nothing else.
TEST(HostBuffer, PoolBuffersAreSealedAndOnlySealedMemfdsOfTheProducerAreMapped) {
  host_buffer_pool pool(1, 4096);
  const auto handle = pool.handle(0);
  const int fd = std::stoi(handle.substr(handle.rfind(':') + 1));
  const int seals = fcntl(fd, F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  errno = 0;
  EXPECT_NE(ftruncate(fd, 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(ftruncate(fd, 8192), 0) << "grow is sealed too";
  {
    mapped_buffer m(handle, 4096, getpid());
    EXPECT_EQ(m.size(), 4096u);
  }
  // Another pid than the producer's: refused before anything is opened.
  auto other = runtime_error_message([&] { mapped_buffer(handle, 16, getppid()); });
  EXPECT_TRUE(contains(other, "but the rank that publishes it is pid " + std::to_string(getppid())))
    << other;
  // An unsealed memfd, and a regular file: refused.
  const int unsealed = memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_EQ(ftruncate(unsealed, 4096), 0);
  auto msg = runtime_error_message([&] {
    mapped_buffer("memfd:" + std::to_string(getpid()) + ":" + std::to_string(unsealed), 16, getpid());
  });
  close(unsealed);
  EXPECT_TRUE(contains(msg, "without the required seals")) << msg;
  const std::string path = ::testing::TempDir() + "refit-plain-" + std::to_string(getpid());
  std::ofstream(path) << std::string(4096, 'x');
  const int plain = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  unlink(path.c_str());
  msg = runtime_error_message([&] {
    mapped_buffer("memfd:" + std::to_string(getpid()) + ":" + std::to_string(plain), 16, getpid());
  });
  close(plain);
  EXPECT_TRUE(contains(msg, "is not a memfd")) << msg;
}

TEST(HostBuffer, CreationFailureThrowsSystemErrorAndLeaksNothing) {
  const auto fds_before = open_fds();
  EXPECT_THROW(host_buffer_pool(2, 0), std::system_error);
  // Far beyond any address space: fails in ftruncate or mmap, after the memfd exists.
  try {
    host_buffer_pool pool(2, 1ull << 62);
    ADD_FAILURE() << "expected std::system_error";
  } catch (const std::system_error& e) {
    EXPECT_TRUE(contains(e.what(), "buffer 0 of 2")) << e.what();
  }
  EXPECT_EQ(open_fds(), fds_before);
  EXPECT_EQ(buffer_mappings(), 0u);
}
