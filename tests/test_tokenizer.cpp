// refit::tokenizer: (a) conformance with HF tokenizers' ids on the real Qwen3 tokenizer.json and
// the tiny fixture tokenizer (golden ids written by HF tokenizers), hand-derivable cases
// (ByteLevel alphabet, NFC, merges of a handmade vocabulary, added-token options);
// (b) bad tokenizer files, each refused naming file and field; (c) refit-tokenize as a process.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/tokenizer/byte_level.hpp"
#include "runtime/tokenizer/json_file.hpp"
#include "runtime/tokenizer/tokenize_bench.hpp"
#include "runtime/tokenizer/tokenizer.hpp"
#include "runtime/tokenizer/unicode.hpp"
#include "tests/run_command.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using refit::tokenizer::tokenizer;
using refit::tokenizer::tokenizer_error;
using ids_t = std::vector<std::int32_t>;

namespace {

const fs::path source_dir = REFIT_SOURCE_DIR;
const fs::path qwen3_dir = REFIT_QWEN3_TOKENIZER_DIR;

struct temp_dir {
  fs::path path;
  temp_dir() {
    std::string t = (fs::temp_directory_path() / "refit_tok_XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path write(const std::string& name, const std::string& bytes) const {
    std::ofstream(path / name, std::ios::binary) << bytes;
    return path / name;
  }
};

// A handmade byte-level BPE: a, b, c, Ġ (space) and merges "a b" -> ab, "ab c" -> abc,
// "Ġ a" -> Ġa; Qwen's Split regex; NFC.
json tiny_doc() {
  return json{
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens",
       json::array({{{"id", 7}, {"content", "<|end|>"}, {"special", true}, {"normalized", false},
                     {"lstrip", false}, {"rstrip", false}, {"single_word", false}}})},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Split"},
                       {"pattern", {{"Regex", R"( ?\p{L}+|\s+(?!\S)|\s+)"}}},
                       {"behavior", "Isolated"},
                       {"invert", false}},
                      {{"type", "ByteLevel"}, {"add_prefix_space", false},
                       {"trim_offsets", false}, {"use_regex", false}}})}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"byte_fallback", false},
        {"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {"\xC4\xA0", 3}, {"ab", 4}, {"abc", 5},
                   {"\xC4\xA0" "a", 6}}},
        {"merges", json::array({"a b", "ab c", "\xC4\xA0 a"})}}}};
}

tokenizer load_doc(const json& doc) { return tokenizer::from_json_bytes(doc.dump(), "tiny.json"); }

std::string show(const ids_t& ids) {
  std::ostringstream o;
  o << json(ids).dump();
  return o.str();
}

// Every line {"text","ids","decoded","decoded_skip_special"} must match exactly.
void check_golden(const tokenizer& tok, const fs::path& golden) {
  std::ifstream in(golden);
  ASSERT_TRUE(in) << "missing golden file " << golden;
  std::string line;
  std::size_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    auto g = json::parse(line);
    const auto text = g.at("text").get<std::string>();
    const auto want = g.at("ids").get<ids_t>();
    auto got = tok.encode(text);
    ASSERT_EQ(got, want) << golden.filename() << " line " << n << " text " << json(text).dump()
                         << "\n  got  " << show(got) << "\n  want " << show(want);
    ASSERT_EQ(tok.decode(want, false), g.at("decoded").get<std::string>())
        << golden.filename() << " line " << n << " decode of " << json(text).dump();
    ASSERT_EQ(tok.decode(want, true), g.at("decoded_skip_special").get<std::string>())
        << golden.filename() << " line " << n << " decode(skip special) of " << json(text).dump();
  }
  EXPECT_GT(n, 0u) << golden << " is empty";
}

void expect_refused(const std::function<void()>& f, const std::string& file_part,
                    const std::string& field_part, const std::string& message_part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one about " << message_part;
  } catch (const tokenizer_error& e) {
    EXPECT_NE(e.file.find(file_part), std::string::npos) << e.what();
    EXPECT_NE(e.field.find(field_part), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(message_part), std::string::npos) << e.what();
  }
}

} // namespace

