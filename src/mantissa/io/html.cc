#include "mantissa/io/html.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>

namespace mantissa::io::html {
namespace {

constexpr const char* kCategoryColours[kNumMemoryCategories] = {
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#9c755f", "#76b7b2"};

std::string format(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace

std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    switch (ch) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += ch;
    }
  }
  return out;
}

std::string page_start(std::string_view title, std::string_view extra_css) {
  return "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>" +
         escape(title) +
         "</title>\n<style>body{font:14px sans-serif;margin:24px;color:#222}"
         "table{border-collapse:collapse}td,th{padding:3px 10px;border-bottom:1px solid #ddd;"
         "text-align:right}td:first-child,th:first-child{text-align:left}"
         ".key span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px}" +
         std::string(extra_css) + "</style></head><body>\n";
}

std::string num(double v) {
  std::string s = format("%.2f", v);
  s.erase(s.find_last_not_of('0') + 1);
  if (s.back() == '.') s.pop_back();
  return s == "-0" ? "0" : s;
}

const char* category_colour(MemoryCategory c) { return kCategoryColours[static_cast<size_t>(c)]; }

std::string category_key() {
  std::string h = "<p class=\"key\">";
  for (MemoryCategory c : kAllMemoryCategories)
    h += "<span style=\"background:" + std::string(category_colour(c)) + "\"></span>" +
         std::string(memory_category_name(c));
  return h + "</p>\n";
}

std::string category_bars(const std::vector<CategoryBar>& rows, std::optional<size_t> marker,
                          const std::string& marker_label) {
  size_t top = 1;
  for (const CategoryBar& r : rows) {
    size_t total = 0;
    for (size_t b : r.bytes) total += b;
    top = std::max(top, total);
  }
  if (marker) top = std::max(top, *marker);
  // Room left of the bars for the row's label, right of them for the note ("2.65 MiB (does not
  // fit)"), above them for the marker's label.
  const double W = 640, bar_x = 110, top_y = 20, row_h = 40;
  const double n = static_cast<double>(rows.size());
  std::ostringstream h;
  h << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(bar_x + W + 200)
    << "\" height=\"" << num(row_h * n + top_y + 10) << "\">\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const CategoryBar& r = rows[i];
    const double y = top_y + row_h * static_cast<double>(i);
    h << "<text x=\"0\" y=\"" << num(y + 18) << "\">" << escape(r.label) << "</text>\n";
    double x = bar_x;
    for (MemoryCategory c : kAllMemoryCategories) {
      const size_t b = r.bytes[static_cast<size_t>(c)];
      const double w = W * static_cast<double>(b) / static_cast<double>(top);
      if (w <= 0) continue;
      h << "<rect x=\"" << num(x) << "\" y=\"" << num(y) << "\" width=\"" << num(w)
        << "\" height=\"26\" fill=\"" << category_colour(c) << "\"><title>"
        << memory_category_name(c) << ": " << format_bytes(b) << "</title></rect>\n";
      x += w;
    }
    if (!r.note.empty())
      h << "<text x=\"" << num(x + 6) << "\" y=\"" << num(y + 18) << "\">" << escape(r.note)
        << "</text>\n";
  }
  if (marker) {
    const double bx = bar_x + W * static_cast<double>(*marker) / static_cast<double>(top);
    h << "<line x1=\"" << num(bx) << "\" x2=\"" << num(bx) << "\" y1=\"4\" y2=\""
      << num(row_h * n + top_y) << "\" stroke=\"#c00\" stroke-dasharray=\"4 3\"/><text x=\""
      << num(bx + 3) << "\" y=\"15\" font-size=\"12\" fill=\"#c00\">" << escape(marker_label)
      << "</text>\n";
  }
  h << "</svg>\n";
  return h.str();
}

