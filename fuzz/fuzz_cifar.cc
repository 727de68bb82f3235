// The CIFAR-10 reader on the bytes as a test batch file (raw, or gzip by its magic).
#include "fuzz_input.h"
#include "mantissa/core/error.h"
#include "mantissa/data/datasets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mantissa::fuzz::write_input("test_batch.bin", data, size);
  try {
    const mantissa::data::Dataset d =
        mantissa::data::load_cifar10(mantissa::fuzz::scratch_dir().string(), false);
    const int64_t* labels = d.labels.data<int64_t>();
    for (int64_t i = 0; i < d.size(); ++i)
      if (labels[i] < 0 || labels[i] >= d.num_classes) __builtin_trap();
  } catch (const mantissa::Error&) {
  }
  return 0;
}