TEST(ByteLevel, AlphabetIsGpt2s) {
  const auto& a = refit::tokenizer::byte_level_alphabet::get();
  EXPECT_EQ(a.code_point('!'), '!');
  EXPECT_EQ(a.code_point('~'), '~');
  EXPECT_EQ(a.code_point(0xA1), 0xA1);
  EXPECT_EQ(a.code_point(0xAC), 0xAC);
  EXPECT_EQ(a.code_point(0xAE), 0xAE);
  EXPECT_EQ(a.code_point(0xFF), 0xFF);
  EXPECT_EQ(a.code_point(0x00), 0x100);
  EXPECT_EQ(a.code_point(' '), 0x120);  // Ġ
  EXPECT_EQ(a.code_point('\n'), 0x10A); // Ċ
  EXPECT_EQ(a.code_point(0x7F), 0x121);
  EXPECT_EQ(a.code_point(0xA0), 0x142);
  EXPECT_EQ(a.code_point(0xAD), 0x143); // the last of the 68 remapped bytes
  std::string back;
  for (int b = 0; b < 256; ++b) {
    back.clear();
    ASSERT_TRUE(a.decode_token(a.utf8(static_cast<unsigned char>(b)), back));
    ASSERT_EQ(back, std::string(1, static_cast<char>(b)));
  }
  EXPECT_FALSE(a.decode_token("a b", back)); // U+0020 is not in the alphabet
}

TEST(Unicode, NfcAndLossyUtf8) {
  namespace u = refit::tokenizer::unicode;
  EXPECT_EQ(u::nfc("e\xCC\x81"), "\xC3\xA9");                 // e + U+0301 -> é
  EXPECT_EQ(u::nfc("\xE2\x84\xAB"), "\xC3\x85");              // U+212B ANGSTROM SIGN -> Å
  EXPECT_EQ(u::nfc("\xEF\xAC\x81"), "\xEF\xAC\x81");          // ﬁ: NFC keeps compatibility chars
  EXPECT_EQ(u::nfc("\xE1\x84\x80\xE1\x85\xA1"), "\xEA\xB0\x80"); // jamo -> 가
  EXPECT_EQ(u::invalid_utf8_offset("ab\xC3"), 2u);
  EXPECT_EQ(u::invalid_utf8_offset("ab\xC3\xA9"), u::npos);
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(u::from_utf8_lossy("a\xE4\xBD"), "a" + fffd);     // truncated 3-byte sequence
  EXPECT_EQ(u::from_utf8_lossy("\xED\xA0\x80"), fffd + fffd + fffd); // surrogate
  EXPECT_EQ(u::from_utf8_lossy("\xF0\x9F\x98"), fffd);
  EXPECT_EQ(u::from_utf8_lossy("\xC3x"), fffd + "x");
}

TEST(Bpe, HandmadeMerges) {
  auto tok = load_doc(tiny_doc());
  EXPECT_EQ(tok.encode("abc"), (ids_t{5}));
  EXPECT_EQ(tok.encode("abab"), (ids_t{4, 4}));
  EXPECT_EQ(tok.encode("cab"), (ids_t{2, 4}));
  EXPECT_EQ(tok.encode("ba"), (ids_t{1, 0}));
  EXPECT_EQ(tok.encode("ab abc"), (ids_t{4, 3, 5})); // " abc": a+b first (rank 0), then ab+c
  EXPECT_EQ(tok.encode(""), ids_t{});
  EXPECT_EQ(tok.encode("abc<|end|>ab"), (ids_t{5, 7, 4}));
  EXPECT_EQ(tok.decode({5, 7, 4}, false), "abc<|end|>ab");
  EXPECT_EQ(tok.decode({5, 7, 4}, true), "abcab");
  EXPECT_EQ(tok.vocab_size(), 8u);
  expect_refused([&] { (void)tok.decode({5, 8}, false); }, "", "ids[1]", "id 8 is not in");
  expect_refused([&] { (void)tok.decode({-1}, false); }, "", "ids[0]", "id -1 is not in");
  expect_refused([&] { (void)tok.encode("a\xFF"); }, "", "text", "invalid UTF-8 at byte 1");
}