std::string line_chart(const LineChart& chart) {
  // The plot's box inside the chart: room left for the y labels, below for the x labels.
  const double L = 70, T = 14, CW = 760, CH = 200, R = 20, B = 28;
  const auto shown = [&](double x, double y) {
    return std::isfinite(x) && std::isfinite(y) && (!chart.log2_y || y > 0);
  };
  const auto to_axis = [&](double y) { return chart.log2_y ? std::log2(y) : y; };
  double x_lo = INFINITY, x_hi = -INFINITY, y_lo = INFINITY, y_hi = -INFINITY;
  for (const LineSeries& s : chart.series)
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!shown(s.x[i], s.y[i])) continue;
      x_lo = std::min(x_lo, s.x[i]);
      x_hi = std::max(x_hi, s.x[i]);
      y_lo = std::min(y_lo, to_axis(s.y[i]));
      y_hi = std::max(y_hi, to_axis(s.y[i]));
    }
  for (const ReferenceLine& r : chart.references)
    if (shown(0, r.y)) {
      y_lo = std::min(y_lo, to_axis(r.y));
      y_hi = std::max(y_hi, to_axis(r.y));
    }
  if (!(x_lo <= x_hi)) x_lo = 0, x_hi = 1;  // nothing to draw: an empty frame
  if (!(y_lo <= y_hi)) y_lo = 0, y_hi = 1;
  if (chart.log2_y) {
    y_lo = std::floor(chart.y_min ? std::log2(*chart.y_min) : y_lo);
    y_hi = std::ceil(chart.y_max ? std::log2(*chart.y_max) : y_hi);
    if (y_hi <= y_lo) y_lo -= 1, y_hi += 1;
    if (static_cast<int64_t>(y_hi - y_lo) % 2 != 0) y_hi += 1;  // the middle tick a power of two
  } else {
    y_lo = chart.y_min.value_or(std::min(0.0, y_lo));
    if (chart.y_max) y_hi = *chart.y_max;
    if (y_hi <= y_lo) y_hi = y_lo + 1;
  }
  if (x_hi <= x_lo) x_hi = x_lo + 1;
  const auto X = [&](double x) { return L + CW * (x - x_lo) / (x_hi - x_lo); };
  const auto Y = [&](double y) {
    const double a = std::clamp(to_axis(y), y_lo, y_hi);
    return T + CH - CH * (a - y_lo) / (y_hi - y_lo);
  };
  const auto x_text = chart.x_label ? chart.x_label : [](double x) { return format("%.0f", x); };
  const auto y_text = chart.y_label ? chart.y_label : [](double y) { return format("%.4g", y); };

  std::ostringstream h;
  h << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(L + CW + R) << "\" height=\""
    << num(T + CH + B) << "\" font-size=\"11\">\n";
  // Axes, and the ticks' labels: y at the bottom, middle and top (right-aligned left of the
  // axis), x at the left end, middle and right end (below it).
  h << "<path d=\"M" << num(L) << " " << num(T) << "V" << num(T + CH) << "H" << num(L + CW)
    << "\" fill=\"none\" stroke=\"#444\"/>\n";
  for (int i = 0; i < 3; ++i) {
    const double a = y_lo + (y_hi - y_lo) * i / 2.0;
    const double v = chart.log2_y ? std::exp2(a) : a;
    const double y = T + CH - CH * i / 2.0;
    h << "<line x1=\"" << num(L - 4) << "\" x2=\"" << num(L + CW) << "\" y1=\"" << num(y)
      << "\" y2=\"" << num(y) << "\" stroke=\"" << (i == 0 ? "#444" : "#e4e4e4") << "\"/>"
      << "<text x=\"" << num(L - 6) << "\" y=\"" << num(y + 4) << "\" text-anchor=\"end\">"
      << escape(y_text(v)) << "</text>\n";
  }
  // (A label that repeats another, on a short axis of whole steps, is left out.)
  const char* anchors[] = {"start", "middle", "end"};
  std::vector<std::string> x_ticks;
  for (int i = 0; i < 3; ++i) {
    const double v = x_lo + (x_hi - x_lo) * i / 2.0;
    const std::string text = x_text(v);
    if (std::find(x_ticks.begin(), x_ticks.end(), text) != x_ticks.end()) continue;
    x_ticks.push_back(text);
    h << "<text x=\"" << num(X(v)) << "\" y=\"" << num(T + CH + 16) << "\" text-anchor=\""
      << anchors[i] << "\">" << escape(text) << "</text>\n";
  }
  for (const ReferenceLine& r : chart.references) {
    if (!shown(0, r.y)) continue;
    const double y = Y(r.y);
    // The label above the line, or below it when the line runs along the top.
    const double label_y = y - T < 14 ? y + 13 : y - 4;
    h << "<line x1=\"" << num(L) << "\" x2=\"" << num(L + CW) << "\" y1=\"" << num(y) << "\" y2=\""
      << num(y) << "\" stroke=\"" << r.colour << "\" stroke-dasharray=\"5 4\"/>"
      << "<text x=\"" << num(L + CW - 4) << "\" y=\"" << num(label_y)
      << "\" text-anchor=\"end\" fill=\"" << r.colour << "\">" << escape(r.label) << "</text>\n";
  }
  for (const LineSeries& s : chart.series) {
    std::string points;
    double last_y = NAN;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!shown(s.x[i], s.y[i])) continue;
      const double px = X(s.x[i]), py = Y(s.y[i]);
      if (s.steps && std::isfinite(last_y)) points += num(px) + "," + num(last_y) + " ";
      points += num(px) + "," + num(py) + " ";
      last_y = py;
    }
    if (points.empty()) continue;
    points.pop_back();
    if (points.find(' ') == std::string::npos) {  // one point: a dot
      const size_t comma = points.find(',');
      h << "<circle cx=\"" << points.substr(0, comma) << "\" cy=\"" << points.substr(comma + 1)
        << "\" r=\"3\" fill=\"" << s.colour << "\"><title>" << escape(s.name)
        << "</title></circle>\n";
      continue;
    }
    h << "<polyline points=\"" << points << "\" fill=\"none\" stroke=\"" << s.colour
      << "\" stroke-width=\"2\" stroke-linejoin=\"round\"><title>" << escape(s.name)
      << "</title></polyline>\n";
  }
  h << "</svg>\n";
  return h.str();
}

}  // namespace mantissa::io::html
