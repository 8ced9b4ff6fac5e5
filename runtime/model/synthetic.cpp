// Deterministic synthetic weights (synthetic.hpp): the counter-based weight source of the
// trainer ranks, the runtime's generated checkpoint, the benchmarks and the tests.
#include "runtime/model/synthetic.hpp"

#include "runtime/model/digest.hpp"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace refit::model {

// ---------------------------------------------------------------------------------------
// Synthetic weights
// ---------------------------------------------------------------------------------------

namespace {


std::uint64_t fnv1a64(const std::string& s) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

// Start of the splitmix64 stream of (seed, tensor, step); step 0 is the init stream.
std::uint64_t stream_base(std::uint64_t seed, std::uint64_t name_hash, std::uint64_t step) {
  return mix64(mix64(mix64(seed + golden_gamma) ^ name_hash) ^ (step * golden_gamma + 1));
}

// Element `index` of a stream as a float in [-1, 1) (24 random bits, exactly representable).
float uniform(std::uint64_t base, std::uint64_t index) {
  const std::uint64_t bits = mix64(base + (index + 1) * golden_gamma) >> 40;
  return static_cast<float>(bits) * (1.0f / 8388608.0f) - 1.0f;
}

// Products of two floats are exact in double, so these are independent of FMA contraction.
float initial_value(bool is_norm, float init_scale, float u) {
  const double scaled = double{init_scale} * double{u};
  return static_cast<float>(is_norm ? 1.0 + scaled : scaled);
}

float stepped_value(float w, float lr, float noise) {
  return static_cast<float>(double{w} + double{lr} * double{noise});
}

bool is_norm_weight(const std::string& name) {
  static const std::string suffix = "norm.weight";
  return name.size() >= suffix.size()
         && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Element codecs for the storage dtype (unaligned-safe).
struct bf16_codec {
  using storage = std::uint16_t;
  static storage encode(float f) { return float_to_bf16(f); }
  static float decode(storage s) { return bf16_to_float(s); }
};
struct fp16_codec {
  using storage = std::uint16_t;
  static storage encode(float f) { return float_to_half(f); }
  static float decode(storage s) { return half_to_float(s); }
};
struct fp32_codec {
  using storage = float;
  static storage encode(float f) { return f; }
  static float decode(storage s) { return s; }
};

template <class Codec>
void fill_elements(bool is_norm, const synthetic_weights& w, const std::vector<std::uint64_t>& bases,
                   std::uint64_t begin, std::uint64_t count, std::byte* out) {
  using storage = typename Codec::storage;
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t index = begin + i;
    storage value;
    if (w.initial)
      std::memcpy(&value, out + i * sizeof(storage), sizeof(storage)); // read before the loop
    else
      value = Codec::encode(initial_value(is_norm, w.init_scale, uniform(bases[0], index)));
    for (std::size_t s = 1; s < bases.size(); ++s)
      value = Codec::encode(stepped_value(Codec::decode(value), w.lr, uniform(bases[s], index)));
    std::memcpy(out + i * sizeof(storage), &value, sizeof(storage));
  }
}

template <class Codec>
void step_elements(const synthetic_weights& w, std::uint64_t base, std::uint64_t begin,
                   std::uint64_t count, std::byte* inout) {
  using storage = typename Codec::storage;
  for (std::uint64_t i = 0; i < count; ++i) {
    storage value;
    std::memcpy(&value, inout + i * sizeof(storage), sizeof(storage));
    value = Codec::encode(stepped_value(Codec::decode(value), w.lr, uniform(base, begin + i)));
    std::memcpy(inout + i * sizeof(storage), &value, sizeof(storage));
  }
}

void check_range(const param_meta& p, std::uint64_t begin, std::uint64_t count) {
  const std::uint64_t numel = p.numel();
  if (begin > numel || count > numel - begin)
    throw model_error(p.name, "elements [" + std::to_string(begin) + ", "
                                + std::to_string(begin + count) + ") are out of range of "
                                + std::to_string(numel) + " elements");
}

} // namespace

std::vector<std::uint64_t> synthetic_bases(const std::string& name, std::uint64_t seed,
                                           std::uint64_t step) {
  const std::uint64_t name_hash = fnv1a64(name);
  std::vector<std::uint64_t> bases(step + 1);
  for (std::uint64_t s = 0; s <= step; ++s)
    bases[s] = stream_base(seed, name_hash, s);
  return bases;
}

bool synthetic_is_norm(const std::string& name) { return is_norm_weight(name); }

void fill_synthetic(const param_meta& p, const synthetic_weights& w, std::uint64_t step,
                    std::uint64_t begin, std::uint64_t count, std::byte* out) {
  check_range(p, begin, count);
  const std::vector<std::uint64_t> bases = synthetic_bases(p.name, w.seed, step);
  const bool is_norm = is_norm_weight(p.name);
  if (w.initial) {
    w.initial->read(p, begin * dtype_size(p.dt), count * dtype_size(p.dt), out);
    if (step == 0)
      return;
  }
  switch (p.dt) {
    case dtype::bfloat16: return fill_elements<bf16_codec>(is_norm, w, bases, begin, count, out);
    case dtype::float16: return fill_elements<fp16_codec>(is_norm, w, bases, begin, count, out);
    case dtype::float32: return fill_elements<fp32_codec>(is_norm, w, bases, begin, count, out);
  }
  throw model_error(p.name, "unknown dtype code " + std::to_string(static_cast<int>(p.dt)));
}

void apply_synthetic_step(const param_meta& p, const synthetic_weights& w, std::uint64_t step,
                          std::uint64_t begin, std::uint64_t count, std::byte* inout) {
  if (step == 0)
    throw model_error(p.name, "synthetic step must be >= 1 (step 0 is the initial value)");
  check_range(p, begin, count);
  const std::uint64_t base = stream_base(w.seed, fnv1a64(p.name), step);
  switch (p.dt) {
    case dtype::bfloat16: return step_elements<bf16_codec>(w, base, begin, count, inout);
    case dtype::float16: return step_elements<fp16_codec>(w, base, begin, count, inout);
    case dtype::float32: return step_elements<fp32_codec>(w, base, begin, count, inout);
  }
  throw model_error(p.name, "unknown dtype code " + std::to_string(static_cast<int>(p.dt)));
}

} // namespace refit::model
