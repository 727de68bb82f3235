// The screenshot reader against PNG files written here, one per colour type, with every row filter
// (Chromium's encoder picks filters per row), and against damaged files.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "browser/png.h"

namespace mantissa::browser {
namespace {

void put32(std::string& s, uint32_t v) {
  for (int k = 3; k >= 0; --k) s.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

void chunk(std::string& png, const std::string& type, const std::string& data) {
  put32(png, static_cast<uint32_t>(data.size()));
  const std::string body = type + data;
  png += body;
  put32(png, static_cast<uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(body.data()),
                                         static_cast<uInt>(body.size()))));
}

int paeth(int a, int b, int c) {
  const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
  return pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
}

// A PNG of `raw` ((height, width, channels) bytes); row y uses filter y % 5. The IDAT data is
// split in two chunks, as encoders may.
std::string encode(int width, int height, int color_type, int channels,
                   const std::vector<uint8_t>& raw) {
  const size_t stride = static_cast<size_t>(width * channels);
  std::string filtered;
  for (int y = 0; y < height; ++y) {
    const int filter = y % 5;
    filtered.push_back(static_cast<char>(filter));
    for (size_t i = 0; i < stride; ++i) {
      const size_t at = static_cast<size_t>(y) * stride + i;
      const int x = raw[at];
      const int a = i >= size_t(channels) ? raw[at - channels] : 0;
      const int b = y > 0 ? raw[at - stride] : 0;
      const int c = y > 0 && i >= size_t(channels) ? raw[at - stride - channels] : 0;
      const int predictor = filter == 0   ? 0
                            : filter == 1 ? a
                            : filter == 2 ? b
                            : filter == 3 ? (a + b) / 2
                                          : paeth(a, b, c);
      filtered.push_back(static_cast<char>((x - predictor) & 0xff));
    }
  }
  uLongf size = compressBound(static_cast<uLong>(filtered.size()));
  std::string z(size, '\0');
  compress(reinterpret_cast<Bytef*>(z.data()), &size,
           reinterpret_cast<const Bytef*>(filtered.data()), static_cast<uLong>(filtered.size()));
  z.resize(size);
  std::string png = "\x89PNG\r\n\x1a\n", ihdr;
  put32(ihdr, static_cast<uint32_t>(width));
  put32(ihdr, static_cast<uint32_t>(height));
  ihdr += std::string{8, static_cast<char>(color_type), 0, 0, 0};
  chunk(png, "IHDR", ihdr);
  chunk(png, "IDAT", z.substr(0, z.size() / 2));
  chunk(png, "IDAT", z.substr(z.size() / 2));
  chunk(png, "IEND", "");
  return png;
}

// Values that make every predictor matter: a gradient, a checker pattern, and wrap-around.
std::vector<uint8_t> pattern(int width, int height, int channels) {
  std::vector<uint8_t> v;
  for (int y = 0; y < height; ++y)
    for (int x = 0; x < width; ++x)
      for (int c = 0; c < channels; ++c)
        v.push_back(static_cast<uint8_t>(37 * x + 91 * y + 53 * c + ((x ^ y) & 1) * 200));
  return v;
}

TEST(Png, EveryColourTypeAndFilter) {
  const int width = 7, height = 11;
  for (const auto& [color_type, channels] : {std::pair{0, 1}, {2, 3}, {4, 2}, {6, 4}}) {
    SCOPED_TRACE("colour type " + std::to_string(color_type));
    const std::vector<uint8_t> raw = pattern(width, height, channels);
    const Image img = decode_png(encode(width, height, color_type, channels, raw));
    ASSERT_EQ(img.width, width);
    ASSERT_EQ(img.height, height);
    for (int y = 0; y < height; ++y)
      for (int x = 0; x < width; ++x) {
        const uint8_t* p = &raw[static_cast<size_t>((y * width + x) * channels)];
        const Rgb want = channels >= 3 ? Rgb{p[0], p[1], p[2]} : Rgb{p[0], p[0], p[0]};
        ASSERT_EQ(img.at(x, y), want) << "pixel " << x << "," << y;
      }
  }
}

TEST(Png, DamagedFilesAreErrors) {
  const std::string good = encode(5, 5, 2, 3, pattern(5, 5, 3));
  EXPECT_NO_THROW(decode_png(good));
  std::string flipped = good;
  flipped[40] ^= 1;  // inside the first IDAT chunk
  EXPECT_THROW(decode_png(flipped), std::runtime_error);
  EXPECT_THROW(decode_png(good.substr(0, good.size() - 12)), std::runtime_error);  // no IEND
  EXPECT_THROW(decode_png("GIF89a"), std::runtime_error);
  // Well-formed but not read: 16 bits a channel.
  std::string sixteen_bit = "\x89PNG\r\n\x1a\n", ihdr;
  put32(ihdr, 5);
  put32(ihdr, 5);
  ihdr += std::string{16, 2, 0, 0, 0};
  chunk(sixteen_bit, "IHDR", ihdr);
  chunk(sixteen_bit, "IEND", "");
  EXPECT_THROW(decode_png(sixteen_bit), std::runtime_error);
}

}  // namespace
}  // namespace mantissa::browser
