// Safetensors files: a round trip, and every kind of bad header is a mantissa::Error naming the
// file and the fault (never another exception, never an allocation the file cannot fill).
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>

#include "mantissa/io/safetensors.h"
#include "mantissa/mantissa.h"
#include "support/errors.h"
#include "support/files.h"

namespace mantissa {
namespace {

using testing::error_of;
using testing::TempDir;
using testing::write_raw;

// A file of the given header (padded to 8 bytes as writers do) and data section.
std::string file_bytes(const std::string& header, const std::string& data = "") {
  std::string h = header;
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((h.size() >> (8 * i)) & 0xff));
  return out + h + data;
}

TEST(Safetensors, RoundTripsTensorsAndMetadata) {
  TempDir d;
  const std::string path = d.file("t.safetensors");
  const Tensor a = Tensor::from_floats({1, 2, 3, 4, 5, 6}, {2, 3}, DType::bf16);
  const Tensor b = Tensor::zeros({0, 4}, DType::i64);
  io::save_safetensors(path, {{"a", a}, {"empty", b}}, {{"step", "12"}});
  const io::SafetensorsFile f = io::load_safetensors(path);
  EXPECT_EQ(f.at("a").shape(), (Shape{2, 3}));
  EXPECT_EQ(f.at("a").dtype(), DType::bf16);
  EXPECT_EQ(f.at("a").to_float_vector(), a.to_float_vector());
  EXPECT_EQ(f.at("empty").shape(), (Shape{0, 4}));
  EXPECT_EQ(f.metadata.at("step"), "12");
  EXPECT_NE(error_of([&] { f.at("b"); }).find("no tensor 'b' in the file (it holds: a, empty)"),
            std::string::npos);
}

// The error of loading a file of these bytes ("" if it loads).
std::string load_error(const TempDir& d, const std::string& bytes) {
  const std::string path = d.file("bad.safetensors");
  write_raw(path, bytes);
  return error_of([&] { io::load_safetensors(path); });
}

TEST(Safetensors, FieldsOfTheWrongTypeAreNamed) {
  TempDir d;
  const std::string data(8, '\0');
  auto entry = [&](const std::string& fields) {
    return load_error(d, file_bytes("{\"w\":{" + fields + "}}", data));
  };
  const std::string ok = R"("dtype":"F32","shape":[2],"data_offsets":[0,8])";
  EXPECT_EQ(entry(ok), "");
  struct Case {
    std::string fields, message;
  };
  const Case cases[] = {
      {R"("dtype":7,"shape":[2],"data_offsets":[0,8])",
       "entry 'w' has a dtype that is not a string"},
      {R"("dtype":"F33","shape":[2],"data_offsets":[0,8])", "unsupported dtype 'F33'"},
      {R"("dtype":"F32","shape":"2","data_offsets":[0,8])", "has a shape that is not an array"},
      {R"("dtype":"F32","shape":{"a":2},"data_offsets":[0,8])", "has a shape that is not an array"},
      {R"("dtype":"F32","shape":[2.0],"data_offsets":[0,8])", "a size that is not a non-negative"},
      {R"("dtype":"F32","shape":[-2],"data_offsets":[0,8])", "a size that is not a non-negative"},
      {R"("dtype":"F32","shape":["2"],"data_offsets":[0,8])", "a size that is not a non-negative"},
      {R"("dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8])",
       "a size that is not a non-negative"},
      {R"("dtype":"F32","shape":[2],"data_offsets":"0,8")", "data_offsets that are not two"},
      {R"("dtype":"F32","shape":[2],"data_offsets":[0])", "data_offsets that are not two"},
      {R"("dtype":"F32","shape":[2],"data_offsets":[0,"8"])", "data_offsets that are not two"},
      {R"("dtype":"F32","shape":[2],"data_offsets":[-1,8])", "data_offsets that are not two"},
      {R"("dtype":"F32","shape":[2],"data_offsets":[0,8.5])", "data_offsets that are not two"},
      {R"("dtype":"F32","shape":[2],"data_offsets":[0,16])", "has data beyond the end of the file"},
      {R"("dtype":"F32","shape":[2],"data_offsets":[8,0])", "has data beyond the end of the file"},
      {R"("dtype":"F32","shape":[3],"data_offsets":[0,8])", "has 8 bytes for shape (3,) of f32"},
      {R"("dtype":"F32","shape":[2],"data_offsets":[0,8,8])", "data_offsets that are not two"},
      {R"("shape":[2],"data_offsets":[0,8])", "lacks dtype, shape or data_offsets"},
  };
  for (const Case& c : cases) {
    const std::string e = entry(c.fields);
    EXPECT_NE(e.find("bad.safetensors' is not a valid safetensors file: "), std::string::npos)
        << c.fields << ": " << e;
    EXPECT_NE(e.find(c.message), std::string::npos) << c.fields << ": " << e;
  }
  EXPECT_NE(load_error(d, file_bytes(R"({"w":[1,2]})")).find("entry 'w' is not a JSON object"),
            std::string::npos);
  EXPECT_NE(load_error(d, file_bytes(R"({"__metadata__":{"step":12}})"))
                .find("__metadata__ value 'step' is not a string"),
            std::string::npos);
  EXPECT_NE(
      load_error(d, file_bytes(R"({"__metadata__":[]})")).find("__metadata__ is not an object"),
      std::string::npos);
  EXPECT_NE(load_error(d, file_bytes("[1]")).find("header is not a JSON object"),
            std::string::npos);
  EXPECT_NE(load_error(d, file_bytes("{\"w\":")).find("header is not JSON"), std::string::npos);
}