TEST(Bpe, MergePairsAndIgnoreMerges) {
  auto doc = tiny_doc();
  doc["model"]["merges"] = json::array({json::array({"a", "b"}), json::array({"ab", "c"})});
  auto tok = load_doc(doc);
  EXPECT_EQ(tok.encode("abc"), (ids_t{5}));
  // Without a merge producing "Ġa" directly from the vocab, ignore_merges takes the word whole.
  doc["model"]["merges"] = json::array({"a b"});
  doc["model"]["vocab"]["ca"] = 8;
  EXPECT_EQ(load_doc(doc).encode("ca"), (ids_t{2, 0}));
  doc["model"]["ignore_merges"] = true;
  EXPECT_EQ(load_doc(doc).encode("ca"), (ids_t{8}));
}

TEST(AddedTokens, StripSingleWordNormalized) {
  auto doc = tiny_doc();
  doc["added_tokens"].push_back({{"id", 8}, {"content", "<m>"}, {"special", false},
                                 {"normalized", false}, {"lstrip", true}, {"rstrip", true},
                                 {"single_word", false}});
  doc["added_tokens"].push_back({{"id", 9}, {"content", "cc"}, {"special", false},
                                 {"normalized", true}, {"lstrip", false}, {"rstrip", false},
                                 {"single_word", true}});
  auto tok = load_doc(doc);
  EXPECT_EQ(tok.encode("a <m>  b"), (ids_t{0, 8, 1}));  // the spaces go with <m>
  EXPECT_EQ(tok.encode("cc"), (ids_t{9}));
  EXPECT_EQ(tok.encode(" cc"), (ids_t{3, 9}));         // not a word char before: matched
  EXPECT_EQ(tok.encode("acc"), (ids_t{0, 2, 2}));       // inside a word: not matched
  EXPECT_EQ(tok.decode({8, 9, 7}, true), "<m>cc");      // only special tokens are skipped
}

TEST(AddedTokens, NormalizedTokensMatchAfterNfc) {
  auto doc = tiny_doc();
  doc["added_tokens"].push_back({{"id", 8}, {"content", "e\xCC\x81"}, {"special", false},
                                 {"normalized", true}}); // NFD é: its pattern is NFC'd too
  doc["added_tokens"].push_back({{"id", 9}, {"content", "c\xCC\xA7"}, {"special", false},
                                 {"normalized", false}}); // raw match only, before NFC
  auto tok = load_doc(doc);
  EXPECT_EQ(tok.encode("ae\xCC\x81"), (ids_t{0, 8}));
  EXPECT_EQ(tok.encode("a\xC3\xA9"), (ids_t{0, 8}));
  EXPECT_EQ(tok.encode("c\xCC\xA7" "a"), (ids_t{9, 0}));
  // Precomposed ç is not the raw pattern; its bytes are not in the vocabulary: dropped, as HF
  // does without an unk token.
  EXPECT_EQ(tok.encode("\xC3\xA7" "a"), (ids_t{0}));
}

TEST(PreTokenizer, Gpt2ByteLevelWithPrefixSpace) {
  auto doc = tiny_doc();
  doc["normalizer"] = nullptr;
  doc["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
  auto tok = load_doc(doc);
  EXPECT_EQ(tok.encode("ab"), (ids_t{3, 4}));         // " ab": a+b first, Ġ stays alone
  EXPECT_EQ(tok.encode(" a abc"), (ids_t{6, 3, 5}));  // already starts with a space
  EXPECT_EQ(tok.encode("ab<|end|>a"), (ids_t{3, 4, 7, 6})); // each piece gets its space
  doc["pre_tokenizer"]["add_prefix_space"] = false;
  EXPECT_EQ(load_doc(doc).encode("ab"), (ids_t{4}));
}

TEST(Encode, ConcurrentCallsAgree) {
  auto tok = load_doc(tiny_doc());
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i)
    texts.push_back(std::string(static_cast<std::size_t>(i % 7), 'a') + " abc" +
                    std::string(static_cast<std::size_t>(i % 5), 'b') + "c ab");
  std::vector<ids_t> want;
  for (const auto& t : texts)
    want.push_back(tok.encode(t));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (int rep = 0; rep < 20; ++rep)
        for (std::size_t i = 0; i < texts.size(); ++i)
          if (tok.encode(texts[i]) != want[i])
            ++mismatches[static_cast<std::size_t>(w)];
    });
  for (auto& t : threads)
    t.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
  EXPECT_EQ(want[1], (ids_t{0, 3, 5, 1, 2, 3, 4})); // "a abcbc ab"
}

