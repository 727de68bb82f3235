// The PyTorch golden files of tests/golden (from scripts/make_golden*.py), each read once per
// test program.
#pragma once

#include <map>
#include <string>

#include "mantissa/io/safetensors.h"

#ifndef MANTISSA_GOLDEN_DIR
#error "MANTISSA_GOLDEN_DIR must name tests/golden"
#endif

namespace mantissa::testing {

inline const io::SafetensorsFile& golden_file(const std::string& name) {
  static std::map<std::string, io::SafetensorsFile> cache;
  auto it = cache.find(name);
  if (it == cache.end())
    it = cache.emplace(name, io::load_safetensors(std::string(MANTISSA_GOLDEN_DIR) + "/" + name))
             .first;
  return it->second;
}

}  // namespace mantissa::testing
