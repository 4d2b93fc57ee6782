// safetensors reader and writer: round trips for every dtype, the writer's streaming contract,
// and every header corruption the reader must reject (with the file and the problem named).

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "megamoe/safetensors.h"
#include "megamoe/status.h"
#include "tests/common/error_matchers.h"
#include "tests/common/test_util.h"

namespace {

namespace fs = std::filesystem;
using megamoe::DType;
using megamoe::Error;
using megamoe::ErrorCode;
using megamoe::SafetensorsFile;
using megamoe::SafetensorsWriter;
using megamoe::TensorSpec;

constexpr DType kAllDTypes[] = {DType::BF16, DType::F16,     DType::F32,
                                DType::U8,   DType::I8,      DType::I32,
                                DType::I64,  DType::F8_E4M3, DType::F8_E5M2};


// A fresh directory per test, removed with everything in it at the end, and a fresh seed for the
// test's random data, named in every failure.
class SafetensorsTest : public testing::Test {
 protected:

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::vector<uint8_t> random_bytes(size_t n) {
    std::vector<uint8_t> v(n);
    for (auto& b : v) b = static_cast<uint8_t>(rng_());
    return v;
  }

  // A hand-made file: 8-byte little-endian `declared_len` (the header's size by default), the
  // header text, then `data_bytes` random bytes.
  std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                        std::optional<uint64_t> declared_len = std::nullopt) {
    const std::string p = path(name);
    std::ofstream out(p, std::ios::binary);
    const uint64_t len = declared_len.value_or(header.size());
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(len >> (8 * i)));
    out << header;
    const auto data = random_bytes(data_bytes);
    out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
    return p;
  }

  const megamoe::testing::ScratchDir scratch_{"megamoe_st"};
  const fs::path dir_ = scratch_.path();
  const megamoe::testing::SeedTrace seed_;
  std::mt19937_64 rng_{seed_};
};

std::vector<uint8_t> read_file(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(SafetensorsShape, ShapeStringAndNumel) {
  EXPECT_EQ(megamoe::shape_string(std::vector<int64_t>{}), "[]");
  EXPECT_EQ(megamoe::shape_string(std::vector<int64_t>{7}), "[7]");
  EXPECT_EQ(megamoe::shape_string(std::vector<int64_t>{7168, 2048}), "[7168, 2048]");
  megamoe::TensorInfo t;
  EXPECT_EQ(t.numel(), 1);  // a scalar
  t.shape = {3, 0};
  EXPECT_EQ(t.numel(), 0);
  t.shape = {256, 7168, 1024};
  EXPECT_EQ(t.numel(), int64_t{256} * 7168 * 1024);
  t.begin = 16;
  t.end = 48;
  EXPECT_EQ(t.nbytes(), 32u);
}

// Every dtype with a matrix, a scalar ([] and [1]) and an empty tensor, in one file; data read
// back through the mapping must be the bytes written, at the offsets the writer chose.
TEST_F(SafetensorsTest, RoundTripEveryDtypeAndShapeKind) {
  struct Case {
    TensorSpec spec;
    std::vector<uint8_t> bytes;
  };
  std::vector<Case> cases;
  std::uniform_int_distribution<int64_t> dim(1, 9);
  for (DType t : kAllDTypes) {
    const std::string n = megamoe::dtype_name(t);
    const std::vector<std::vector<int64_t>> shapes = {
        {dim(rng_), dim(rng_)}, {}, {1}, {0}, {dim(rng_), 0, dim(rng_)}, {2, dim(rng_), 3}};
    for (size_t s = 0; s < shapes.size(); ++s) {
      TensorSpec spec{n + ".t" + std::to_string(s), t, shapes[s]};
      int64_t numel = 1;
      for (int64_t d : spec.shape) numel *= d;
      cases.push_back({spec, random_bytes(static_cast<size_t>(numel * megamoe::dtype_size(t)))});
    }
  }
  std::vector<std::pair<TensorSpec, std::span<const uint8_t>>> tensors;
  for (const auto& c : cases) tensors.emplace_back(c.spec, c.bytes);
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"producer", "test"}};
  const std::string p = path("all.safetensors");
  megamoe::write_safetensors(p, tensors, metadata);

  const auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f->path(), p);
  EXPECT_EQ(f->metadata(), metadata);
  ASSERT_EQ(f->tensors().size(), cases.size());
  uint64_t expected_offset = 0;
  for (const auto& c : cases) {
    const megamoe::TensorInfo* info = f->find(c.spec.name);
    ASSERT_NE(info, nullptr) << c.spec.name;
    EXPECT_EQ(info->name, c.spec.name);
    EXPECT_EQ(info->dtype, c.spec.dtype) << c.spec.name;
    EXPECT_EQ(info->shape, c.spec.shape) << c.spec.name;
    // The writer lays tensors out contiguously in declaration order.
    EXPECT_EQ(info->begin, expected_offset) << c.spec.name;
    EXPECT_EQ(info->nbytes(), c.bytes.size()) << c.spec.name;
    expected_offset += c.bytes.size();
    const auto got = f->bytes(*info);
    ASSERT_EQ(got.size(), c.bytes.size());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), c.bytes.begin())) << c.spec.name;
  }
  for (size_t i = 1; i < f->tensors().size(); ++i) {
    EXPECT_LE(f->tensors()[i - 1].begin, f->tensors()[i].begin);
  }
  EXPECT_EQ(f->find("absent"), nullptr);

  // The layout of the reference implementation: u64 LE header length, a header padded with
  // spaces to a multiple of 8, then exactly the data.
  const auto raw = read_file(p);
  ASSERT_GE(raw.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | raw[i];
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + n + expected_offset);
  const std::string header(raw.begin() + 8, raw.begin() + 8 + static_cast<int64_t>(n));
  const size_t json_end = header.find_last_not_of(' ');
  EXPECT_EQ(header[json_end], '}');
  EXPECT_LT(header.size() - json_end - 1, 8u);
}