TEST(Safetensors, SizesAreCheckedBeforeAnythingIsAllocated) {
  TempDir d;
  // Element counts whose byte count wraps around 2^64 to the 8 bytes present.
  std::string e = load_error(
      d, file_bytes(R"({"w":{"dtype":"F64","shape":[2305843009213693953],"data_offsets":[0,8]}})",
                    std::string(8, '\0')));
  EXPECT_NE(e.find("has 8 bytes for shape (2305843009213693953,) of f64"), std::string::npos) << e;
  e = load_error(
      d,
      file_bytes(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}})"));
  EXPECT_NE(e.find("has 0 bytes for shape (4294967296, 4294967296, 0)"), std::string::npos) << e;
  std::string ones = "1";
  for (int i = 1; i < 65; ++i) ones += ",1";
  e = load_error(
      d, file_bytes(R"({"w":{"dtype":"U8","shape":[)" + ones + R"(],"data_offsets":[0,1]}})", "x"));
  EXPECT_NE(e.find("has a shape that is not an array of at most 64 sizes"), std::string::npos) << e;
  // Overlapping data, a header longer than the file, a huge header, a file too short.
  e = load_error(d, file_bytes(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                               R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                               std::string(6, 'x')));
  EXPECT_NE(e.find("two tensors' data overlap"), std::string::npos) << e;
  std::string bytes = file_bytes("{}");
  bytes[5] = 1;  // header length 2^40 + 2
  EXPECT_NE(load_error(d, bytes).find("header length 1099511627778 exceeds the file"),
            std::string::npos);
  EXPECT_NE(load_error(d, "abc").find("shorter than the 8-byte header length"), std::string::npos);
}

TEST(Safetensors, OnlyRegularFilesAreRead) {
  TempDir d;
  std::filesystem::create_directory(d.file("dir.safetensors"));
  EXPECT_NE(error_of([&] {
              io::load_safetensors(d.file("dir.safetensors"));
            }).find("safetensors file " + d.file("dir.safetensors") + " is a directory"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              io::load_safetensors(d.file("absent.safetensors"));
            }).find("cannot find safetensors file " + d.file("absent.safetensors")),
            std::string::npos);
}

TEST(Safetensors, LongNamesAreCutInMessages) {
  TempDir d;
  const std::string name(100000, 'n');
  const std::string e = load_error(
      d, file_bytes("{\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,9]}}"));
  EXPECT_NE(e.find("entry '" + std::string(64, 'n') + "... (100000 bytes)' has data beyond"),
            std::string::npos)
      << e.substr(0, 300);
  EXPECT_LT(e.size(), 500u);
}

}  // namespace
}  // namespace mantissa
