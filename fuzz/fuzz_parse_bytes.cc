// Sizes such as --memory-budget: parse_bytes on the bytes as text. A size it returns must read
// back the same from its decimal digits, with or without a unit of bytes.
#include <string>
#include <string_view>

#include "mantissa/core/memory.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::optional<size_t> bytes = mantissa::parse_bytes(text);
  if (bytes) {
    const std::string digits = std::to_string(*bytes);
    if (mantissa::parse_bytes(digits) != bytes || mantissa::parse_bytes(digits + " B") != bytes)
      __builtin_trap();
  }
  return 0;
}
