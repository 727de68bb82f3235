// The IDX reader on the bytes as a file: raw, or gzip when they start with its magic (the corpus
// holds both).
#include "fuzz_input.h"
#include "mantissa/core/error.h"
#include "mantissa/data/datasets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mantissa::fuzz::write_input("input.idx", data, size);
  try {
    const mantissa::Tensor t = mantissa::data::read_idx(path);
    // Every byte the reader says it holds is readable.
    mantissa::fuzz::read_every_byte(t);
  } catch (const mantissa::Error&) {
  }
  return 0;
}
