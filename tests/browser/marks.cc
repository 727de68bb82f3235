#include "browser/marks.h"

#include <algorithm>
#include <cstdlib>
#include <unordered_map>

namespace mantissa::browser {

Rgb most_common_colour(const Image& img) {
  std::unordered_map<uint32_t, long> counts;
  for (const Rgb& p : img.pixels) ++counts[(uint32_t(p.r) << 16) | (uint32_t(p.g) << 8) | p.b];
  const auto top = std::max_element(counts.begin(), counts.end(), [](const auto& a, const auto& b) {
    return a.second < b.second;
  });
  return Rgb{uint8_t(top->first >> 16), uint8_t(top->first >> 8), uint8_t(top->first)};
}

long mark_pixels(const Image& img, const Rgb& background, int x0, int y0, int x1, int y1,
                 const std::vector<Label>& labels) {
  long marks = 0;
  for (int y = y0; y < y1; ++y)
    for (int x = x0; x < x1; ++x) {
      const Rgb& p = img.at(x, y);
      const int contrast = std::max({std::abs(p.r - background.r), std::abs(p.g - background.g),
                                     std::abs(p.b - background.b)});
      const int chroma = std::max({p.r, p.g, p.b}) - std::min({p.r, p.g, p.b});
      if (contrast < kMarkContrast || chroma < kMarkChroma) continue;
      marks += std::none_of(labels.begin(), labels.end(),
                            [&](const Label& l) { return l.box.touches(x, y); });
    }
  return marks;
}

}  // namespace mantissa::browser
