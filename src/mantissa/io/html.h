// What the HTML pages Mantissa writes share (the memory report, the numerics report, the training
// report): escaping, the page's frame and style, and SVG charts drawn here, in C++. The pages are
// self-contained: no script, style, font or image comes from elsewhere, so they open offline, and
// their charts are drawn without scripts.
//
// A chart is one <svg> element; its labels (<text>) stay inside it and apart from one another
// (tests/browser checks both in a real browser), and its data is drawn in colour while axes and
// labels are grey.
#pragma once

#include <array>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mantissa/core/memory.h"

namespace mantissa::io::html {

// `text` with &, <, > and " replaced by entities: safe as element text and as a quoted attribute.
std::string escape(std::string_view text);

// The start of a page up to and including <body>: the title (escaped here), the shared style
// (sans-serif text, ruled tables whose first column is left-aligned and the others right-aligned,
// the colour key's swatches) and `extra_css`.
std::string page_start(std::string_view title, std::string_view extra_css = "");
inline constexpr const char* kPageEnd = "</body></html>\n";

// A coordinate or length for SVG: at most two decimals, no trailing zeros.
std::string num(double v);

// One colour per memory category (MANTISSA_MEMORY_CATEGORIES' order), and the key that names them:
// a swatch and the category's name each.
const char* category_colour(MemoryCategory c);
std::string category_key();

// Horizontal stacked bars of memory by category, one bar per row on a common scale (the largest
// row, or `marker` when larger): each category's part in its colour (its size on hover), the
// row's label left of the bar and `note` right of it. `marker` draws a dashed vertical line at
// that many bytes, labelled `marker_label` (a budget).
struct CategoryBar {
  std::string label;
  std::array<size_t, kNumMemoryCategories> bytes{};
  std::string note;  // after the bar, e.g. "2.65 MiB (does not fit)"
};
std::string category_bars(const std::vector<CategoryBar>& rows,
                          std::optional<size_t> marker = std::nullopt,
                          const std::string& marker_label = "");

// A line chart: one or more series over a common x axis, with the y axis linear from y_min or in
// powers of two (log2_y), three labelled ticks on each axis and optional horizontal reference
// lines. Points that are not finite (or not positive on a log2 axis) are left out.
struct LineSeries {
  std::string name;    // on hover
  std::string colour;  // a colour the data is drawn in ("#4e79a7")
  std::vector<double> x, y;
  bool steps = false;  // a step function: each y holds until the next x
};
struct ReferenceLine {
  double y = 0;
  std::string label;  // written at the chart's right end, beside the line
  std::string colour;
};
struct LineChart {
  std::vector<LineSeries> series;
  std::vector<ReferenceLine> references;
  bool log2_y = false;
  std::optional<double> y_min, y_max;  // default: 0 (linear) or the data's, and the data's
  // The tick labels: x as an integer by default, y with 4 significant digits.
  std::function<std::string(double)> x_label, y_label;
};
std::string line_chart(const LineChart& chart);

}  // namespace mantissa::io::html
