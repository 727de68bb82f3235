// The commands' flag tables: a flag's name, whether it takes a value, and what to do with it;
// the parser every command shares, the flags that set a field of a configuration, and the
// refusal of several processes for the commands that run in one.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mantissa::cli {

struct Flag {
  bool takes_value;
  std::function<void(const std::string&)> apply;
};

// Applies each argument's flag ("--name value" or "--name=value"); throws UsageError naming an
// unknown flag (and `command`'s --help), a missing value or a value given to a switch.
void parse_flags(const std::vector<std::string>& args, const std::map<std::string, Flag>& flags,
                 const char* command);

// Flags that set a field: a string, an integer from min, a number, an optional number, a
// comma-separated list, a switch that stores `value`, or --threads. Each names itself (`name`)
// in its UsageError. An empty string or list is refused: it would leave the field at its default
// (an unset shell variable, --save "", saves nothing).
Flag str_flag(const char* name, std::string& dst);
Flag int_flag(const char* name, int64_t& dst, int64_t min);
Flag num_flag(const char* name, double& dst);
Flag opt_num_flag(const char* name, std::optional<double>& dst);
Flag list_flag(const char* name, std::vector<std::string>& dst);
Flag switch_flag(bool& dst, bool value = true);
Flag threads_flag(int& dst);

// A command that runs in one process, refused (UsageError saying `fix`) when an MPI launcher
// started several.
void refuse_ranks(const char* command, const char* fix);

}  // namespace mantissa::cli