TEST_F(SafetensorsTest, ScalarShapes) {
  const float a = std::uniform_real_distribution<float>(-10, 10)(rng_);
  const int64_t b = static_cast<int64_t>(rng_());
  const auto pa = reinterpret_cast<const uint8_t*>(&a);
  const auto pb = reinterpret_cast<const uint8_t*>(&b);
  const std::string p = path("scalars.safetensors");
  megamoe::write_safetensors(p, {{TensorSpec{"a", DType::F32, {}}, {pa, 4}},
                                 {TensorSpec{"b", DType::I64, {1}}, {pb, 8}}});
  const auto f = SafetensorsFile::open(p);
  const auto* ta = f->find("a");
  const auto* tb = f->find("b");
  ASSERT_TRUE(ta && tb);
  EXPECT_TRUE(ta->shape.empty());
  EXPECT_EQ(ta->numel(), 1);
  EXPECT_EQ(ta->nbytes(), 4u);
  EXPECT_EQ(tb->shape, std::vector<int64_t>{1});
  EXPECT_EQ(tb->numel(), 1);
  float a2;
  int64_t b2;
  std::memcpy(&a2, f->bytes(*ta).data(), 4);
  std::memcpy(&b2, f->bytes(*tb).data(), 8);
  EXPECT_EQ(a2, a);
  EXPECT_EQ(b2, b);
  EXPECT_TRUE(f->metadata().empty());
}

TEST_F(SafetensorsTest, EmptyFileHasNoTensors) {
  const std::string p = path("empty.safetensors");
  megamoe::write_safetensors(p, {});
  const auto f = SafetensorsFile::open(p);
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_EQ(read_file(p).size(), 16u);  // length + "{}" padded to 8
}

