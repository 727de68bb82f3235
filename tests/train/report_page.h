// Reading a training report page back in tests: the data it embeds (report_html.h).
#pragma once

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

namespace mantissa::testing {

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

// The JSON in the page's <script type="application/json" id="metrics"> (null when absent).
inline nlohmann::json report_data(const std::string& page) {
  const std::string open = "<script type=\"application/json\" id=\"metrics\">";
  const size_t at = page.find(open);
  if (at == std::string::npos) return nullptr;
  const size_t from = at + open.size(), to = page.find("</script>", from);
  return nlohmann::json::parse(page.substr(from, to - from));
}

}  // namespace mantissa::testing
