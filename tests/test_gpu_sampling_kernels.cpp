// The fused sampler (kernels::sample_plain) on a GPU (label gpu), alone, against a host
// reference in double that follows sample_on_device's ATen chain for top_k 0 / top_p 1:
// z = logit * inv_t, e = exp(z - max), total = sum e, cdf = cumsum(e / total), token = the
// number of ids whose cdf <= u (at most vocab - 1) or the first maximum when greedy, logprob =
// z[token] - max - log(total). Vocabularies of Qwen3 (151936: 38 of the kernel's 4096-id
// parts), one id past a part (4097), and below one part (1000, 37); rows further apart than
// the vocab (NaN between them, which must never be read) and taken permuted and repeated.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "gpu_fixture.hpp"
#include "gpu_kernel_fixture.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace {

namespace kernels = refit::inference::kernels;
using refit::testing::device_vec;
using i64 = std::int64_t;

constexpr int row_count = 8;
const i64 vocabs[] = {151936, 4097, 1000, 37};
const int draw_counts[] = {1, 5, 64, 200};

// The reference of one row at one temperature, sums in id order.
struct host_row {
  std::vector<double> z;
  std::vector<double> cdf;
  double max = -std::numeric_limits<double>::infinity();
  i64 argmax = 0; // the first maximum
  double total = 0.0;

  host_row(const float* logits, i64 vocab, double inv_t) {
    z.resize(static_cast<std::size_t>(vocab));
    for (i64 i = 0; i < vocab; ++i) {
      z[static_cast<std::size_t>(i)] = static_cast<double>(logits[i]) * inv_t;
      if (i == 0 || z[static_cast<std::size_t>(i)] > max) {
        max = z[static_cast<std::size_t>(i)];
        argmax = i;
      }
    }
    std::vector<double> e(z.size());
    for (std::size_t i = 0; i < z.size(); ++i) {
      e[i] = std::exp(z[i] - max);
      total += e[i];
    }
    double run = 0.0;
    for (double v : e) {
      run += v / total;
      cdf.push_back(run);
    }
  }
  i64 vocab() const { return static_cast<i64>(z.size()); }
  i64 sample(double u) const {
    const i64 below = std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
    return std::min(below, vocab() - 1);
  }
  double logprob(i64 token) const {
    return (z[static_cast<std::size_t>(token)] - max) - std::log(total);
  }
};

// u, moved when a cdf value lies within `margin` of it to the middle of the nearest id's
// interval at least 4 margins wide: the kernel's sums round differently from these (by ~1e-13
// here), so only a u clear of every boundary makes the exact token a fair demand.
double clear_uniform(const host_row& r, double u) {
  constexpr double margin = 1e-9;
  const auto lower = [&](i64 t) { return t > 0 ? r.cdf[static_cast<std::size_t>(t - 1)] : 0.0; };
  const auto upper = [&](i64 t) { return r.cdf[static_cast<std::size_t>(t)]; };
  const i64 t = r.sample(u);
  if (u - lower(t) > margin && upper(t) - u > margin)
    return u;
  for (i64 step = 0; step < r.vocab(); ++step)
    for (const i64 k : {t + step, t - step})
      if (k >= 0 && k < r.vocab() && upper(k) - lower(k) > 4 * margin)
        return (lower(k) + upper(k)) / 2;
  ADD_FAILURE() << "no id of the row has a probability above " << 4 * margin;
  return u;
}

// Two ids of row r (r >= 1) planted with the same value above the row's maximum, so the
// first of them is the first maximum: across parts (far apart, at a part boundary, two parts
// apart), inside a part, and at the row's end. Clipped into small vocabularies.
std::pair<i64, i64> tie_of(int r, i64 vocab) {
  static const std::pair<i64, i64> pairs[] = {
    {3, 1 << 30}, {4095, 4096}, {100, 101}, {0, 8192}, {5 * 4096 + 7, 20 * 4096 + 1},
    {(1 << 30) - 1, 1 << 30}, {17, 4096 + 17}};
  auto [a, b] = pairs[(r - 1) % 7];
  b = std::min(b, vocab - 1);
  a = std::min(a, b - 1);
  return {a, b};
}