// The writer takes data in chunks of any size (empty ones included); zero-byte tensors need no
// append at all.
TEST_F(SafetensorsTest, ChunkedWriter) {
  const std::vector<TensorSpec> specs = {{"w", DType::BF16, {37, 29}},
                                         {"empty", DType::F32, {0, 5}},
                                         {"s", DType::F8_E4M3, {101}},
                                         {"tail_empty", DType::I32, {0}}};
  std::vector<std::vector<uint8_t>> data;
  for (const auto& s : specs) {
    int64_t numel = 1;
    for (int64_t d : s.shape) numel *= d;
    data.push_back(random_bytes(static_cast<size_t>(numel * megamoe::dtype_size(s.dtype))));
  }
  const std::string p = path("chunked.safetensors");
  {
    SafetensorsWriter w(p, specs, {{"k", "v"}});
    std::uniform_int_distribution<size_t> chunk(0, 97);
    for (size_t i = 0; i < specs.size(); ++i) {
      if (data[i].empty()) continue;
      size_t at = 0;
      while (at < data[i].size()) {
        const size_t n = std::min(chunk(rng_), data[i].size() - at);
        w.append(specs[i].name, std::span<const uint8_t>(data[i]).subspan(at, n));
        at += n;
      }
    }
    w.finish();
  }
  const auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f->metadata().at("k"), "v");
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto* t = f->find(specs[i].name);
    ASSERT_NE(t, nullptr);
    const auto got = f->bytes(*t);
    EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.end()), data[i]) << specs[i].name;
  }
}

TEST_F(SafetensorsTest, WriterRejectsBadSpecsBeforeCreatingTheFile) {
  const std::string p = path("bad_specs.safetensors");
  EXPECT_MEGAMOE_ERROR(SafetensorsWriter(p, {{"a", DType::U8, {2}}, {"a", DType::U8, {3}}}),
                       kInvalidArgument, p, "'a'", "declared twice");
  EXPECT_MEGAMOE_ERROR(SafetensorsWriter(p, {{"a", DType::U8, {2, -1}}}), kInvalidArgument, p,
                       "'a'", "[2, -1]", "non-negative");
  EXPECT_MEGAMOE_ERROR(SafetensorsWriter(p, {{"a", DType::I64, {int64_t{1} << 40, int64_t{1} << 40}}}),
                       kInvalidArgument, p, "'a'", "64 bits");
  EXPECT_MEGAMOE_ERROR(SafetensorsWriter(p, {{"__metadata__", DType::U8, {1}}}), kInvalidArgument,
                       p, "not allowed");
  EXPECT_MEGAMOE_ERROR(SafetensorsWriter(p, {{"", DType::U8, {1}}}), kInvalidArgument, p,
                       "not allowed");
  EXPECT_FALSE(fs::exists(p));
  const std::string nodir = path("no/such/dir/x.safetensors");
  EXPECT_MEGAMOE_ERROR(SafetensorsWriter(nodir, {}), kIo, nodir, "cannot create");
}

TEST_F(SafetensorsTest, WriterRejectsMisuse) {
  const std::string p = path("misuse.safetensors");
  const auto four = random_bytes(4);
  const auto six = random_bytes(6);
  const std::span<const uint8_t> s4(four);
  {
    SafetensorsWriter w(p, {{"a", DType::U8, {4}}, {"b", DType::I8, {6}}});
    EXPECT_MEGAMOE_ERROR(w.append("zz", s4), kInvalidArgument, p, "no tensor named 'zz'");
    EXPECT_MEGAMOE_ERROR(w.append("b", s4), kInvalidArgument, p, "'b'", "while tensor 'a'",
                         "declaration order");
    w.append("a", s4.first(3));
    EXPECT_MEGAMOE_ERROR(w.append("a", s4), kInvalidArgument, p, "4 bytes appended", "'a'",
                         "only 1 of its 4 bytes left");
    EXPECT_MEGAMOE_ERROR(w.finish(), kInvalidArgument, p, "'a' incomplete", "3 of 4");
    w.append("a", s4.subspan(3));
    w.append("b", six);
    EXPECT_MEGAMOE_ERROR(w.append("a", s4.first(1)), kInvalidArgument, p, "'a'",
                         "already complete");
    EXPECT_TRUE(fs::exists(p));
    w.finish();
    EXPECT_MEGAMOE_ERROR(w.append("b", {}), kInvalidArgument, p, "after finish()");
    EXPECT_MEGAMOE_ERROR(w.finish(), kInvalidArgument, p, "finish() called twice");
  }
  // The finished file survives the writer; misuse did not disturb its contents.
  const auto f = SafetensorsFile::open(p);
  const auto a = f->bytes(*f->find("a"));
  const auto b = f->bytes(*f->find("b"));
  EXPECT_TRUE(std::equal(a.begin(), a.end(), four.begin()));
  EXPECT_TRUE(std::equal(b.begin(), b.end(), six.begin()));
}

