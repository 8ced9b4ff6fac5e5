#include "runtime/checkpoint/convert.hpp"

#include <cmath>
#include <cstring>
#include <limits>

namespace refit::checkpoint {

namespace {

float half_to_float(std::uint16_t h) {
  const bool negative = (h & 0x8000u) != 0;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  float v;
  if (exponent == 0)
    v = std::ldexp(static_cast<float>(mantissa), -24);
  else if (exponent == 31)
    v = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else
    v = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  return negative ? -v : v;
}

std::uint16_t float_to_half(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t mag = x & 0x7fffffffu;
  if (mag > 0x7f800000u)
    return sign | 0x7e00u; // NaN
  const float a = std::fabs(f);
  if (a >= 65520.0f)
    return sign | 0x7c00u; // rounds to infinity
  if (a < std::ldexp(1.0f, -14)) // subnormal: units of 2^-24, nearest even
    return sign | static_cast<std::uint16_t>(std::nearbyint(std::ldexp(a, 24)));
  int e = 0;
  const float m = std::frexp(a, &e); // a = m * 2^e, m in [0.5, 1)
  // 11 significant bits: a / 2^(e-11) in [1024, 2048), rounded to nearest even.
  auto sig = static_cast<std::uint32_t>(std::nearbyint(std::ldexp(m, 11)));
  int exp_field = e - 1 + 15;
  if (sig == 2048) { // rounding carried into the next binade
    sig = 1024;
    ++exp_field;
  }
  return static_cast<std::uint16_t>(sign | (exp_field << 10) | (sig & 0x3ffu));
}

float load(model::dtype dt, const std::byte* p) {
  switch (dt) {
    case model::dtype::float32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case model::dtype::bfloat16: {
      std::uint16_t b;
      std::memcpy(&b, p, 2);
      return model::bf16_to_float(b);
    }
    case model::dtype::float16: {
      std::uint16_t h;
      std::memcpy(&h, p, 2);
      return half_to_float(h);
    }
  }
  return 0.0f;
}

void store(model::dtype dt, float f, std::byte* p) {
  switch (dt) {
    case model::dtype::float32: std::memcpy(p, &f, 4); return;
    case model::dtype::bfloat16: {
      const std::uint16_t b = model::float_to_bf16(f);
      std::memcpy(p, &b, 2);
      return;
    }
    case model::dtype::float16: {
      const std::uint16_t h = float_to_half(f);
      std::memcpy(p, &h, 2);
      return;
    }
  }
}

} // namespace

void convert_elements(model::dtype from, const std::byte* src, model::dtype to, std::byte* dst,
                      std::uint64_t count) {
  const std::size_t in = model::dtype_size(from), out = model::dtype_size(to);
  if (from == to) {
    std::memcpy(dst, src, count * in);
    return;
  }
  for (std::uint64_t i = 0; i < count; ++i)
    store(to, load(from, src + i * in), dst + i * out);
}

} // namespace refit::checkpoint
