#define PCRE2_CODE_UNIT_WIDTH 8
#include "runtime/tokenizer/split_regex.hpp"

#include <cstdint>
#include <pcre2.h>

#include "runtime/tokenizer/error.hpp"

namespace refit::tokenizer {

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

// Per-thread match data and JIT stack: encode() is const and may run on many threads.
struct thread_scratch {
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  pcre2_match_context* ctx = pcre2_match_context_create(nullptr);
  thread_scratch() {
    if (stack && ctx)
      pcre2_jit_stack_assign(ctx, nullptr, stack);
  }
  ~thread_scratch() {
    pcre2_match_context_free(ctx);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(md);
  }
};

thread_scratch& scratch() {
  thread_local thread_scratch s;
  return s;
}

} // namespace

struct split_regex::impl {
  pcre2_code* code = nullptr;
  ~impl() { pcre2_code_free(code); }
};

split_regex::split_regex(const std::string& pattern, bool literal, const std::string& file,
                         const std::string& field)
    : pattern_(pattern), impl_(std::make_unique<impl>()) {
  if (pattern.empty())
    throw tokenizer_error(file, field, "empty split pattern");
  int err = 0;
  PCRE2_SIZE off = 0;
  std::uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0u);
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts,
                              &err, &off, nullptr);
  if (!impl_->code)
    throw tokenizer_error(file, field, "bad regex at pattern offset " + std::to_string(off) +
                                           ": " + pcre2_message(err));
  (void)pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE); // falls back to the interpreter
}

split_regex::~split_regex() = default;

bool split_regex::find(std::string_view s, std::size_t start, std::size_t& ms,
                       std::size_t& me) const {
  auto& sc = scratch();
  int rc = pcre2_match(impl_->code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), start,
                       PCRE2_NO_UTF_CHECK, sc.md, sc.ctx);
  if (rc == PCRE2_ERROR_NOMATCH)
    return false;
  if (rc < 0)
    throw tokenizer_error("", "pre_tokenizer pattern", "regex match failed: " + pcre2_message(rc));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(sc.md);
  ms = ov[0];
  me = ov[1];
  return true;
}

std::size_t split_regex::char_len(std::string_view s, std::size_t i) {
  auto c = static_cast<unsigned char>(s[i]);
  return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

} // namespace refit::tokenizer
