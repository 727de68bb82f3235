// Whether a chart is drawn, from a screenshot: the pixels of its data.
//
// Charts draw their data in colour, and axes, grids and labels in greys or pale tints. A mark
// pixel stands out from the page background by at least kMarkContrast in some channel, is coloured
// (its channels spread over at least kMarkChroma), and lies outside the chart's labels: bars,
// areas, lines and points count (their anti-aliased edges too, down to about half strength); axes,
// grey text, coloured labels and pale bands behind the data do not, so a chart without its data
// has none.
#pragma once

#include <vector>

#include "browser/png.h"
#include "browser/probe.h"

namespace mantissa::browser {

inline constexpr int kMarkContrast = 64;
inline constexpr int kMarkChroma = 32;
// A chart is drawn when it has this many mark pixels, and at least this fraction of its box (a
// thin line across a chart is about 0.5%).
inline constexpr long kMinMarkPixels = 200;
inline constexpr double kMinMarkFraction = 0.002;

// The page background: the screenshot's most common colour.
Rgb most_common_colour(const Image& img);

// Mark pixels inside [x0, x1) x [y0, y1), outside the labels.
long mark_pixels(const Image& img, const Rgb& background, int x0, int y0, int x1, int y1,
                 const std::vector<Label>& labels);

}  // namespace mantissa::browser
