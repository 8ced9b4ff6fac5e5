// refit embedding API: typed failures and results. Part of the public header set
// (installed as include/refit/); plain C++17, no CAF or other dependency.
#pragma once

#include <optional>
#include <string>
#include <utility>

#if defined(_WIN32)
#define REFIT_API
#else
#define REFIT_API __attribute__((visibility("default")))
#endif

namespace refit::api {

// A typed failure. `code` is the name of refit's error code, e.g. "rank_lost",
// "coordinator_lost", "unauthorized", "protocol_mismatch", "gate_failed" (the full list is in
// docs/architecture.md, "Errors"); a failure of the actor framework itself has code "caf".
// An empty code means no failure.
struct error {
  std::string code;
  std::string where;   // the config key, rank, phase or address the failure is about
  std::string message;
  std::string text;    // "refit.<code> at <where>: <message>"
  explicit operator bool() const { return !code.empty(); }
};

// A value or the typed failure that prevented it.
template <class T>
class result {
public:
  result(T value) : value_(std::move(value)) {}
  result(error failure) : failure_(std::move(failure)) {}

  bool ok() const { return value_.has_value(); }
  explicit operator bool() const { return ok(); }
  // The value; only when ok().
  const T& value() const { return *value_; }
  T& value() { return *value_; }
  const T& operator*() const { return *value_; }
  const T* operator->() const { return &*value_; }
  // The failure; only when !ok().
  const error& failure() const { return failure_; }

private:
  std::optional<T> value_;
  error failure_;
};

} // namespace refit::api
