// The probe: a Content-Security-Policy and a measuring script added to a copy of a page, and what
// the script reports once the page has loaded (the page's size, each chart's box and labels, any
// load the policy blocked), read back from the DOM that the browser prints.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace mantissa::browser {

// Everything a self-contained page may load: inline scripts and styles, data: and blob: URIs.
inline constexpr const char* kSelfContainedPolicy =
    "default-src 'unsafe-inline' 'unsafe-eval' data: blob:";
// The probe logs this line, so a check can tell that the browser's console reaches its log.
inline constexpr const char* kProbeConsoleLine = "page-check: console capture";

struct Box {
  double x = 0, y = 0, w = 0, h = 0;  // CSS pixels from the document's top left
  // Whether the screenshot pixel (px, py) touches the box.
  bool touches(int px, int py) const {
    return px + 1 >= x && px <= x + w && py + 1 >= y && py <= y + h;
  }
  // Whether `b` lies inside, give or take a pixel of rounding.
  bool contains(const Box& b) const {
    return b.x >= x - 1 && b.y >= y - 1 && b.x + b.w <= x + w + 1 && b.y + b.h <= y + h + 1;
  }
  // Whether the two overlap by more than a pixel each way (the boxes of adjacent lines of text
  // may touch).
  bool overlaps(const Box& b) const {
    return std::min(x + w, b.x + b.w) - std::max(x, b.x) > 1 &&
           std::min(y + h, b.y + b.h) - std::max(y, b.y) > 1;
  }
};

struct Label {
  std::string text;
  Box box;
};

// A top-level <svg> or <canvas> element, with the <text> elements inside it.
struct Chart {
  std::string tag;
  Box box;
  std::vector<Label> labels;
};

struct ProbeReport {
  bool reported = false;  // the script ran to the end
  int width = 0, height = 0;
  std::vector<Chart> charts;
  std::vector<std::string> blocked;  // "directive URI" of each load the policy blocked
  bool canary_blocked = false;       // the probe's own blocked load was reported
};

// The page with the policy and the script inserted at the start of <head> (or of the document),
// before anything the page loads. The script measures `delay_ms` after the load event, so that
// charts drawn from load handlers and timers are in place.
std::string with_probe(const std::string& html, int delay_ms);

// What the script reported, from the DOM of the probed page (`chromium --dump-dom`).
ProbeReport read_probe(const std::string& dom);

}  // namespace mantissa::browser
