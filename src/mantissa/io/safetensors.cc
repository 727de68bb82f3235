#include "mantissa/io/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "mantissa/core/error.h"
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
  bad(path, "unsupported dtype '" + code + "'");
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

SafetensorsFile load_safetensors(const std::string& path, MemoryCategory category) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open '" + path + "'", "check the path and its permissions");
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  if (file_size < 8) bad(path, "shorter than the 8-byte header length");
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > file_size - 8)
    bad(path, "header length " + std::to_string(header_len) + " exceeds the file");
  std::string header(static_cast<size_t>(header_len), '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    bad(path, std::string("header is not JSON (") + e.what() + ")");
  }
  if (!j.is_object()) bad(path, "header is not a JSON object");
  const uint64_t data_size = file_size - 8 - header_len;
  SafetensorsFile out;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) bad(path, "__metadata__ is not an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m)
        out.metadata[m.key()] =
            m.value().is_string() ? m.value().get<std::string>() : m.value().dump();
      continue;
    }
    const nlohmann::json& e = it.value();
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
        !e.contains("data_offsets"))
      bad(path, "entry '" + it.key() + "' lacks dtype, shape or data_offsets");
    const DType t = dtype_from_safetensors(e["dtype"].get<std::string>(), path);
    Shape shape;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0)
        bad(path, "entry '" + it.key() + "' has a bad shape");
      shape.push_back(d.get<int64_t>());
    }
    const auto& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2)
      bad(path, "entry '" + it.key() + "' has bad data_offsets");
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (end < begin || end > data_size)
      bad(path, "entry '" + it.key() + "' has data beyond the end of the file");
    if (end - begin != static_cast<uint64_t>(n) * dtype_size(t))
      bad(path, "entry '" + it.key() + "' has " + std::to_string(end - begin) +
                    " bytes for shape " + shape_str(shape) + " of " + std::string(dtype_name(t)));
    ranges.emplace_back(begin, end);
    TensorOptions opt;
    opt.category = category;
    opt.owner = it.key();
    Tensor tensor = Tensor::empty(shape, t, opt);
    in.seekg(static_cast<std::streamoff>(8 + header_len + begin));
    in.read(static_cast<char*>(tensor.data_ptr()), static_cast<std::streamsize>(end - begin));
    if (!in) bad(path, "could not read the data of '" + it.key() + "'");
    out.tensors.emplace(it.key(), std::move(tensor));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) bad(path, "two tensors' data overlap");
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
