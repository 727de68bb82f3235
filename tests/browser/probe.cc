#include "browser/probe.h"

#include <cctype>
#include <cmath>
#include <sstream>
#include <utility>

namespace mantissa::browser {
namespace {

// A load the policy blocks (the host name does not exist either): its report shows that blocked
// loads are seen.
constexpr const char* kCanaryUrl = "http://page-check.invalid/canary.png";

// The script reports into an attribute of <html>, one record a line: `page W H`; `chart TAG X Y W
// H`, then `text X Y W H LABEL` for each text element in that chart; `blocked DIRECTIVE URI`.
constexpr const char* kScript = R"(<script>
(() => {
  const lines = [];
  const publish = () => document.documentElement.setAttribute('data-page-check', lines.join('\n'));
  const box = (kind, el, label) => {
    const r = el.getBoundingClientRect();
    lines.push([kind, r.left + window.scrollX, r.top + window.scrollY, r.width, r.height, label]
                   .join(' '));
  };
  document.addEventListener('securitypolicyviolation', e => {
    lines.push('blocked ' + e.effectiveDirective + ' ' + e.blockedURI);
    publish();
  }, true);
  console.log('CONSOLE_LINE');
  new Image().src = 'CANARY_URL';
  window.addEventListener('load', () => setTimeout(() => {
    const d = document.documentElement;
    lines.push('page ' + d.scrollWidth + ' ' + d.scrollHeight);
    for (const el of document.querySelectorAll('svg, canvas')) {
      if (el.parentElement && el.parentElement.closest('svg')) continue;
      box('chart ' + el.tagName.toLowerCase(), el, '');
      for (const t of el.querySelectorAll('text')) box('text', t, t.textContent.replace(/\s+/g, ' '));
    }
    publish();
  }, DELAY_MS));
})();
</script>
)";

void replace_once(std::string& s, const std::string& from, const std::string& to) {
  s.replace(s.find(from), from.size(), to);
}

// Where a tag opens (case-insensitive `<name` followed by `>`, a space or `/`), or npos.
size_t find_tag(const std::string& html, const std::string& name) {
  std::string lower = html;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (size_t at = lower.find("<" + name); at != std::string::npos;
       at = lower.find("<" + name, at + 1)) {
    const char next = at + 1 + name.size() < lower.size() ? lower[at + 1 + name.size()] : '\0';
    if (next == '>' || next == '/' || std::isspace(static_cast<unsigned char>(next))) return at;
  }
  return std::string::npos;
}

// Chromium escapes &, ", <, > and the no-break space in attribute values.
std::string unescape_attribute(const std::string& s) {
  const std::pair<std::string, std::string> entities[] = {{"&amp;", "&"}, {"&quot;", "\""},
                                                          {"&lt;", "<"},  {"&gt;", ">"},
                                                          {"&#39;", "'"}, {"&nbsp;", " "}};
  std::string out;
  for (size_t at = 0; at < s.size();) {
    bool replaced = false;
    for (const auto& [from, to] : entities)
      if (s.compare(at, from.size(), from) == 0) {
        out += to;
        at += from.size();
        replaced = true;
        break;
      }
    if (!replaced) out += s[at++];
  }
  return out;
}

}  // namespace

std::string with_probe(const std::string& html, int delay_ms) {
  std::string script = kScript;
  replace_once(script, "CONSOLE_LINE", kProbeConsoleLine);
  replace_once(script, "CANARY_URL", kCanaryUrl);
  replace_once(script, "DELAY_MS", std::to_string(delay_ms));
  const std::string probe = std::string("<meta http-equiv=\"Content-Security-Policy\" content=\"") +
                            kSelfContainedPolicy + "\">\n" + script;
  size_t at = std::string::npos;
  for (const char* tag : {"head", "html", "!doctype"})
    if (const size_t open = find_tag(html, tag); open != std::string::npos) {
      at = html.find('>', open);
      at = at == std::string::npos ? html.size() : at + 1;
      break;
    }
  if (at == std::string::npos) at = 0;
  return html.substr(0, at) + probe + html.substr(at);
}

ProbeReport read_probe(const std::string& dom) {
  ProbeReport m;
  const std::string key = "data-page-check=\"";
  const size_t at = dom.find(key);
  if (at == std::string::npos) return m;
  const size_t end = dom.find('"', at + key.size());
  std::istringstream lines(unescape_attribute(dom.substr(at + key.size(), end - at - key.size())));
  for (std::string line; std::getline(lines, line);) {
    std::istringstream f(line);
    std::string kind;
    f >> kind;
    if (kind == "page") {
      double w = 0, h = 0;
      f >> w >> h;
      m.width = static_cast<int>(std::ceil(w));
      m.height = static_cast<int>(std::ceil(h));
      m.reported = true;
    } else if (kind == "chart") {
      Chart c;
      f >> c.tag >> c.box.x >> c.box.y >> c.box.w >> c.box.h;
      m.charts.push_back(c);
    } else if (kind == "text" && !m.charts.empty()) {
      Label l;
      f >> l.box.x >> l.box.y >> l.box.w >> l.box.h;
      std::getline(f >> std::ws, l.text);
      m.charts.back().labels.push_back(l);
    } else if (kind == "blocked") {
      std::string rest;
      std::getline(f >> std::ws, rest);
      if (rest.find(kCanaryUrl) != std::string::npos)
        m.canary_blocked = true;
      else
        m.blocked.push_back(rest);
    }
  }
  return m;
}

}  // namespace mantissa::browser
