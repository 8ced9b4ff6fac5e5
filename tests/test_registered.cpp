// Registered tensors (runtime/publication/registered.hpp): FSDP2 chunking, validation against
// the model's key stream, the mapping of Shard(0) / replicated / fused expert memory onto the
// canonical stream (gathered byte-exact through the collectives, zero copy), and the digest
// terms the verifier adds up.
#include <thread>

#include <gtest/gtest.h>

#include "model_configs.hpp"
#include "registered_fixture.hpp"
#include "runtime/model/digest.hpp"
#include "runtime/publication/backend.hpp"
#include "runtime/publication/collective.hpp"

using namespace refit;
using namespace refit::publication;
using namespace refit::testing;

namespace {

const model::synthetic_weights weights{7, 1e-2f, 0.02f};
const device::spec cpu0{device::kind::cpu, 0};

TEST(FsdpChunk, TrailingRanksMayOwnNothing) {
  // N = 5, W = 4: chunk 2 -> 2, 2, 1, 0 rows.
  const std::uint64_t want_begin[] = {0, 2, 4, 5};
  const std::uint64_t want_count[] = {2, 2, 1, 0};
  for (std::uint32_t r = 0; r < 4; ++r) {
    auto c = fsdp_chunk(5, 4, r);
    EXPECT_EQ(c.begin, want_begin[r]) << r;
    EXPECT_EQ(c.count, want_count[r]) << r;
  }
  EXPECT_EQ(fsdp_chunk(3, 1, 0).count, 3u);
}

// Every rank gathers all canonical tensors in one all-gather, each rank in its own thread.
std::vector<std::vector<std::byte>> gather_all(const model::model_config& cfg, std::uint32_t world,
                                               const fsdp_layout& layout, std::uint64_t step) {
  const auto stream = model::expected_key_stream(cfg);
  std::vector<std::unique_ptr<fsdp_rank_tensors>> mem;
  std::vector<std::shared_ptr<registered_weights>> regs;
  for (std::uint32_t r = 0; r < world; ++r) {
    mem.push_back(make_rank_tensors(cfg, world, r, weights, step, layout));
    regs.push_back(register_all(cfg, world, r, *mem.back()));
  }
  std::vector<std::vector<std::byte>> outs(world);
  std::vector<std::uint64_t> offsets;
  std::uint64_t total = 0;
  for (const auto& p : stream) {
    offsets.push_back(total);
    total += p.nbytes();
  }
  local_collective coll(world);
  std::vector<collective_status> status(world);
  std::vector<std::thread> threads;
  for (std::uint32_t r = 0; r < world; ++r) {
    outs[r].assign(total, std::byte{0x5a});
    threads.emplace_back([&, r] {
      std::vector<gather_item> items;
      for (std::size_t i = 0; i < stream.size(); ++i)
        items.push_back(regs[r]->item(i, outs[r].data() + offsets[i]));
      status[r] = coll.all_gather(r, items, std::chrono::steady_clock::now() + std::chrono::seconds(30));
    });
  }
  for (auto& t : threads)
    t.join();
  for (std::uint32_t r = 0; r < world; ++r)
    EXPECT_TRUE(status[r].ok) << status[r].error;
  return outs;
}

class RegisteredGather : public ::testing::TestWithParam<std::uint32_t> {};

TEST_P(RegisteredGather, FusedShardedAndReplicatedTensorsGatherToTheCanonicalBytes) {
  const auto cfg = tiny_model();
  const std::uint32_t world = GetParam();
  fsdp_layout layout;
  layout.fused_experts = true;
  layout.replicated = {"model.norm.weight", "model.layers.1.mlp.experts.down_proj",
                       "model.layers.0.self_attn.q_norm.weight"};
  auto outs = gather_all(cfg, world, layout, 3);
  const auto stream = model::expected_key_stream(cfg);
  for (std::uint32_t r = 0; r < world; ++r) {
    std::uint64_t at = 0;
    for (const auto& p : stream) {
      auto want = full_tensor(p, weights, 3);
      ASSERT_EQ(0, std::memcmp(outs[r].data() + at, want.data(), want.size()))
        << "rank " << r << " " << p.name;
      at += p.nbytes();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(World, RegisteredGather, ::testing::Values(1u, 2u, 3u, 4u, 5u),
                         [](const auto& info) { return "W" + std::to_string(info.param); });

TEST(RegisteredWeights, UnfusedExpertsMapOneToOne) {
  const auto cfg = tiny_model();
  fsdp_layout layout;
  layout.fused_experts = false;
  auto outs = gather_all(cfg, 3, layout, 0);
  std::uint64_t at = 0;
  for (const auto& p : model::expected_key_stream(cfg)) {
    auto want = full_tensor(p, weights, 0);
    ASSERT_EQ(0, std::memcmp(outs[2].data() + at, want.data(), want.size())) << p.name;
    at += p.nbytes();
  }
}

TEST(RegisteredWeights, RegistrationIsZeroCopy) {
  const auto cfg = tiny_model();
  auto mem = make_rank_tensors(cfg, 2, 1, weights, 0);
  auto reg = register_all(cfg, 2, 1, *mem);
  // Expert 2 of layer 0 is rank 1's first local expert (4 experts over 2 ranks): its up
  // projection starts I*H elements into rank 1's gate_up_proj memory.
  const auto& stream = reg->params();
  std::size_t up2 = 0;
  while (stream[up2].name != "model.layers.0.mlp.experts.2.up_proj.weight")
    ++up2;
  std::byte slot[1];
  auto item = reg->item(up2, slot);
  const auto* fused = reg->find("model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(fused, nullptr);
  EXPECT_EQ(item.shard, fused->data + std::uint64_t{32} * 64 * 2);
  EXPECT_EQ(item.shard_bytes, std::uint64_t{32} * 64 * 2);
  ASSERT_EQ(item.pieces.size(), 2u);
  EXPECT_EQ(item.pieces[0].bytes, 0u) << "rank 0 holds experts 0 and 1 only";
}

TEST(RegisteredWeights, DigestTermsOfAllRanksGiveTheResidentDigests) {
  const auto cfg = tiny_model();
  for (std::uint32_t world : {1u, 3u}) {
    for (std::uint32_t tp : {1u, 2u}) {
      const model::tp_layout layout(cfg, tp);
      const auto residents = layout.residents();
      std::vector<std::uint64_t> sums(std::size_t{tp} * residents.size(), 0);
      fsdp_layout fl;
      fl.replicated = {"lm_head.weight"};
      for (std::uint32_t r = 0; r < world; ++r) {
        auto mem = make_rank_tensors(cfg, world, r, weights, 2, fl);
        auto reg = register_all(cfg, world, r, *mem);
        std::vector<std::size_t> all(reg->params().size());
        for (std::size_t i = 0; i < all.size(); ++i)
          all[i] = i;
        auto terms = reg->partial_digests(layout, all);
        ASSERT_EQ(terms.size(), sums.size());
        for (std::size_t i = 0; i < sums.size(); ++i)
          sums[i] += terms[i];
      }
      const auto want = expected_resident_digests(cfg, tp, weights, 2);
      for (std::uint32_t t = 0; t < tp; ++t)
        for (std::size_t d = 0; d < residents.size(); ++d)
          EXPECT_EQ(model::zero_digest(residents[d].nbytes / 2) + sums[t * residents.size() + d],
                    want[t][d])
            << "world " << world << " tp " << t << " " << residents[d].name;
    }
  }
}

// The error of sealing (or adding) a rank's tensors after `edit` changed one registration.
template <class Edit>
std::string seal_error(Edit edit, std::uint32_t world = 2, std::uint32_t rank = 1) {
  const auto cfg = tiny_model();
  auto mem = make_rank_tensors(cfg, world, rank, weights, 0);
  registered_weights reg(cfg, world, rank, cpu0);
  try {
    auto regs = mem->regs;
    edit(regs);
    for (const auto& r : regs)
      reg.add(r);
    reg.seal();
  } catch (const model::model_error& e) {
    return e.what();
  }
  return "";
}

template <class F>
void edit_tensor(std::vector<tensor_registration>& regs, const std::string& name, F f) {
  for (auto& r : regs)
    if (r.name == name)
      return f(r);
  FAIL() << name << " is not registered";
}

TEST(RegisteredValidation, EachBadTensorIsNamed) {
  const std::string q = "model.layers.1.self_attn.q_proj.weight";
  EXPECT_EQ(seal_error([](auto&) {}), "");

  auto e = seal_error([&](auto& regs) {
    edit_tensor(regs, q, [](auto& r) { r.dt = model::dtype::float32; });
  });
  EXPECT_NE(e.find(q + ": dtype float32, the model expects bfloat16"), std::string::npos) << e;

  e = seal_error([&](auto& regs) {
    edit_tensor(regs, q, [](auto& r) { r.global_shape[1] = 65; r.bytes = r.rows * 65 * 2; });
  });
  EXPECT_NE(e.find(q + ": global shape [64, 65], the model expects [64, 64]"), std::string::npos) << e;

  e = seal_error([&](auto& regs) {
    regs.erase(std::remove_if(regs.begin(), regs.end(), [&](auto& r) { return r.name == q; }),
               regs.end());
  });
  EXPECT_NE(e.find(q + ": missing tensor"), std::string::npos) << e;

  e = seal_error([&](auto& regs) {
    auto extra = regs.front();
    extra.name = "model.layers.1.mlp.shared_expert.weight";
    regs.push_back(extra);
  });
  EXPECT_NE(e.find("model.layers.1.mlp.shared_expert.weight: extra tensor"), std::string::npos) << e;

  e = seal_error([&](auto& regs) {
    auto extra = regs.front();
    extra.name = "model.layers.7.mlp.experts.gate_up_proj"; // only 2 layers
    regs.push_back(extra);
  });
  EXPECT_NE(e.find("model.layers.7.mlp.experts.gate_up_proj: extra tensor"), std::string::npos) << e;

  e = seal_error([&](auto& regs) { regs.push_back(regs.front()); });
  EXPECT_NE(e.find("model.embed_tokens.weight: registered twice"), std::string::npos) << e;

  // The fused parameter and a per-expert tensor it covers.
  e = seal_error([&](auto& regs) {
    auto per_expert = regs.front();
    per_expert.name = "model.layers.0.mlp.experts.3.down_proj.weight";
    per_expert.global_shape = {64, 32};
    per_expert.row_begin = 32;
    per_expert.rows = 32;
    per_expert.bytes = 32 * 32 * 2;
    regs.push_back(per_expert);
  });
  EXPECT_NE(e.find("model.layers.0.mlp.experts.3.down_proj.weight: registered twice: directly and "
                   "through model.layers.0.mlp.experts.down_proj"),
            std::string::npos)
    << e;

  // Rows that are not FSDP2's chunk of this rank, and a size that does not match the rows.
  e = seal_error([&](auto& regs) { edit_tensor(regs, q, [](auto& r) { r.row_begin = 31; }); });
  EXPECT_NE(e.find(q + ": rank 1 of 2 holds rows [31, 63), FSDP2's Shard(0) of 64 rows gives it "
                       "[32, 64)"),
            std::string::npos)
    << e;
  e = seal_error([&](auto& regs) { edit_tensor(regs, q, [](auto& r) { r.bytes -= 2; }); });
  EXPECT_NE(e.find(q + ": 4094 bytes registered"), std::string::npos) << e;

  e = seal_error([&](auto& regs) { edit_tensor(regs, q, [](auto& r) { r.device = "cuda:0"; }); });
  EXPECT_NE(e.find(q + ": is on cuda:0, this rank's device is cpu:0"), std::string::npos) << e;

  e = seal_error([&](auto& regs) { edit_tensor(regs, q, [](auto& r) { r.data = nullptr; }); });
  EXPECT_NE(e.find(q + ": null data pointer"), std::string::npos) << e;
}

TEST(RegisteredValidation, EmptyTrailingShardsAreAccepted) {
  // 4 experts over 5 ranks: rank 4 holds no expert (and no row of 4-row tensors).
  EXPECT_EQ(seal_error([](auto&) {}, 5, 4), "");
}

TEST(RegisteredGatherLayout, RanksDisagreeingOnAPieceLayoutFailEveryRank) {
  // Rank 0 says rank 1 contributes 8 bytes, rank 1 says 16: both fail, naming the item.
  local_collective coll(2);
  std::vector<std::byte> a(32), b(32), src(16);
  std::vector<collective_status> st(2);
  std::thread t0([&] {
    std::vector<gather_item> items{{src.data(), 8, a.data(), {{0, 8}, {8, 8}}}};
    st[0] = coll.all_gather(0, items, std::chrono::steady_clock::now() + std::chrono::seconds(30));
  });
  std::thread t1([&] {
    std::vector<gather_item> items{{src.data(), 16, b.data(), {{0, 8}, {8, 16}}}};
    st[1] = coll.all_gather(1, items, std::chrono::steady_clock::now() + std::chrono::seconds(30));
  });
  t0.join();
  t1.join();
  for (const auto& s : st) {
    EXPECT_FALSE(s.ok);
    EXPECT_NE(s.error.find("different piece layouts"), std::string::npos) << s.error;
  }
}

} // namespace
