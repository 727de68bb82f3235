// The PyTorch golden files of tests/golden (from scripts/make_golden*.py).
#pragma once

#include <string>

#include "mantissa/io/safetensors.h"

#ifndef MANTISSA_GOLDEN_DIR
#error "MANTISSA_GOLDEN_DIR must name tests/golden"
#endif

namespace mantissa::testing {

// Loaded on every call, not cached: tensors kept alive for the rest of the process would be
// counted by the memory tracker in later tests of the same binary (a memory report covers every
// live tensor).
inline io::SafetensorsFile golden_file(const std::string& name) {
  return io::load_safetensors(std::string(MANTISSA_GOLDEN_DIR) + "/" + name);
}

}  // namespace mantissa::testing
