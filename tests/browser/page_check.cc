// Checks an HTML page that Mantissa writes in a real browser (headless Chromium, offline):
//   - the page is self-contained: no external URL in its source, and nothing blocked by a
//     Content-Security-Policy that allows inline code and data: URIs only;
//   - it loads without console messages (errors, uncaught exceptions, failed loads: the pages
//     Mantissa writes log nothing, so any message is a failure);
//   - its charts (top-level <svg> and <canvas> elements) are drawn: in a screenshot, each chart's
//     box holds enough mark pixels;
//   - an SVG chart's labels (<text>) lie inside the chart and do not overlap one another.
//
// Two browser runs. The first loads a copy of the page with a probe added (probe.h: the policy and
// a measuring script) and prints the DOM, which carries what the script found: the page's size,
// each chart's box and labels, and any blocked load. The second loads the page as written, with
// console logging, and takes a screenshot as tall as the page. Each run has a fresh profile, and
// every host name resolves to nothing, so no run can reach the network whatever the page does.
//
// Usage: page_check --chromium PATH --page FILE --charts N --work DIR
// Exit status 0 when every check passes, 1 when one fails (each failure on its own line), 2 on
// bad usage.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "browser/marks.h"
#include "browser/png.h"
#include "browser/probe.h"
#include "browser/process.h"

namespace fs = std::filesystem;
using namespace mantissa::browser;

namespace {

// The viewport width of both runs; the screenshot's height is the page's, up to the limit.
constexpr int kWindowWidth = 1280;
constexpr int kMaxScreenshotHeight = 16384;
// Virtual time the page gets to run its scripts and timers before the DOM or the screenshot is
// taken (headless Chromium fast-forwards idle time, so this costs little wall time).
constexpr int kVirtualTimeMs = 2000;
constexpr double kBrowserTimeoutSeconds = 120;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + p.string());
}

std::string excerpt(const std::string& s, size_t at, size_t n = 80) {
  std::string e = s.substr(at, n);
  std::replace(e.begin(), e.end(), '\n', ' ');
  return e;
}

// External references in the source. Namespace names (xmlns="http://www.w3.org/2000/svg") are
// identifiers that are never fetched, so they are removed first; any other URL with a scheme, a
// protocol-relative URL in an attribute or CSS, or an @import is reported.
std::vector<std::string> external_references(const std::string& html) {
  const std::string text = std::regex_replace(
      html, std::regex(R"(xmlns(:[A-Za-z]+)?\s*=\s*("[^"]*"|'[^']*'))", std::regex::icase), "");
  std::vector<std::string> found;
  const std::regex patterns[] = {
      std::regex(R"([A-Za-z][A-Za-z0-9+.-]*://)"),
      std::regex(R"(((src|href|srcset|poster|action|data)\s*=\s*["']?|url\(\s*["']?)\s*//)",
                 std::regex::icase),
      std::regex(R"(@import)", std::regex::icase),
  };
  for (const std::regex& re : patterns)
    for (auto it = std::sregex_iterator(text.begin(), text.end(), re);
         it != std::sregex_iterator() && found.size() < 10; ++it)
      found.push_back(excerpt(text, static_cast<size_t>(it->position()), 100));
  return found;
}

struct Browser {
  std::string chromium;
  fs::path work;
  int runs = 0;

  // Loads `page` with the given extra flags; returns the run's standard output and error.
  std::pair<std::string, std::string> run(const fs::path& page, int height,
                                          const std::vector<std::string>& flags) {
    const std::string name = "run" + std::to_string(++runs);
    const fs::path profile = work / (name + "-profile");
    fs::remove_all(profile);
    fs::create_directories(profile);
    std::vector<std::string> argv = {
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--user-data-dir=" + profile.string(),
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        "--virtual-time-budget=" + std::to_string(kVirtualTimeMs),
        "--window-size=" + std::to_string(kWindowWidth) + "," + std::to_string(height)};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("file://" + fs::absolute(page).string());
    const fs::path out = work / (name + ".stdout"), err = work / (name + ".stderr");
    const ProcessResult r = run_process(argv, out, err, profile, kBrowserTimeoutSeconds);
    fs::remove_all(profile);
    std::string stderr_text = read_file(err);
    if (r.timed_out)
      throw std::runtime_error("chromium did not finish within " +
                               std::to_string(int(kBrowserTimeoutSeconds)) + " s (" + err.string() +
                               ")");
    if (r.exit_code != 0)
      throw std::runtime_error("chromium exited with status " + std::to_string(r.exit_code) +
                               ":\n" + stderr_text);
    return {read_file(out), stderr_text};
  }
};

// Console messages in Chromium's log (`--enable-logging=stderr --v=0`), as `"text", source: ...`.
std::vector<std::string> console_messages(const std::string& log) {
  std::vector<std::string> messages;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    const size_t tag = line.find(":INFO:CONSOLE");
    if (tag == std::string::npos) continue;
    const size_t text = line.find("] ", tag);
    messages.push_back(text == std::string::npos ? line : line.substr(text + 2));
  }
  return messages;
}