TEST(AddedTokens, LongestMatchFirst) {
  auto doc = tiny_doc();
  doc["added_tokens"].push_back({{"id", 8}, {"content", "<|end|>x"}, {"special", true},
                                 {"normalized", false}});
  auto tok = load_doc(doc);
  EXPECT_EQ(tok.encode("<|end|>xa"), (ids_t{8, 0}));
  EXPECT_EQ(tok.encode("<|end|>a"), (ids_t{7, 0}));
}

TEST(Qwen3, MatchesHfGolden) {
  ASSERT_TRUE(fs::is_regular_file(qwen3_dir / "tokenizer.json"))
      << "the Qwen3 tokenizer is missing at " << qwen3_dir << ": run .ci/install-deps";
  auto tok = tokenizer::load(qwen3_dir);
  EXPECT_EQ(tok.vocab_size(), 151669u);
  EXPECT_EQ(tok.token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(tok.stop_ids(), (ids_t{151645})); // tokenizer_config.json eos_token
  EXPECT_EQ(tok.pad_id(), 151643);
  EXPECT_EQ(tok.bos_id(), std::nullopt);
  check_golden(tok, source_dir / "tests/data/tokenizer/qwen3_golden.jsonl");
}

TEST(Qwen3, StopIdsFromGenerationConfig) {
  ASSERT_TRUE(fs::is_regular_file(qwen3_dir / "tokenizer.json")) << "run .ci/install-deps";
  temp_dir d;
  fs::copy_file(qwen3_dir / "tokenizer.json", d.path / "tokenizer.json");
  fs::copy_file(qwen3_dir / "tokenizer_config.json", d.path / "tokenizer_config.json");
  d.write("generation_config.json", R"({"eos_token_id": [151645, 151643], "bos_token_id": 151643})");
  auto tok = tokenizer::load(d.path / "tokenizer.json");
  EXPECT_EQ(tok.stop_ids(), (ids_t{151645, 151643}));
  EXPECT_EQ(tok.eos_id(), 151645);
  EXPECT_EQ(tok.pad_id(), 151643);
  d.write("generation_config.json", R"({"eos_token_id": 999999})");
  expect_refused([&] { (void)tokenizer::load(d.path); }, "generation_config.json",
                 "eos_token_id", "outside the vocabulary");
  d.write("generation_config.json", R"({"eos_token_id": 151645})");
  d.write("tokenizer_config.json", R"({"eos_token": {"content": "<|nope|>"}})");
  expect_refused([&] { (void)tokenizer::load(d.path); }, "tokenizer_config.json",
                 "eos_token", "'<|nope|>' is not in");
}

TEST(TinyKjv, MatchesHfGolden) {
  auto tok = tokenizer::load(source_dir / "tests/data/models/tiny-kjv");
  check_golden(tok, source_dir / "tests/data/tokenizer/tiny_golden.jsonl");
}

TEST(TokenizeBench, DigestStableAndBytesCounted) {
  auto tok = load_doc(tiny_doc());
  auto r = refit::tokenizer::run_tokenize_bench(tok, {"abc ab", "cab"}, 0.0);
  EXPECT_EQ(r.at("bytes_per_pass"), 9);
  EXPECT_EQ(r.at("tokens_per_pass"), 5); // "abc" 5 | " ab" 3 4 | "cab" 2 4
  EXPECT_EQ(r.at("ids_digest").get<std::string>().size(), 16u);
  auto again = refit::tokenizer::run_tokenize_bench(tok, {"abc ab", "cab"}, 0.0);
  EXPECT_EQ(again.at("ids_digest"), r.at("ids_digest"));
  auto other = refit::tokenizer::run_tokenize_bench(tok, {"cab", "abc ab"}, 0.0);
  EXPECT_NE(other.at("ids_digest"), r.at("ids_digest"));
}

// (b) Bad tokenizer files: each refused, naming the file and the field.
TEST(BadFiles, RefusedWithFileAndField) {
  temp_dir d;
  auto load_text = [&](const std::string& text) {
    auto p = d.write("tokenizer.json", text);
    return [p] { (void)tokenizer::load(p); };
  };
  auto with = [&](const std::function<void(json&)>& edit) {
    auto doc = tiny_doc();
    edit(doc);
    return load_text(doc.dump());
  };
  expect_refused(load_text("{\"model\": [1, 2,, 3]}"), "tokenizer.json", "",
                 "invalid JSON at byte offset 16");
  // Ids index dense tables: a sparse id far past the vocabulary is refused, not allocated.
  expect_refused(with([](json& j) { j["model"]["vocab"]["zz"] = 68888888; }), "tokenizer.json",
                 "model.vocab.zz", "token id 68888888 is out of range [0, 4194303]");
  expect_refused(with([](json& j) { j["model"]["type"] = "WordPiece"; }), "tokenizer.json",
                 "model.type", "unsupported model type 'WordPiece'");
  expect_refused(with([](json& j) { j["model"]["type"] = "Unigram"; }), "tokenizer.json",
                 "model.type", "unsupported model type 'Unigram'");
  expect_refused(with([](json& j) { j["normalizer"] = {{"type", "NFKD"}}; }), "tokenizer.json",
                 "normalizer.type", "unsupported normalizer type 'NFKD' in tokenizer.json");
  expect_refused(with([](json& j) {
                   j["normalizer"] = {{"type", "Sequence"},
                                      {"normalizers", json::array({{{"type", "NFC"}},
                                                                   {{"type", "Lowercase"}}})}};
                 }),
                 "tokenizer.json", "normalizer.normalizers[1].type", "'Lowercase'");
  expect_refused(with([](json& j) { j["model"].erase("merges"); }), "tokenizer.json",
                 "model.merges", "missing field");
  expect_refused(with([](json& j) { j["model"]["merges"][1] = "ab zz"; }), "tokenizer.json",
                 "model.merges[1]", "'zz' that is not in model.vocab");
  expect_refused(with([](json& j) { j["model"]["merges"][0] = "a  b"; }), "tokenizer.json",
                 "model.merges[0]", "one space");
  expect_refused(with([](json& j) { j["model"]["unk_token"] = "<unk>"; }), "tokenizer.json",
                 "model.unk_token", "unsupported unk_token");
  expect_refused(with([](json& j) { j["model"]["byte_fallback"] = true; }), "tokenizer.json",
                 "model.byte_fallback", "unsupported byte_fallback");
  expect_refused(with([](json& j) { j["model"]["dropout"] = 0.1; }), "tokenizer.json",
                 "model.dropout", "unsupported BPE dropout");
  expect_refused(with([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }),
                 "tokenizer.json", "pre_tokenizer.pretokenizers[0].behavior",
                 "unsupported Split behavior 'Removed'");
  expect_refused(with([](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(a"; }),
                 "tokenizer.json", "pre_tokenizer.pretokenizers[0].pattern.Regex", "bad regex");
  expect_refused(with([](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }),
                 "tokenizer.json", "pre_tokenizer.type", "unsupported pre_tokenizer type 'Whitespace'");
  expect_refused(with([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }), "tokenizer.json",
                 "decoder.type", "unsupported decoder type 'WordPiece'");
  expect_refused(with([](json& j) { j["post_processor"] = {{"type", "TemplateProcessing"}}; }),
                 "tokenizer.json", "post_processor.type", "'TemplateProcessing'");
  expect_refused(with([](json& j) { j["truncation"] = {{"max_length", 5}}; }), "tokenizer.json",
                 "truncation", "unsupported truncation");
  expect_refused(with([](json& j) { j["model"]["vocab"]["zz"] = 0; }), "tokenizer.json",
                 "model.vocab.zz", "also belongs to token 'a'");
  expect_refused(with([](json& j) { j["added_tokens"][0]["content"] = "c"; }), "tokenizer.json",
                 "added_tokens[0].id", "'c' has id 7 but model.vocab gives it 2");

  // Not a regular file, and over the size cap.
  fs::create_directory(d.path / "sub");
  fs::create_directory(d.path / "sub" / "tokenizer.json");
  expect_refused([&] { (void)tokenizer::load(d.path / "sub"); }, "sub/tokenizer.json", "",
                 "is a directory, expected a regular file");
  expect_refused([&] { (void)tokenizer::load("/dev/null"); }, "/dev/null", "",
                 "is a character device");
  expect_refused([&] { (void)tokenizer::load(d.path / "absent.json"); }, "absent.json", "",
                 "cannot open");
  {
    std::ofstream big(d.path / "tokenizer.json", std::ios::binary);
    big.seekp(static_cast<std::streamoff>(refit::tokenizer::max_tokenizer_json_bytes));
    big.put(' ');
  }
  expect_refused([&] { (void)tokenizer::load(d.path / "tokenizer.json"); }, "tokenizer.json", "",
                 "over the cap of 67108864");
}

// (c) refit-tokenize as a process: encode, decode (with and without special tokens), bad line.
TEST(RefitTokenize, ProcessRoundTrip) {
  temp_dir d;
  auto tj = d.write("tokenizer.json", tiny_doc().dump());
  const std::string exe = REFIT_TOKENIZE_EXE;
  d.write("enc.jsonl", "{\"text\": \"abc<|end|>ab\"}\n{\"text\": \"ba\"}\n");
  auto enc = refit::testing::run_command(exe + " --tokenizer " + tj.string() + " < " +
                                         (d.path / "enc.jsonl").string());
  ASSERT_EQ(enc.exit_code, 0);
  EXPECT_EQ(enc.out, "{\"ids\":[5,7,4]}\n{\"ids\":[1,0]}\n");
  d.write("dec.jsonl", "{\"ids\": [5, 7, 4]}\n");
  auto dec = refit::testing::run_command(exe + " --decode --tokenizer " + d.path.string() + " < " +
                                         (d.path / "dec.jsonl").string());
  ASSERT_EQ(dec.exit_code, 0);
  EXPECT_EQ(dec.out, "{\"text\":\"abc<|end|>ab\"}\n");
  auto skip = refit::testing::run_command(exe + " --decode --skip-special-tokens --tokenizer " +
                                          tj.string() + " < " + (d.path / "dec.jsonl").string());
  ASSERT_EQ(skip.exit_code, 0);
  EXPECT_EQ(skip.out, "{\"text\":\"abcab\"}\n");
  d.write("bad.jsonl", "{\"text\": \"a\"}\n{\"txt\": 1}\n");
  auto bad = refit::testing::run_command(exe + " --tokenizer " + tj.string() + " < " +
                                         (d.path / "bad.jsonl").string() + " 2>&1");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.out.find("stdin line 2"), std::string::npos) << bad.out;
  d.write("bad_ids.jsonl", "{\"ids\": [5, 99]}\n");
  auto bad_ids = refit::testing::run_command(exe + " --decode --tokenizer " + tj.string() + " < " +
                                             (d.path / "bad_ids.jsonl").string() + " 2>&1");
  EXPECT_EQ(bad_ids.exit_code, 1);
  EXPECT_NE(bad_ids.out.find("stdin line 1: ids[1]: id 99 is not in"), std::string::npos)
      << bad_ids.out;
}