// row_count rows of `stride` floats, `vocab` logits each, NaN after the vocab. Row 0: every
// logit equal (all ties); row r >= 1: uniform in +-scale[r], with a planted tie (tie_of).
std::vector<float> make_logits(i64 vocab, i64 stride, std::uint32_t seed) {
  static const float scale[row_count] = {0.0f, 0.5f, 2.0f, 4.0f, 8.0f, 1.0f, 3.0f, 10.0f};
  std::mt19937 rng(seed);
  std::vector<float> out(static_cast<std::size_t>(stride * row_count),
                         std::numeric_limits<float>::quiet_NaN());
  for (int r = 0; r < row_count; ++r) {
    float* row = out.data() + r * stride;
    if (r == 0) {
      std::fill(row, row + vocab, 0.25f);
      continue;
    }
    std::uniform_real_distribution<float> u(-scale[r], scale[r]);
    for (i64 i = 0; i < vocab; ++i)
      row[i] = u(rng);
    const auto [a, b] = tie_of(r, vocab);
    row[a] = row[b] = *std::max_element(row, row + vocab) + 0.5f;
  }
  return out;
}

// Draw d takes row (5 d + 3) % 8: every row, permuted, repeated past 8 draws.
std::vector<i64> draw_rows(int draws) {
  std::vector<i64> rows;
  for (int d = 0; d < draws; ++d)
    rows.push_back((5 * d + 3) % row_count);
  return rows;
}

