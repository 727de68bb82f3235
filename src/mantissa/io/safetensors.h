// Reading and writing safetensors files (the format PyTorch users' tools read): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape and byte range,
// then the raw little-endian data. Used for golden files, weights and checkpoints.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "mantissa/core/tensor.h"

namespace mantissa::io {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;  // the header's "__metadata__" (strings only)

  // The tensor called `name`; throws mantissa::Error naming the file's contents if absent.
  const Tensor& at(const std::string& name) const;
  bool contains(const std::string& name) const { return tensors.count(name) != 0; }
};

// Reads a whole file. Every inconsistency (truncated file, bad header, unknown dtype, a byte range
// that does not match the shape or overlaps another) throws mantissa::Error naming the file and
// what is wrong. Tensors are charged to `category`.
SafetensorsFile load_safetensors(const std::string& path,
                                 MemoryCategory category = MemoryCategory::parameters);

// Writes tensors (in the given order) and metadata. Atomic: the data goes to a temporary file in
// the same directory that is renamed over `path` only once complete, so a crash never leaves a
// half-written file behind.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The safetensors dtype code of a Mantissa dtype ("F32", "BF16", "F8_E4M3", ...) and back.
std::string safetensors_dtype(DType t);
DType dtype_from_safetensors(const std::string& code, const std::string& path);

}  // namespace mantissa::io
