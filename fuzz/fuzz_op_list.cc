// Op-list files (--autocast-lower-list, --autocast-fp32-list): the bytes as the file, read, then
// applied to a policy as the trainer does.
#include "fuzz_input.h"
#include "mantissa/core/error.h"
#include "mantissa/ops/autocast.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mantissa::fuzz::write_input("ops.txt", data, size);
  try {
    const std::vector<std::string> names = mantissa::ops::read_op_list(path);
    mantissa::ops::AutocastPolicy policy;
    policy.replace_lists(names, std::nullopt);
  } catch (const mantissa::Error&) {
  }
  return 0;
}
