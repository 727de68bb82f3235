#include "browser/png.h"

#include <zlib.h>

#include <cstdlib>
#include <stdexcept>

namespace mantissa::browser {
namespace {

uint32_t be32(const std::string& s, size_t at) {
  return (uint32_t(uint8_t(s[at])) << 24) | (uint32_t(uint8_t(s[at + 1])) << 16) |
         (uint32_t(uint8_t(s[at + 2])) << 8) | uint32_t(uint8_t(s[at + 3]));
}

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("PNG: " + what); }

std::string inflate_all(const std::string& z, size_t expected) {
  std::string out(expected, '\0');
  z_stream s{};
  if (inflateInit(&s) != Z_OK) fail("zlib inflateInit failed");
  s.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(z.data()));
  s.avail_in = static_cast<uInt>(z.size());
  s.next_out = reinterpret_cast<Bytef*>(out.data());
  s.avail_out = static_cast<uInt>(out.size());
  const int rc = inflate(&s, Z_FINISH);
  const size_t produced = s.total_out;
  inflateEnd(&s);
  if (rc != Z_STREAM_END || produced != expected)
    fail("image data does not inflate to " + std::to_string(expected) + " bytes");
  return out;
}

// The Paeth predictor of the PNG specification (section 9.4).
uint8_t paeth(int a, int b, int c) {
  const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
  if (pa <= pb && pa <= pc) return static_cast<uint8_t>(a);
  return static_cast<uint8_t>(pb <= pc ? b : c);
}

}  // namespace

Image decode_png(const std::string& bytes) {
  static const std::string kSignature = "\x89PNG\r\n\x1a\n";
  if (bytes.compare(0, kSignature.size(), kSignature) != 0) fail("not a PNG file (no signature)");
  Image img;
  int channels = 0;
  std::string idat;
  bool ended = false;
  for (size_t at = kSignature.size(); !ended;) {
    if (at + 12 > bytes.size()) fail("truncated before IEND");
    const uint32_t length = be32(bytes, at);
    if (length > bytes.size() - at - 12) fail("truncated chunk");
    const std::string type = bytes.substr(at + 4, 4);
    const uint32_t crc = be32(bytes, at + 8 + length);
    const uLong computed =
        crc32(0, reinterpret_cast<const Bytef*>(bytes.data() + at + 4), length + 4);
    if (computed != crc) fail("bad checksum in chunk " + type);
    const size_t data = at + 8;
    if (type == "IHDR") {
      if (length != 13) fail("bad IHDR");
      img.width = static_cast<int>(be32(bytes, data));
      img.height = static_cast<int>(be32(bytes, data + 4));
      const int depth = uint8_t(bytes[data + 8]), color = uint8_t(bytes[data + 9]);
      const int interlace = uint8_t(bytes[data + 12]);
      if (depth != 8 || interlace != 0)
        fail("only 8-bit, non-interlaced images are read (bit depth " + std::to_string(depth) +
             ", interlace " + std::to_string(interlace) + ")");
      switch (color) {
        case 0:
          channels = 1;
          break;
        case 2:
          channels = 3;
          break;
        case 4:
          channels = 2;
          break;
        case 6:
          channels = 4;
          break;
        default:
          fail("colour type " + std::to_string(color) + " is not read");
      }
      if (img.width <= 0 || img.height <= 0 || img.width > (1 << 15) || img.height > (1 << 15))
        fail("implausible size");
    } else if (type == "IDAT") {
      idat.append(bytes, data, length);
    } else if (type == "IEND") {
      ended = true;
    }
    at = data + length + 4;
  }
  if (channels == 0) fail("no IHDR");

  const size_t stride = static_cast<size_t>(img.width) * static_cast<size_t>(channels);
  const std::string raw = inflate_all(idat, (stride + 1) * static_cast<size_t>(img.height));
  std::vector<uint8_t> prev(stride, 0), cur(stride);
  img.pixels.resize(static_cast<size_t>(img.width) * static_cast<size_t>(img.height));
  const size_t bpp = static_cast<size_t>(channels);
  for (int y = 0; y < img.height; ++y) {
    const size_t row = static_cast<size_t>(y) * (stride + 1);
    const int filter = uint8_t(raw[row]);
    for (size_t i = 0; i < stride; ++i) {
      const int x = uint8_t(raw[row + 1 + i]);
      const int a = i >= bpp ? cur[i - bpp] : 0, b = prev[i], c = i >= bpp ? prev[i - bpp] : 0;
      int v = 0;
      switch (filter) {
        case 0:
          v = x;
          break;
        case 1:
          v = x + a;
          break;
        case 2:
          v = x + b;
          break;
        case 3:
          v = x + (a + b) / 2;
          break;
        case 4:
          v = x + paeth(a, b, c);
          break;
        default:
          fail("unknown row filter " + std::to_string(filter));
      }
      cur[i] = static_cast<uint8_t>(v);
    }
    for (int x = 0; x < img.width; ++x) {
      const uint8_t* p = &cur[static_cast<size_t>(x) * bpp];
      Rgb& out = img.pixels[static_cast<size_t>(y) * static_cast<size_t>(img.width) +
                            static_cast<size_t>(x)];
      out = channels >= 3 ? Rgb{p[0], p[1], p[2]} : Rgb{p[0], p[0], p[0]};
    }
    std::swap(prev, cur);
  }
  return img;
}

}  // namespace mantissa::browser