TEST_F(SafetensorsTest, UnfinishedWriterRemovesPartialFile) {
  const std::string p = path("partial.safetensors");
  {
    SafetensorsWriter w(p, {{"a", DType::F32, {8}}});
    w.append("a", random_bytes(12));
    EXPECT_TRUE(fs::exists(p));
  }
  EXPECT_FALSE(fs::exists(p));
  {
    SafetensorsWriter w(p, {{"a", DType::F32, {8}}});
    w.append("a", random_bytes(32));  // complete, but finish() never called
  }
  EXPECT_FALSE(fs::exists(p));
}

TEST_F(SafetensorsTest, WriteSafetensorsChecksBufferSizes) {
  const std::string p = path("sizes.safetensors");
  const auto bytes = random_bytes(10);
  EXPECT_MEGAMOE_ERROR(megamoe::write_safetensors(p, {{TensorSpec{"x", DType::BF16, {2, 3}}, bytes}}),
                       kInvalidArgument, p, "'x'", "given 10 bytes", "need 12");
  EXPECT_FALSE(fs::exists(p));
}

// ---- reader: every corruption is rejected, naming the file and the problem.

TEST_F(SafetensorsTest, RejectsMissingFileAndDirectory) {
  const std::string p = path("absent.safetensors");
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kNotFound, p, "does not exist");
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(dir_.string()), kInvalidArgument, dir_.string(),
                       "not a regular file");
}

TEST_F(SafetensorsTest, RejectsTruncatedLengthField) {
  for (size_t n : {0, 1, 7}) {
    const std::string p = path("short" + std::to_string(n));
    std::ofstream(p, std::ios::binary) << std::string(n, '\x10');
    EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "truncated",
                         std::to_string(n) + " bytes");
  }
}

TEST_F(SafetensorsTest, RejectsHeaderLengthBeyondFile) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  const std::string p = write_raw("long_len", header, 4, header.size() + 5);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p,
                       std::to_string(header.size() + 5) + "-byte header", "only " +
                       std::to_string(header.size() + 4) + " bytes follow");
  // A header length near 2^64 must not wrap around in the bounds arithmetic.
  const std::string q = write_raw("huge_len", header, 4, ~uint64_t{0});
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(q), kInvalidCheckpoint, q, "-byte header");
}

// The 100 MB header limit, on a sparse file large enough that the length is in bounds.
TEST_F(SafetensorsTest, RejectsHeaderAbove100MB) {
  const uint64_t len = 100'000'001;
  const std::string p = write_raw("big_header", "{}", 0, len);
  ASSERT_EQ(::truncate(p.c_str(), static_cast<off_t>(8 + len)), 0);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "100000001-byte header",
                       "at most 100000000");
}

TEST_F(SafetensorsTest, RejectsNonJsonAndNonObjectHeaders) {
  for (const std::string& h :
       {std::string("{\"a\": {\"dtype\": \"U8\""), std::string("not json at all"),
        std::string(""), std::string("{\"a\": \"\xff\xfe\"}")}) {
    const std::string p = write_raw("bad_json", h, 0);
    EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "not valid JSON");
  }
  const std::string p = write_raw("array", "[1, 2]", 0);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "JSON array",
                       "expected a JSON object");
}

TEST_F(SafetensorsTest, RejectsUnsupportedDtype) {
  for (const char* dt : {"F64", "BOOL", "bf16", "F4"}) {
    const std::string h = std::string(R"({"w":{"dtype":")") + dt +
                          R"(","shape":[2],"data_offsets":[0,2]}})";
    const std::string p = write_raw("dtype", h, 2);
    EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kUnsupported, p, "tensor 'w'",
                         std::string("unsupported dtype '") + dt + "'",
                         "BF16, F16, F32, U8, I8, I32, I64, F8_E4M3, F8_E5M2");
  }
  const std::string p = write_raw("dtype_num", R"({"w":{"dtype":3,"shape":[2],"data_offsets":[0,2]}})", 2);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                       "not a string");
}

