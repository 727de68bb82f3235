#include "mantissa/io/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>

#include "mantissa/core/checked.h"
#include "mantissa/core/error.h"
#include "mantissa/io/input_file.h"
#include "mantissa/io/output_file.h"

namespace mantissa::io {

namespace {
struct Code {
  DType type;
  const char* code;
};
constexpr Code kCodes[] = {
    {DType::f32, "F32"},      {DType::f64, "F64"},      {DType::f16, "F16"}, {DType::bf16, "BF16"},
    {DType::e4m3, "F8_E4M3"}, {DType::e5m2, "F8_E5M2"}, {DType::i32, "I32"}, {DType::i64, "I64"},
    {DType::u8, "U8"},        {DType::boolean, "BOOL"}};

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw Error("'" + path + "' is not a valid safetensors file: " + what,
              "check that the file is complete and was written as safetensors");
}
}  // namespace

std::string safetensors_dtype(DType t) {
  for (const Code& c : kCodes)
    if (c.type == t) return c.code;
  return "?";
}

DType dtype_from_safetensors(const std::string& code, const std::string& path) {
  for (const Code& c : kCodes)
    if (code == c.code) return c.type;
  bad(path, "unsupported dtype '" + excerpt(code) + "'");
}

const Tensor& SafetensorsFile::at(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) {
    std::string names;
    for (const auto& [n, t] : tensors) names += (names.empty() ? "" : ", ") + n;
    if (names.size() > 300) names = names.substr(0, 300) + "...";
    throw Error("no tensor '" + name + "' in the file (it holds: " + names + ")",
                "check the tensor name, or that the file belongs to this model");
  }
  return it->second;
}

namespace {
// The reference implementation's limit on the JSON header; also bounds what parsing it costs.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr size_t kMaxRank = 64;

// One tensor's header entry, checked: its data lies within the file and matches its shape.
struct Entry {
  std::string name;
  DType type;
  Shape shape;
  uint64_t begin, end;  // within the data section
};

Entry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& e,
                  uint64_t data_size) {
  const std::string what = "entry '" + excerpt(name) + "'";
  if (!e.is_object()) bad(path, what + " is not a JSON object");
  const auto dtype = e.find("dtype"), shape = e.find("shape"), offsets = e.find("data_offsets");
  if (dtype == e.end() || shape == e.end() || offsets == e.end())
    bad(path, what + " lacks dtype, shape or data_offsets");
  if (!dtype->is_string()) bad(path, what + " has a dtype that is not a string");
  Entry out{name, dtype_from_safetensors(dtype->get<std::string>(), path), {}, 0, 0};
  if (!shape->is_array() || shape->size() > kMaxRank)
    bad(path, what + " has a shape that is not an array of at most " + std::to_string(kMaxRank) +
                  " sizes");
  for (const nlohmann::json& d : *shape) {
    if (!d.is_number_unsigned() ||
        d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      bad(path, what + " has a shape with a size that is not a non-negative integer");
    out.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  if (!offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned())
    bad(path, what + " has data_offsets that are not two non-negative integers");
  out.begin = (*offsets)[0].get<uint64_t>();
  out.end = (*offsets)[1].get<uint64_t>();
  if (out.end < out.begin || out.end > data_size)
    bad(path, what + " has data beyond the end of the file");
  std::optional<uint64_t> bytes;
  try {
    bytes = checked_mul(static_cast<uint64_t>(shape_numel(out.shape)),
                        static_cast<uint64_t>(dtype_size(out.type)));
  } catch (const Error&) {
    // too many elements: bytes stays empty
  }
  if (!bytes || *bytes != out.end - out.begin)
    bad(path, what + " has " + std::to_string(out.end - out.begin) + " bytes for shape " +
                  shape_str(out.shape) + " of " + std::string(dtype_name(out.type)));
  return out;
}
}  // namespace

SafetensorsFile load_safetensors(const std::string& path, MemoryCategory category) {
  const InputFile file(path, "safetensors file", kMaxSafetensorsFileBytes,
                       "check the path and its permissions");
  const uint64_t file_size = file.size();
  if (file_size < 8) bad(path, "shorter than the 8-byte header length");
  unsigned char len_bytes[8];
  file.read_at(0, len_bytes, 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > file_size - 8)
    bad(path, "header length " + std::to_string(header_len) + " exceeds the file");
  if (header_len > kMaxHeaderBytes)
    bad(path, "header length " + std::to_string(header_len) + " is over the limit of " +
                  std::to_string(kMaxHeaderBytes) + " bytes");
  std::string header(static_cast<size_t>(header_len), '\0');
  file.read_at(8, header.data(), header.size());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    bad(path, "header is not JSON (" + excerpt(e.what(), 200) + ")");
  }
  if (!j.is_object()) bad(path, "header is not a JSON object");
  const uint64_t data_size = file_size - 8 - header_len;
  // Every entry is checked, and their byte ranges against each other, before any is allocated.
  SafetensorsFile out;
  std::vector<Entry> entries;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) bad(path, "__metadata__ is not an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string())
          bad(path, "__metadata__ value '" + excerpt(m.key()) + "' is not a string");
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, it.key(), it.value(), data_size));
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const Entry& e : entries) ranges.emplace_back(e.begin, e.end);
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) bad(path, "two tensors' data overlap");
  for (const Entry& e : entries) {
    TensorOptions opt;
    opt.category = category;
    opt.owner = e.name;
    Tensor tensor = Tensor::empty(e.shape, e.type, opt);
    file.read_at(8 + header_len + e.begin, tensor.data_ptr(), e.end - e.begin);
    out.tensors.emplace(e.name, std::move(tensor));
  }
  return out;
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<Tensor> contiguous;
  for (const auto& [name, t] : tensors) {
    MANTISSA_CHECK(t.defined(), "save_safetensors: tensor '" + name + "' is undefined",
                   "save defined tensors only");
    MANTISSA_CHECK(header.find(name) == header.end(),
                   "save_safetensors: the name '" + name + "' appears twice",
                   "give every tensor a distinct name");
    contiguous.push_back(t.contiguous());
    header[name] = {{"dtype", safetensors_dtype(t.dtype())},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // align the data to 8 bytes, as the reference writer does
  write_file_atomic(path, [&](std::ostream& out) {
    unsigned char len_bytes[8];
    const uint64_t len = h.size();
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
    out.write(reinterpret_cast<const char*>(len_bytes), 8);
    out.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const Tensor& t : contiguous)
      if (t.nbytes())
        out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  });
}

}  // namespace mantissa::io