struct Options {
  std::string chromium, page, work;
  int charts = -1;
};

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--chromium")
      o.chromium = value;
    else if (flag == "--page")
      o.page = value;
    else if (flag == "--work")
      o.work = value;
    else if (flag == "--charts")
      o.charts = std::atoi(value.c_str());
    else
      throw std::invalid_argument("unknown option " + flag);
  }
  if (argc % 2 == 0 || o.chromium.empty() || o.page.empty() || o.work.empty() || o.charts < 0)
    throw std::invalid_argument(
        "usage: page_check --chromium PATH --page FILE --charts N --work DIR");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  try {
    opt = parse_options(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 2;
  }
  std::vector<std::string> failures;
  auto fail = [&](const std::string& what) { failures.push_back(what); };
  try {
    const fs::path page = fs::absolute(opt.page), work = fs::absolute(opt.work);
    fs::create_directories(work);
    const std::string html = read_file(page);
    std::cout << "page check: " << page.string() << " (" << html.size() << " bytes)\n";

    for (const std::string& ref : external_references(html))
      fail("external reference in the source: ..." + ref + "...");

    Browser browser{opt.chromium, work};
    // Run 1: the probed copy, beside the page (so relative loads resolve as the page's own
    // would), its DOM printed.
    const fs::path copy = page.parent_path() / (page.stem().string() + ".page-check.html");
    write_file(copy, with_probe(html, kVirtualTimeMs / 4));
    const auto [dom, log1] =
        browser.run(copy, 900, {"--enable-logging=stderr", "--v=0", "--dump-dom"});
    fs::remove(copy);
    write_file(work / "dom.html", dom);
    const ProbeReport m = read_probe(dom);
    if (!m.reported)
      throw std::runtime_error("the measuring script reported nothing (see " +
                               (work / "dom.html").string() + ")");
    bool console_canary = false;
    for (const std::string& msg : console_messages(log1))
      console_canary = console_canary || msg.find(kProbeConsoleLine) != std::string::npos;
    if (!console_canary)
      throw std::runtime_error(
          "this chromium does not print console messages as INFO:CONSOLE lines; the console "
          "check would see nothing");
    if (!m.canary_blocked)
      throw std::runtime_error(
          "this chromium does not report loads blocked by a Content-Security-Policy; the "
          "network check would see nothing");
    for (const std::string& b : m.blocked)
      fail("the page loads something that is not inline or a data: URI (blocked: " + b + ")");
    std::cout << "  page " << m.width << "x" << m.height << " CSS px, " << m.charts.size()
              << " charts, blocked loads: " << m.blocked.size() << "\n";
    if (static_cast<int>(m.charts.size()) < opt.charts)
      fail("expected at least " + std::to_string(opt.charts) + " charts, found " +
           std::to_string(m.charts.size()));

    // Run 2: the page as written.
    const fs::path shot = work / "screenshot.png";
    fs::remove(shot);
    const int height = std::clamp(m.height, 1, kMaxScreenshotHeight);
    const auto [out2, log2] = browser.run(
        page, height, {"--enable-logging=stderr", "--v=0", "--screenshot=" + shot.string()});
    for (const std::string& msg : console_messages(log2)) fail("console: " + msg);
    const Image img = decode_png(read_file(shot));
    const Rgb background = most_common_colour(img);
    std::cout << "  screenshot " << img.width << "x" << img.height << " (" << shot.string()
              << "), background rgb(" << int(background.r) << "," << int(background.g) << ","
              << int(background.b) << ")\n";
    for (size_t i = 0; i < m.charts.size(); ++i) {
      const Chart& c = m.charts[i];
      const int x0 = static_cast<int>(std::ceil(c.box.x));
      const int y0 = static_cast<int>(std::ceil(c.box.y));
      const int x1 = static_cast<int>(std::floor(c.box.x + c.box.w));
      const int y1 = static_cast<int>(std::floor(c.box.y + c.box.h));
      std::ostringstream name;
      name << "chart " << i + 1 << " (<" << c.tag << "> " << x1 - x0 << "x" << y1 - y0 << " at "
           << x0 << "," << y0 << ")";
      if (x1 - x0 < 8 || y1 - y0 < 8) {
        fail(name.str() + " is too small to show anything");
        continue;
      }
      if (x0 < 0 || y0 < 0 || x1 > img.width || y1 > img.height) {
        fail(name.str() + " lies outside the " + std::to_string(img.width) + "x" +
             std::to_string(img.height) + " screenshot");
        continue;
      }
      for (size_t a = 0; a < c.labels.size(); ++a) {
        if (!c.box.contains(c.labels[a].box))
          fail(name.str() + ": label '" + c.labels[a].text + "' is cut off by the chart's edge");
        for (size_t b = a + 1; b < c.labels.size(); ++b)
          if (c.labels[a].box.overlaps(c.labels[b].box))
            fail(name.str() + ": labels '" + c.labels[a].text + "' and '" + c.labels[b].text +
                 "' overlap");
      }
      const long marks = mark_pixels(img, background, x0, y0, x1, y1, c.labels);
      const double fraction = double(marks) / (double(x1 - x0) * double(y1 - y0));
      std::cout << "  " << name.str() << ": " << marks << " mark pixels, "
                << std::lround(1000 * fraction) / 10.0 << "% of its box\n";
      if (marks < kMinMarkPixels || fraction < kMinMarkFraction)
        fail(name.str() + " looks blank: " + std::to_string(marks) +
             " mark pixels (wanted at least " + std::to_string(kMinMarkPixels) + " and " +
             std::to_string(kMinMarkFraction * 100).substr(0, 3) + "% of the box)");
    }
  } catch (const std::exception& e) {
    fail(e.what());
  }
  for (const std::string& f : failures) std::cout << "FAILED: " << f << "\n";
  std::cout << (failures.empty() ? "ok\n" : "page check failed\n");
  return failures.empty() ? 0 : 1;
}