// out [draws, 2] from sample_plain on the default stream; the scratch filled with `poison`
// first (the kernels must not depend on its contents).
void run_sampler(const device_vec<float>& logits, i64 vocab, i64 stride,
                 const std::vector<i64>& rows, const std::vector<double>* uniforms,
                 double inv_t, std::vector<double>& out, int poison = 0xa5) {
  const int draws = static_cast<int>(rows.size());
  device_vec<i64> d_rows(rows);
  device_vec<double> d_u(uniforms != nullptr ? *uniforms : std::vector<double>(1, 0.0));
  device_vec<double> d_out(static_cast<std::size_t>(2 * draws));
  const std::size_t bytes = kernels::sample_plain_scratch_bytes(vocab, draws);
  device_vec<std::uint8_t> scratch(bytes);
  CUDA_OK(cudaMemset(scratch.p, poison, bytes));
  kernels::sample_plain(logits.p, vocab, stride, d_rows.p, uniforms != nullptr ? d_u.p : nullptr,
                        draws, inv_t, uniforms == nullptr, d_out.p, scratch.p, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  out = d_out.host();
}

void expect_logprob(double got, double want) {
  EXPECT_NEAR(got, want, 1e-9 * std::max(1.0, std::abs(want)));
}

TEST(GpuSamplingKernels, SampledDrawsTakeTheHostTokenAndLogprob) {
  REQUIRE_GPUS(1);
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (const i64 vocab : vocabs) {
    const i64 stride = vocab + 3; // rows further apart than the vocab, not 16-byte aligned
    const auto logits = make_logits(vocab, stride, static_cast<std::uint32_t>(vocab));
    const device_vec<float> d_logits(logits);
    for (const double inv_t : {1.0, 1.0 / 0.7}) {
      std::vector<host_row> ref;
      for (int r = 0; r < row_count; ++r)
        ref.emplace_back(logits.data() + r * stride, vocab, inv_t);
      for (const int draws : draw_counts) {
        SCOPED_TRACE(testing::Message() << "vocab " << vocab << ", inv_t " << inv_t << ", "
                                        << draws << " draws");
        const auto rows = draw_rows(draws);
        std::vector<double> u;
        for (const i64 r : rows)
          u.push_back(clear_uniform(ref[static_cast<std::size_t>(r)], uniform(rng)));
        std::vector<double> out;
        ASSERT_NO_FATAL_FAILURE(run_sampler(d_logits, vocab, stride, rows, &u, inv_t, out));
        for (int d = 0; d < draws; ++d) {
          const host_row& h = ref[static_cast<std::size_t>(rows[static_cast<std::size_t>(d)])];
          const i64 want = h.sample(u[static_cast<std::size_t>(d)]);
          EXPECT_EQ(out[2 * d], static_cast<double>(want))
            << "draw " << d << ", row " << rows[static_cast<std::size_t>(d)] << ", u "
            << u[static_cast<std::size_t>(d)];
          expect_logprob(out[2 * d + 1], h.logprob(want));
        }
      }
    }
  }
}

TEST(GpuSamplingKernels, GreedyDrawsTakeTheFirstMaximum) {
  REQUIRE_GPUS(1);
  for (const i64 vocab : vocabs) {
    const i64 stride = vocab + 3;
    const auto logits = make_logits(vocab, stride, static_cast<std::uint32_t>(vocab) + 1);
    const device_vec<float> d_logits(logits);
    std::vector<host_row> ref;
    for (int r = 0; r < row_count; ++r) {
      ref.emplace_back(logits.data() + r * stride, vocab, 1.0 / 0.7);
      // The reference itself: the lower id of the planted tie (row 0: all tied, id 0).
      EXPECT_EQ(ref.back().argmax, r == 0 ? 0 : tie_of(r, vocab).first) << "row " << r;
    }
    for (const int draws : draw_counts) {
      SCOPED_TRACE(testing::Message() << "vocab " << vocab << ", " << draws << " draws");
      const auto rows = draw_rows(draws);
      std::vector<double> out;
      ASSERT_NO_FATAL_FAILURE(run_sampler(d_logits, vocab, stride, rows, nullptr, 1.0 / 0.7, out));
      for (int d = 0; d < draws; ++d) {
        const host_row& h = ref[static_cast<std::size_t>(rows[static_cast<std::size_t>(d)])];
        EXPECT_EQ(out[2 * d], static_cast<double>(h.argmax))
          << "draw " << d << ", row " << rows[static_cast<std::size_t>(d)];
        expect_logprob(out[2 * d + 1], h.logprob(h.argmax));
      }
    }
  }
}

// u at 1 or just below it: every cdf may round to <= u (ATen's count is then vocab, clamped to
// vocab - 1) or the last ones above it; either way an id of the row's top end, never vocab.
TEST(GpuSamplingKernels, UniformsAtOneStayInsideTheVocab) {
  REQUIRE_GPUS(1);
  for (const i64 vocab : vocabs) {
    SCOPED_TRACE(testing::Message() << "vocab " << vocab);
    const auto logits = make_logits(vocab, vocab, 5);
    const device_vec<float> d_logits(logits);
    const std::vector<i64> rows = {1, 0, 7, 4, 4};
    const std::vector<double> u = {std::nextafter(1.0, 0.0), 1.0, 1.0 - 1e-15,
                                   std::nextafter(1.0, 0.0), 1.0};
    std::vector<double> out;
    ASSERT_NO_FATAL_FAILURE(run_sampler(d_logits, vocab, vocab, rows, &u, 1.0, out));
    for (std::size_t d = 0; d < rows.size(); ++d) {
      const host_row h(logits.data() + rows[d] * vocab, vocab, 1.0);
      const double token = out[2 * d];
      ASSERT_GE(token, 0.0) << "draw " << d;
      ASSERT_LE(token, static_cast<double>(vocab - 1)) << "draw " << d;
      ASSERT_EQ(token, std::floor(token)) << "draw " << d;
      const i64 t = static_cast<i64>(token);
      EXPECT_GE(h.cdf[static_cast<std::size_t>(t)], 1.0 - 1e-9) << "draw " << d << ", token " << t;
      expect_logprob(out[2 * d + 1], h.logprob(t));
    }
  }
}

// Two runs, the second over a scratch of other garbage: the same bits (sums in a fixed order).
TEST(GpuSamplingKernels, RunsAreBitwiseIdentical) {
  REQUIRE_GPUS(1);
  const i64 vocab = 151936, stride = vocab + 3;
  const auto logits = make_logits(vocab, stride, 9);
  const device_vec<float> d_logits(logits);
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (const int draws : {64, 200}) {
    const auto rows = draw_rows(draws);
    std::vector<double> u;
    for (int d = 0; d < draws; ++d)
      u.push_back(uniform(rng)); // any u: boundaries included, the bits must still repeat
    for (const bool greedy : {false, true}) {
      std::vector<double> first, second;
      ASSERT_NO_FATAL_FAILURE(run_sampler(d_logits, vocab, stride, rows, greedy ? nullptr : &u,
                                          1.0 / 0.9, first, 0x00));
      ASSERT_NO_FATAL_FAILURE(run_sampler(d_logits, vocab, stride, rows, greedy ? nullptr : &u,
                                          1.0 / 0.9, second, 0xff));
      ASSERT_EQ(first.size(), second.size());
      EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(double)), 0)
        << draws << " draws, greedy " << greedy;
    }
  }
}