TEST_F(SafetensorsTest, RejectsMissingFields) {
  const std::map<std::string, std::string> entries = {
      {"dtype", R"({"shape":[2],"data_offsets":[0,2]})"},
      {"shape", R"({"dtype":"U8","data_offsets":[0,2]})"},
      {"data_offsets", R"({"dtype":"U8","shape":[2]})"}};
  for (const auto& [field, entry] : entries) {
    const std::string p = write_raw("missing_" + field, R"({"w":)" + entry + "}", 2);
    EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                         "no '" + field + "' field");
  }
  const std::string p = write_raw("not_object", R"({"w":[1,2]})", 0);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                       "must be a JSON object");
}

TEST_F(SafetensorsTest, RejectsBadShapes) {
  for (const char* shape : {"[2,-1]", "[2.5]", "[\"2\"]", "{}", "3"}) {
    const std::string h = std::string(R"({"w":{"dtype":"U8","shape":)") + shape +
                          R"(,"data_offsets":[0,0]}})";
    const std::string p = write_raw("shape", h, 0);
    EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'", "shape",
                         "non-negative integer");
  }
  // numel and byte size must not overflow: 2^32 * 2^32 elements.
  const std::string p = write_raw(
      "overflow", R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                       "overflows 64 bits");
  const std::string q = write_raw(
      "overflow_bytes", R"({"w":{"dtype":"I64","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(q), kInvalidCheckpoint, q, "tensor 'w'",
                       "overflows 64 bits");
}

TEST_F(SafetensorsTest, RejectsBadOffsets) {
  const auto open_with = [&](const std::string& offsets, size_t data) {
    const std::string h =
        R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":)" + offsets + "}}";
    return write_raw("offsets", h, data);
  };
  for (const char* bad : {"[0]", "[0,16,32]", "[-1,15]", "[0,\"16\"]", "[0.0,16]", "\"0,16\""}) {
    const std::string p = open_with(bad, 16);
    EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                         "data_offsets", "expected [begin, end]");
  }
  std::string p = open_with("[16,0]", 16);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                       "begin after end");
  p = open_with("[0,16]", 15);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                       "out of bounds", "only 15 bytes");
  p = open_with("[18446744073709551600,18446744073709551615]", 16);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                       "out of bounds");
  p = open_with("[0,12]", 16);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                       "12 bytes of data", "need 16 bytes", "size mismatch");
  p = open_with("[0,20]", 20);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'w'",
                       "size mismatch");
}

// A valid file cut short anywhere in its data section: the tensor past the end is named.
TEST_F(SafetensorsTest, RejectsTruncatedDataSection) {
  const std::string p = path("trunc.safetensors");
  const auto a = random_bytes(64);
  const auto b = random_bytes(32);
  megamoe::write_safetensors(p, {{TensorSpec{"a", DType::F32, {16}}, a},
                                 {TensorSpec{"b", DType::BF16, {16}}, b}});
  const auto size = fs::file_size(p);
  const uint64_t cut = std::uniform_int_distribution<uint64_t>(1, 32)(rng_);
  fs::resize_file(p, size - cut);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'b'",
                       "out of bounds", "truncated");
  fs::resize_file(p, size - 32 - cut);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "out of bounds");
}

TEST_F(SafetensorsTest, RejectsOverlappingTensors) {
  std::string p = write_raw("overlap",
                            R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                            R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                            12);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'b'",
                       "overlaps tensor 'a'");
  // Identical ranges.
  p = write_raw("same",
                R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                R"("b":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}})",
                8);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "overlaps");
  // A small tensor inside a large one, listed after a later tensor in the header.
  p = write_raw("inside",
                R"({"c":{"dtype":"U8","shape":[4],"data_offsets":[40,44]},)"
                R"("a":{"dtype":"U8","shape":[32],"data_offsets":[0,32]},)"
                R"("b":{"dtype":"U8","shape":[2],"data_offsets":[10,12]}})",
                44);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'b'",
                       "overlaps tensor 'a'");
  // Even an empty tensor may not sit strictly inside another one.
  p = write_raw("empty_inside",
                R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                R"("e":{"dtype":"U8","shape":[0],"data_offsets":[3,3]}})",
                8);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'e'",
                       "overlaps tensor 'a'");
}

