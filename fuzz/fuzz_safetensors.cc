// The safetensors reader on the bytes as a whole file: header, metadata and data. Every tensor it
// returns must have all its bytes readable.
#include "fuzz_input.h"
#include "mantissa/core/error.h"
#include "mantissa/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mantissa::fuzz::write_input("input.safetensors", data, size);
  try {
    const mantissa::io::SafetensorsFile f = mantissa::io::load_safetensors(path);
    for (const auto& [name, t] : f.tensors) mantissa::fuzz::read_every_byte(t);
  } catch (const mantissa::Error&) {
  }
  return 0;
}
