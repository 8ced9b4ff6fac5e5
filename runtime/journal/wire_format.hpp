// Internal to runtime/journal: the binary element format. Integers and floats little-endian,
// fixed width (bool: one byte 0/1); strings and sequences a base-128 varint count, then the
// bytes / elements; structs their fields in the order of their CAF `inspect` function.
// The reader takes untrusted bytes.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <caf/atom.hpp>
#include <caf/meta/annotation.hpp>

namespace refit::journal::detail {

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};

class writer {
public:
  using result_type = void;
  static constexpr bool reads_state = true;
  static constexpr bool writes_state = false;

  explicit writer(std::string& out) : out_(out) {}

  template <class... Ts>
  void operator()(Ts&&... xs) {
    (apply(xs), ...);
  }

  void varint(std::uint64_t x) {
    while (x >= 0x80) {
      out_.push_back(static_cast<char>((x & 0x7F) | 0x80));
      x >>= 7;
    }
    out_.push_back(static_cast<char>(x));
  }

  template <class T>
  void apply(const T& x) {
    using U = std::decay_t<T>;
    if constexpr (std::is_base_of<caf::meta::annotation, U>::value) {
      // type names etc.: nothing on the wire
    } else if constexpr (std::is_same<U, bool>::value) {
      out_.push_back(x ? 1 : 0);
    } else if constexpr (std::is_same<U, caf::atom_value>::value) {
      fixed(static_cast<std::uint64_t>(x));
    } else if constexpr (std::is_enum<U>::value) {
      fixed(static_cast<std::underlying_type_t<U>>(x));
    } else if constexpr (std::is_integral<U>::value) {
      fixed(x);
    } else if constexpr (std::is_same<U, float>::value) {
      std::uint32_t bits;
      std::memcpy(&bits, &x, sizeof(bits));
      fixed(bits);
    } else if constexpr (std::is_same<U, double>::value) {
      std::uint64_t bits;
      std::memcpy(&bits, &x, sizeof(bits));
      fixed(bits);
    } else if constexpr (std::is_same<U, std::string>::value) {
      varint(x.size());
      out_.append(x);
    } else if constexpr (is_vector<U>::value) {
      varint(x.size());
      for (const auto& y : x)
        apply(y);
    } else {
      inspect(*this, const_cast<U&>(x)); // the writer only reads
    }
  }

private:
  template <class T>
  void fixed(T x) {
    using V = std::make_unsigned_t<T>;
    auto v = static_cast<V>(x);
    for (std::size_t i = 0; i < sizeof(T); ++i)
      out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  }

  std::string& out_;
};

// Reads untrusted bytes: every count is checked against what is left before anything is
// allocated; the first problem stops the reader and is kept as its error.
class reader {
public:
  using result_type = void;
  static constexpr bool reads_state = false;
  static constexpr bool writes_state = true;

  reader(const std::string& data) : p_(data.data()), end_(data.data() + data.size()) {}

  template <class... Ts>
  void operator()(Ts&&... xs) {
    (apply(xs), ...);
  }

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  bool at_end() const { return p_ == end_; }
  std::size_t remaining() const { return static_cast<std::size_t>(end_ - p_); }

  void fail(const std::string& what) {
    if (error_.empty())
      error_ = what;
  }

  bool varint(std::uint64_t& x) {
    x = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) {
        fail("truncated varint");
        return false;
      }
      auto b = static_cast<std::uint8_t>(*p_++);
      if (shift == 63 && (b & 0x7E) != 0) {
        fail("varint overflows 64 bits");
        return false;
      }
      x |= static_cast<std::uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0)
        return true;
    }
    fail("varint longer than 10 bytes");
    return false;
  }

  // A count of items that each take at least one byte.
  bool count(std::size_t& n, const char* what) {
    std::uint64_t v = 0;
    if (!varint(v))
      return false;
    if (v > remaining()) {
      fail(std::string(what) + " count " + std::to_string(v) + " exceeds the "
           + std::to_string(remaining()) + " bytes left");
      return false;
    }
    n = static_cast<std::size_t>(v);
    return true;
  }

  template <class T>
  void apply(T& x) {
    if (!ok())
      return;
    using U = std::decay_t<T>;
    if constexpr (std::is_base_of<caf::meta::annotation, U>::value) {
      // nothing on the wire
    } else if constexpr (std::is_same<U, bool>::value) {
      std::uint8_t b = 0;
      fixed(b);
      if (ok() && b > 1)
        fail("bool byte " + std::to_string(b) + " is neither 0 nor 1");
      x = b == 1;
    } else if constexpr (std::is_same<U, caf::atom_value>::value) {
      std::uint64_t v = 0;
      fixed(v);
      x = static_cast<caf::atom_value>(v);
    } else if constexpr (std::is_enum<U>::value) {
      std::underlying_type_t<U> v{};
      fixed(v);
      x = static_cast<U>(v);
    } else if constexpr (std::is_integral<U>::value) {
      fixed(x);
    } else if constexpr (std::is_same<U, float>::value) {
      std::uint32_t bits = 0;
      fixed(bits);
      std::memcpy(&x, &bits, sizeof(bits));
    } else if constexpr (std::is_same<U, double>::value) {
      std::uint64_t bits = 0;
      fixed(bits);
      std::memcpy(&x, &bits, sizeof(bits));
    } else if constexpr (std::is_same<U, std::string>::value) {
      std::uint64_t n = 0;
      if (!varint(n))
        return;
      if (n > remaining())
        return fail("string of " + std::to_string(n) + " bytes exceeds the "
                    + std::to_string(remaining()) + " bytes left");
      x.assign(p_, static_cast<std::size_t>(n));
      p_ += n;
    } else if constexpr (is_vector<U>::value) {
      std::size_t n = 0;
      if (!count(n, "sequence"))
        return;
      x.clear();
      for (std::size_t i = 0; i < n && ok(); ++i) {
        typename U::value_type y{};
        apply(y);
        x.push_back(std::move(y));
      }
    } else {
      inspect(*this, x);
    }
  }

private:
  template <class T>
  void fixed(T& x) {
    if (remaining() < sizeof(T))
      return fail("truncated: " + std::to_string(sizeof(T)) + "-byte value, "
                  + std::to_string(remaining()) + " bytes left");
    using V = std::make_unsigned_t<T>;
    V v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i)
      v |= static_cast<V>(static_cast<std::uint8_t>(p_[i])) << (8 * i);
    p_ += sizeof(T);
    x = static_cast<T>(v);
  }

  const char* p_;
  const char* end_;
  std::string error_;
};

} // namespace refit::journal::detail