// What the format allows: tensors in any header order, empty tensors at a boundary, header
// padding with spaces.
TEST_F(SafetensorsTest, AcceptsEmptyTensorsAndPadding) {
  const std::string p = write_raw("lenient",
                                  R"({"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]},)"
                                  R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]},)"
                                  R"("a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})"
                                  "      ",
                                  12);
  const auto f = SafetensorsFile::open(p);
  ASSERT_EQ(f->tensors().size(), 3u);
  EXPECT_EQ(f->tensors()[0].name, "a");
  EXPECT_EQ(f->tensors()[1].name, "e");
  EXPECT_EQ(f->tensors()[2].name, "b");
  EXPECT_EQ(f->bytes(*f->find("e")).size(), 0u);
}

// The tensors must cover the data section exactly (as the reference implementation requires):
// a hole, bytes before the first tensor or after the last mean a corrupt header.
TEST_F(SafetensorsTest, RejectsHolesAndTrailingBytes) {
  std::string p = write_raw("hole",
                            R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                            R"("b":{"dtype":"U8","shape":[4],"data_offsets":[12,16]}})",
                            16);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'b'",
                       "starts at byte 12", "end at byte 8", "without holes");
  p = write_raw("lead", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})", 12);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "tensor 'a'",
                       "starts at byte 4", "end at byte 0");
  p = write_raw("trailing", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", 11);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "end at byte 8",
                       "holds 11 bytes", "3 trailing bytes");
  p = write_raw("no_tensors", "{}", 1);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "1 trailing bytes");

  // A length field short by some of the header's padding: the JSON still parses (the rest of the
  // padding is taken for data), every tensor would shift onto its neighbour's bytes, and the data
  // section has bytes no tensor claims.
  const std::string good = path("good.safetensors");
  megamoe::write_safetensors(good, {{TensorSpec{"a", DType::U8, {3}}, random_bytes(3)},
                                    {TensorSpec{"b", DType::U8, {5}}, random_bytes(5)}});
  std::vector<uint8_t> bytes = read_file(good);
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | bytes[size_t(i)];
  ASSERT_EQ(bytes[8 + len - 1], ' ') << "the writer pads the header with spaces";
  bytes[0] = static_cast<uint8_t>(bytes[0] - 1);
  const std::string shifted = path("shifted.safetensors");
  std::ofstream(shifted, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(shifted), kInvalidCheckpoint, shifted,
                       "1 trailing bytes");
}

// nlohmann's parser ends the input at a NUL byte and ignores the rest: a NUL anywhere in the
// header is an error, whatever follows it.
TEST_F(SafetensorsTest, RejectsNulByteInHeader) {
  const std::string entry = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  for (const std::string& h : {entry + std::string(1, '\0') + "garbage",
                               entry + std::string(3, '\0'),
                               std::string(R"({"a":{"dtype":"U8")") + std::string(1, '\0') +
                                   R"(,"shape":[4],"data_offsets":[0,4]}})"}) {
    const std::string p = write_raw("nul", h, 4);
    EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "NUL byte",
                         "at offset " + std::to_string(h.find('\0')));
  }
}

// A key twice inside one tensor entry (or inside __metadata__) is corruption too: nlohmann would
// keep the last one.
TEST_F(SafetensorsTest, RejectsDuplicateKeysInsideAnEntry) {
  std::string p = write_raw("dup_dtype",
                            R"({"w":{"dtype":"F32","dtype":"F8_E4M3","shape":[4],)"
                            R"("data_offsets":[0,4]}})",
                            4);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "key 'dtype' twice",
                       "'w'");
  p = write_raw("dup_offsets",
                R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"data_offsets":[0,4]}})", 4);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p,
                       "key 'data_offsets' twice");
  p = write_raw("dup_meta", R"({"__metadata__":{"format":"pt","format":"np"}})", 0);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "key 'format' twice",
                       "'__metadata__'");
}

