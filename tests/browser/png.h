// A PNG reader for the screenshots the browser checks take: 8-bit greyscale, grey + alpha, RGB
// and RGBA, not interlaced (what Chromium writes), decoded to RGB. Chunk checksums are verified,
// so a truncated or damaged file is an error rather than a picture of noise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mantissa::browser {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};

struct Image {
  int width = 0, height = 0;
  std::vector<Rgb> pixels;  // (height, width), row-major
  const Rgb& at(int x, int y) const {
    return pixels[static_cast<size_t>(y) * static_cast<size_t>(width) + static_cast<size_t>(x)];
  }
};

// Decodes a PNG file's bytes; throws std::runtime_error naming what is wrong. Alpha is dropped
// (a screenshot is opaque).
Image decode_png(const std::string& bytes);

}  // namespace mantissa::browser