// Host-side checks, before any launch: no device needed (the pointers are never read).
TEST(GpuSamplingKernels, InvalidArgumentsThrow) {
  std::vector<float> logits(64);
  std::vector<i64> rows(4, 0);
  std::vector<double> u(4, 0.5), out(8);
  std::vector<double> scratch(1024);
  const auto call = [&](i64 vocab, i64 stride, int draws, bool greedy, const double* uniforms,
                        void* scr, double* o) {
    kernels::sample_plain(logits.data(), vocab, stride, rows.data(), uniforms, draws, 1.0,
                          greedy, o, scr, nullptr);
  };
  EXPECT_THROW(kernels::sample_plain_scratch_bytes(0, 1), std::invalid_argument);
  EXPECT_THROW(kernels::sample_plain_scratch_bytes(-3, 1), std::invalid_argument);
  EXPECT_THROW(kernels::sample_plain_scratch_bytes(10, -1), std::invalid_argument);
  EXPECT_THROW(kernels::sample_plain_scratch_bytes(i64{1} << 40, 1), std::invalid_argument);
  EXPECT_EQ(kernels::sample_plain_scratch_bytes(151936, 0), 0u);
  EXPECT_EQ(kernels::sample_plain_scratch_bytes(151936, 64),
            64 * kernels::sample_plain_scratch_bytes(151936, 1));
  EXPECT_GT(kernels::sample_plain_scratch_bytes(37, 1), 0u);

  EXPECT_THROW(call(0, 16, 1, false, u.data(), scratch.data(), out.data()),
               std::invalid_argument);
  EXPECT_THROW(call(16, 16, -1, false, u.data(), scratch.data(), out.data()),
               std::invalid_argument);
  EXPECT_THROW(call(16, 15, 1, false, u.data(), scratch.data(), out.data()),
               std::invalid_argument); // rows would overlap
  EXPECT_THROW(call(16, 16, 1, false, nullptr, scratch.data(), out.data()),
               std::invalid_argument); // sampled draws need uniforms
  EXPECT_THROW(call(16, 16, 1, true, nullptr, nullptr, out.data()), std::invalid_argument);
  EXPECT_THROW(call(16, 16, 1, true, nullptr, scratch.data(), nullptr), std::invalid_argument);
  EXPECT_THROW(call(16, 16, 1, true, nullptr,
                    reinterpret_cast<std::uint8_t*>(scratch.data()) + 4, out.data()),
               std::invalid_argument); // misaligned scratch
  // No draws: nothing to launch, nothing to check but the shape.
  EXPECT_NO_THROW(call(16, 16, 0, false, nullptr, nullptr, nullptr));
}

} // namespace
