#include "mantissa/flags.h"

#include <algorithm>

#include "mantissa/cli.h"
#include "mantissa/comm/communicator.h"
#include "mantissa/core/error.h"

namespace mantissa::cli {

void parse_flags(const std::vector<std::string>& args, const std::map<std::string, Flag>& flags,
                 const char* command) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i], value;
    const size_t eq = a.find('=');
    bool inline_value = false;
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      inline_value = true;
    }
    auto it = flags.find(a);
    if (it == flags.end())
      throw UsageError("unknown option '" + excerpt(a) + "' for 'mantissa " + command +
                       "'; run 'mantissa " + command + " --help' for the list");
    if (it->second.takes_value && !inline_value) {
      if (i + 1 >= args.size()) throw UsageError(a + " needs a value");
      value = args[++i];
    } else if (!it->second.takes_value && inline_value) {
      throw UsageError(a + " takes no value");
    }
    it->second.apply(value);
  }
}

// Flags that set a field: a string, an integer from min, a number, an optional number, a
// comma-separated list, or a switch that stores `value`. An empty string or list is refused: it
// would leave the field at its default (an unset shell variable, --save "", saves nothing).
Flag str_flag(const char* name, std::string& dst) {
  return Flag{true, [name, &dst](const std::string& v) {
                if (v.empty())
                  throw UsageError(std::string(name) + " needs a value (got an empty one)");
                dst = v;
              }};
}
Flag int_flag(const char* name, int64_t& dst, int64_t min) {
  return Flag{true, [name, &dst, min](const std::string& v) { dst = int_value(name, v, min); }};
}
Flag num_flag(const char* name, double& dst) {
  return Flag{true, [name, &dst](const std::string& v) { dst = number_value(name, v); }};
}
Flag opt_num_flag(const char* name, std::optional<double>& dst) {
  return Flag{true, [name, &dst](const std::string& v) { dst = number_value(name, v); }};
}
Flag list_flag(const char* name, std::vector<std::string>& dst) {
  return Flag{true, [name, &dst](const std::string& v) {
                const size_t before = dst.size();
                size_t b = 0;
                while (b <= v.size()) {
                  const size_t e = std::min(v.find(',', b), v.size());
                  if (e > b) dst.push_back(v.substr(b, e - b));
                  b = e + 1;
                }
                if (dst.size() == before)
                  throw UsageError(std::string(name) + " needs a comma-separated list (got '" +
                                   excerpt(v) + "')");
              }};
}
Flag switch_flag(bool& dst, bool value) {
  return Flag{false, [&dst, value](const std::string&) { dst = value; }};
}
Flag threads_flag(int& dst) {
  return Flag{true, [&dst](const std::string& v) { dst = threads_value(v); }};
}

void refuse_ranks(const char* command, const char* fix) {
  if (comm::launched_by_mpi() && comm::world().size() > 1)
    throw UsageError(std::string("'mantissa ") + command + "' does not run over " +
                     std::to_string(comm::world().size()) + " processes: " + fix);
}

}  // namespace mantissa::cli
