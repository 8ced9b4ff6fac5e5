// refit_checkpoint, files: the safetensors reader (good files byte-exact, every malformed
// header refused with the file and tensor/field named) and model directories with shards.
#include "checkpoint_files.hpp"
#include "runtime/checkpoint/index.hpp"
#include "runtime/checkpoint/safetensors.hpp"

#include <gtest/gtest.h>

#include <sys/stat.h>

using namespace refit::checkpoint;
using namespace refit::testing;
namespace fs = std::filesystem;

namespace {

// Writes `bytes` to a file and opens it.
std::unique_ptr<safetensors_file> open_bytes(const std::string& name, const std::string& bytes) {
  const auto dir = fresh_dir("st");
  write_file(dir / name, bytes);
  return safetensors_file::open((dir / name).string());
}

std::string f32_bytes(std::initializer_list<float> v) {
  std::string s(v.size() * 4, '\0');
  std::size_t i = 0;
  for (float f : v)
    std::memcpy(&s[4 * i++], &f, 4);
  return s;
}

const std::string one = R"("dtype":"F32","shape":[1])";

} // namespace

TEST(Safetensors, GoodFileLoadsWithExactBytes) {
  const std::string a = f32_bytes({1.5f, -2.0f, 3.25f, 4.0f, 5.0f, 6.0f});
  const std::string b = pattern_bytes("b", 2 * 3);
  const std::string bytes = make_safetensors(
    {{"a", "F32", {2, 3}, a}, {"b", "BF16", {3}, b}, {"scalar", "F16", {}, "\x01\x02"},
     {"empty", "BF16", {0, 4}, ""}},
    {{"format", "pt"}});
  const auto f = open_bytes("good.safetensors", bytes);
  ASSERT_EQ(f->tensors().size(), 4u);
  const tensor_view* ta = f->find("a");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->dt, refit::model::dtype::float32);
  EXPECT_EQ(ta->shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(ta->nbytes, a.size());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(ta->data), ta->nbytes), a);
  EXPECT_EQ(ta->file_offset, 8 + f->header_bytes());
  const tensor_view* tb = f->find("b");
  ASSERT_NE(tb, nullptr);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(tb->data), tb->nbytes), b);
  EXPECT_EQ(tb->file_offset, 8 + f->header_bytes() + a.size());
  EXPECT_EQ(bytes.substr(tb->file_offset, tb->nbytes), b);
  const tensor_view* ts = f->find("scalar");
  ASSERT_NE(ts, nullptr);
  EXPECT_TRUE(ts->shape.empty());
  EXPECT_EQ(ts->numel(), 1u);
  EXPECT_EQ(f->find("empty")->nbytes, 0u);
  EXPECT_EQ(f->find("missing"), nullptr);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->file_size(), bytes.size());
  // The same bytes parse identically from memory.
  const auto m = safetensors_file::parse(reinterpret_cast<const std::byte*>(bytes.data()),
                                         bytes.size(), "<memory>");
  EXPECT_EQ(m->find("a")->file_offset, ta->file_offset);
  EXPECT_EQ(m->find("a")->data, reinterpret_cast<const std::byte*>(bytes.data()) + ta->file_offset);
}

TEST(Safetensors, RefusesTruncatedFile) {
  expect_refused([] { open_bytes("short.safetensors", "abc"); },
                 {"short.safetensors", "header length", "3 bytes"});
}

TEST(Safetensors, RefusesHeaderLengthBeyondFile) {
  expect_refused([] { open_bytes("long.safetensors", u64_le(100) + "{}"); },
                 {"long.safetensors", "header length", "100 bytes is beyond the end"});
  expect_refused([] { open_bytes("huge.safetensors", u64_le(200'000'000) + "{}"); },
                 {"huge.safetensors", "header length", "exceeds the limit of 100000000"});
  expect_refused([] { open_bytes("max.safetensors", u64_le(~0ull) + "{}"); },
                 {"max.safetensors", "header length"});
}

TEST(Safetensors, RefusesBadJson) {
  expect_refused([] { open_bytes("bad.safetensors", raw_safetensors("{\"a\": ", "")); },
                 {"bad.safetensors", "header", "not valid JSON"});
  expect_refused([] { open_bytes("arr.safetensors", raw_safetensors("[1, 2]", "")); },
                 {"arr.safetensors", "header", "must be a JSON object"});
  expect_refused([] { open_bytes("deep.safetensors", raw_safetensors(R"({"a":{"shape":[[[1]]]}})", "")); },
                 {"deep.safetensors", "tensor 'a'", "nested deeper"});
  expect_refused(
    [] { open_bytes("md.safetensors", raw_safetensors(R"({"__metadata__":{"k":1}})", "")); },
    {"md.safetensors", "__metadata__.k", "must be a string"});
}