// Deeply nested JSON anywhere in the header is refused by the parser with a short message (it
// once overflowed the stack while the message quoting the value was built); values quoted in
// messages are shortened.
TEST_F(SafetensorsTest, RejectsDeepNestingWithShortMessages) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  for (const std::string& entry :
       {R"({"w":{"dtype":"U8","shape":)" + deep + R"(,"data_offsets":[0,4]}})",
        R"({"w":{"dtype":"U8","shape":[4],"data_offsets":)" + deep + "}}",
        R"({"w":{"dtype":)" + deep + R"(,"shape":[4],"data_offsets":[0,4]}})",
        R"({"__metadata__":{"a":)" + deep + "}}"}) {
    const std::string p = write_raw("deep", entry, 4);
    try {
      SafetensorsFile::open(p);
      ADD_FAILURE() << "accepted";
    } catch (const megamoe::Error& e) {
      EXPECT_NE(std::string(e.what()).find("more than 8 levels deep"), std::string::npos)
          << e.what();
      EXPECT_LT(std::string(e.what()).size(), 400u) << e.what();
    }
  }
  // Within the depth limit, a large value is quoted briefly.
  std::string shape = "[";
  for (int i = 0; i < 5000; ++i) shape += (i ? ",[1,2,3]" : "[1,2,3]");
  shape += "]";
  const std::string p = write_raw(
      "wide_shape", R"({"w":{"dtype":"U8","shape":)" + shape + R"(,"data_offsets":[0,4]}})", 4);
  try {
    SafetensorsFile::open(p);
    ADD_FAILURE() << "accepted";
  } catch (const megamoe::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("tensor 'w' has shape [[1, 2, 3], "), std::string::npos) << m;
    EXPECT_NE(m.find("more"), std::string::npos) << m;
    EXPECT_LT(m.size(), 500u) << m;
  }
}

// A FIFO or a directory given as the file: rejected without opening it for a blocking read
// (the test would hang otherwise), and never reported as missing.
TEST_F(SafetensorsTest, RejectsFifoWithoutBlocking) {
  const std::string fifo = path("fifo.safetensors");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(fifo), kInvalidArgument, fifo, "not a regular file");
  // The writer does not block on an existing FIFO either, nor write into one.
  EXPECT_MEGAMOE_ERROR(SafetensorsWriter(fifo, {}), kInvalidArgument, fifo,
                       "not a regular file");
  EXPECT_MEGAMOE_ERROR(SafetensorsWriter(dir_.string(), {}), kInvalidArgument, dir_.string(),
                       "not a regular file");
}

TEST_F(SafetensorsTest, RejectsDuplicateTensorNames) {
  const std::string p = write_raw("dup",
                                  R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                                  R"("a":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
                                  8);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "'a' twice");
  // The same key nested deeper (inside __metadata__ and an entry) is not a duplicate tensor.
  const std::string q = write_raw("nested",
                                  R"({"__metadata__":{"a":"x"},)"
                                  R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                                  4);
  EXPECT_EQ(SafetensorsFile::open(q)->metadata().at("a"), "x");
}

TEST_F(SafetensorsTest, RejectsBadMetadata) {
  std::string p = write_raw("meta_array", R"({"__metadata__":["a"]})", 0);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "__metadata__",
                       "object of string values");
  p = write_raw("meta_value", R"({"__metadata__":{"format":"pt","n":3}})", 0);
  EXPECT_MEGAMOE_ERROR(SafetensorsFile::open(p), kInvalidCheckpoint, p, "__metadata__ entry 'n'",
                       "must be strings");
}

TEST_F(SafetensorsTest, BytesRejectsForeignTensorInfo) {
  const std::string p = path("small.safetensors");
  megamoe::write_safetensors(p, {{TensorSpec{"a", DType::U8, {4}}, random_bytes(4)}});
  const auto f = SafetensorsFile::open(p);
  megamoe::TensorInfo other;
  other.name = "other";
  other.begin = 0;
  other.end = 5;
  EXPECT_MEGAMOE_ERROR(f->bytes(other), kInvalidArgument, p, "'other'", "outside");
  other.begin = 6;
  other.end = 2;
  EXPECT_MEGAMOE_ERROR(f->bytes(other), kInvalidArgument, p, "outside");
}

}  // namespace
