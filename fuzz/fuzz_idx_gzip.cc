// The IDX reader behind gzip: the bytes are compressed first, so the fuzzer explores the IDX
// header and the bounded decompression (a stream longer or shorter than its header declares)
// instead of spending its time on checksums. The first byte, if any, picks what the trailer's
// length says: the truth, or the length the IDX header declares (a lying trailer).
#include <zlib.h>

#include <cstdlib>
#include <vector>

#include "fuzz_input.h"
#include "mantissa/core/error.h"
#include "mantissa/data/datasets.h"

namespace {
std::vector<uint8_t> gzip(const uint8_t* data, size_t size) {
  z_stream z{};
  if (deflateInit2(&z, 1, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) std::abort();
  std::vector<uint8_t> out(deflateBound(&z, size));
  z.next_in = const_cast<uint8_t*>(data);
  z.avail_in = static_cast<uInt>(size);
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  if (deflate(&z, Z_FINISH) != Z_STREAM_END) std::abort();
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool lying_trailer = data[0] & 1;
  std::vector<uint8_t> gz = gzip(data + 1, size - 1);
  if (lying_trailer && size >= 5) {
    // The size the IDX header would declare, ignoring overflow: the trailer agrees with it.
    const int dims = data[4];
    uint64_t declared = 4 + 4 * static_cast<uint64_t>(dims);
    uint64_t count = 1;
    for (int d = 0; d < dims && 5 + 4 * d + 4 <= static_cast<int>(size); ++d)
      count *= (uint64_t{data[5 + 4 * d]} << 24) | (uint64_t{data[6 + 4 * d]} << 16) |
               (uint64_t{data[7 + 4 * d]} << 8) | data[8 + 4 * d];
    declared += count;
    for (int i = 0; i < 4; ++i) gz[gz.size() - 4 + i] = static_cast<uint8_t>(declared >> (8 * i));
  }
  const std::string path = mantissa::fuzz::write_input("input.idx.gz", gz.data(), gz.size());
  try {
    const mantissa::Tensor t = mantissa::data::read_idx(path);
    mantissa::fuzz::read_every_byte(t);
  } catch (const mantissa::Error&) {
  }
  return 0;
}