TEST(Safetensors, RefusesUnsupportedAndUnknownDtypes) {
  expect_refused(
    [] { open_bytes("f8.safetensors", raw_safetensors(R"({"w":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})", "x")); },
    {"f8.safetensors", "tensor 'w'", "dtype 'F8_E4M3' not supported (BF16, F16, F32)"});
  expect_refused(
    [] { open_bytes("q.safetensors", raw_safetensors(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "x")); },
    {"q.safetensors", "tensor 'w'", "dtype 'Q4' unknown"});
}

TEST(Safetensors, RefusesBadShapesAndOffsets) {
  expect_refused(
    [] { open_bytes("mm.safetensors", raw_safetensors(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", std::string(12, 'x'))); },
    {"mm.safetensors", "tensor 'w'", "data_offsets", "holds 12 bytes", "[2, 2]", "needs 16"});
  expect_refused(
    [] { open_bytes("neg.safetensors", raw_safetensors(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "xxxx")); },
    {"neg.safetensors", "tensor 'w'", "shape", "-1"});
  expect_refused(
    [] { open_bytes("ovf.safetensors", raw_safetensors(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", "xxxx")); },
    {"ovf.safetensors", "tensor 'w'", "shape", "overflows"});
  expect_refused(
    [] { open_bytes("rev.safetensors", raw_safetensors(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "xxxx")); },
    {"rev.safetensors", "tensor 'w'", "data_offsets", "begin 4 > end 0"});
  expect_refused(
    [] { open_bytes("past.safetensors", raw_safetensors(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", "xxxx")); },
    {"past.safetensors", "tensor 'w'", "data_offsets", "beyond the data buffer"});
  expect_refused(
    [] { open_bytes("fld.safetensors", raw_safetensors(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", "xxxx")); },
    {"fld.safetensors", "tensor 'w'", "x: unknown field"});
}

TEST(Safetensors, RefusesOverlapHoleAndTrailingBytes) {
  expect_refused(
    [] { open_bytes("ovl.safetensors", raw_safetensors("{\"a\":{" + one + ",\"data_offsets\":[0,4]},\"b\":{" + one + ",\"data_offsets\":[2,6]}}", std::string(6, 'x'))); },
    {"ovl.safetensors", "tensor 'b'", "overlaps tensor 'a'"});
  expect_refused(
    [] { open_bytes("hole.safetensors", raw_safetensors("{\"a\":{" + one + ",\"data_offsets\":[0,4]},\"b\":{" + one + ",\"data_offsets\":[8,12]}}", std::string(12, 'x'))); },
    {"hole.safetensors", "tensor 'b'", "hole: bytes [4, 8)"});
  expect_refused(
    [] { open_bytes("tail.safetensors", raw_safetensors("{\"a\":{" + one + ",\"data_offsets\":[0,4]}}", std::string(6, 'x'))); },
    {"tail.safetensors", "cover 4 bytes of a data buffer of 6"});
}

TEST(Safetensors, RefusesDuplicateNames) {
  expect_refused(
    [] { open_bytes("dup.safetensors", raw_safetensors("{\"a\":{" + one + ",\"data_offsets\":[0,4]},\"a\":{" + one + ",\"data_offsets\":[4,8]}}", std::string(8, 'x'))); },
    {"dup.safetensors", "tensor 'a'", "duplicate tensor name"});
  expect_refused(
    [] { open_bytes("dupk.safetensors", raw_safetensors("{\"a\":{" + one + ",\"dtype\":\"F16\",\"data_offsets\":[0,4]}}", std::string(4, 'x'))); },
    {"dupk.safetensors", "tensor 'a'", "dtype: duplicate key"});
}

TEST(Safetensors, RefusesWhatIsNotARegularFile) {
  const auto dir = fresh_dir("special");
  fs::create_directories(dir / "model.safetensors");
  expect_refused([&] { safetensors_file::open((dir / "model.safetensors").string()); },
                 {(dir / "model.safetensors").string(), "not a regular file (a directory)"});
  const auto fifo = dir / "fifo.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refused([&] { safetensors_file::open(fifo.string()); },
                 {fifo.string(), "not a regular file (a fifo)"});
  expect_refused([] { safetensors_file::open("/dev/null"); }, {"/dev/null", "character device"});
  expect_refused([&] { safetensors_file::open((dir / "absent").string()); }, {"absent", "cannot open"});
}

// ---- model directories ----

namespace {

void write_index(const fs::path& dir, const nlohmann::json& weight_map) {
  write_file(dir / "model.safetensors.index.json",
             nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump());
}

const std::string a4 = f32_bytes({1, 2, 3, 4});
const std::string b2 = f32_bytes({5, 6});

} // namespace

TEST(CheckpointFiles, OneFileAndShardedDirectories) {
  const auto one_dir = fresh_dir("one");
  write_file(one_dir / "model.safetensors", make_safetensors({{"a", "F32", {4}, a4}}));
  const auto c1 = checkpoint_files::open(one_dir.string());
  EXPECT_TRUE(c1.index_path().empty());
  ASSERT_NE(c1.find("a"), nullptr);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(c1.find("a")->data), 16), a4);

  const auto dir = fresh_dir("sharded");
  write_file(dir / "s1.safetensors", make_safetensors({{"a", "F32", {4}, a4}}));
  write_file(dir / "s2.safetensors", make_safetensors({{"b", "F32", {2}, b2}}));
  write_index(dir, {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}});
  const auto c = checkpoint_files::open(dir.string());
  EXPECT_EQ(c.files().size(), 2u);
  ASSERT_EQ(c.tensors().size(), 2u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(c.find("b")->data), 8), b2);
  EXPECT_EQ(c.find("b")->file, (dir / "s2.safetensors").string());
}

TEST(CheckpointFiles, RefusesBadIndexes) {
  const auto dir = fresh_dir("badindex");
  write_file(dir / "s1.safetensors", make_safetensors({{"a", "F32", {4}, a4}}));
  write_file(dir / "s2.safetensors", make_safetensors({{"b", "F32", {2}, b2}}));

  write_index(dir, {{"a", "s1.safetensors"}, {"b", "gone.safetensors"}});
  expect_refused([&] { checkpoint_files::open(dir.string()); },
                 {"model.safetensors.index.json", "tensor 'b'", "'gone.safetensors' is missing"});

  write_index(dir, {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}, {"c", "s2.safetensors"}});
  expect_refused([&] { checkpoint_files::open(dir.string()); },
                 {"model.safetensors.index.json", "tensor 'c'", "'s2.safetensors', which does not hold it"});

  write_index(dir, {{"a", "s1.safetensors"}}); // s2 is not named by the index: never opened
  EXPECT_NO_THROW(checkpoint_files::open(dir.string()));
  write_file(dir / "s1.safetensors", make_safetensors({{"a", "F32", {4}, a4}, {"x", "F32", {2}, b2}}));
  expect_refused([&] { checkpoint_files::open(dir.string()); },
                 {"s1.safetensors", "tensor 'x'", "not listed in model.safetensors.index.json"});

  write_file(dir / "s1.safetensors", make_safetensors({{"a", "F32", {4}, a4}, {"b", "F32", {2}, b2}}));
  write_index(dir, {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}});
  expect_refused([&] { checkpoint_files::open(dir.string()); },
                 {"s1.safetensors", "tensor 'b'", "the index places it in shard 's2.safetensors'"});

  for (const std::string bad : {"../s1.safetensors", "sub/s1.safetensors", "..", ""}) {
    write_index(dir, {{"a", bad}});
    expect_refused([&] { checkpoint_files::open(dir.string()); },
                   {"model.safetensors.index.json", "tensor 'a'", "not a plain file name"});
  }
  write_file(dir / "model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors"}})");
  expect_refused([&] { checkpoint_files::open(dir.string()); },
                 {"model.safetensors.index.json", "weight_map.a", "duplicate key"});

  write_index(dir, {{"a", "s1.safetensors"}});
  write_file(dir / "model.safetensors", make_safetensors({{"a", "F32", {4}, a4}}));
  expect_refused([&] { checkpoint_files::open(dir.string()); }, {dir.string(), "ambiguous"});
  expect_refused([&] { checkpoint_files::open(fresh_dir("empty").string()); },
                 {"no model.safetensors or model.safetensors.index.json"});
}

TEST(CheckpointFiles, RefusesTheSameTensorInTwoShards) {
  const auto dir = fresh_dir("twice");
  write_file(dir / "s1.safetensors", make_safetensors({{"a", "F32", {4}, a4}}));
  write_file(dir / "s2.safetensors", make_safetensors({{"a", "F32", {4}, a4}}));
  write_index(dir, {{"a", "s1.safetensors"}});
  // The index lists s1 only, so s2 is never opened: no error. Listing both is impossible in
  // one JSON object (duplicate key), so a shard holding a tensor the index places elsewhere
  // is the only form this takes:
  EXPECT_NO_THROW(checkpoint_files::open(dir.string()));
  write_file(dir / "s2.safetensors", make_safetensors({{"a", "F32", {4}, a4}, {"b", "F32", {2}, b2}}));
  write_index(dir, {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}});
  expect_refused([&] { checkpoint_files::open(dir.string()); },
                 {"s2.safetensors", "tensor 'a'", "places it in shard 's1.safetensors'"});
}
