// The message of the mantissa::Error a piece of code throws ("" if none): tests check that bad
// input is reported in words a user can act on.
#pragma once

#include <functional>
#include <string>

#include "mantissa/core/error.h"

namespace mantissa::testing {

inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace mantissa::testing
