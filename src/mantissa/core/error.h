// Errors raised by the engine. Every message says what went wrong and, where there is one, how to
// fix it (the `hint`), so a user never has to read the source to act on an error.
#pragma once

#include <stdexcept>
#include <string>

namespace mantissa {

// Base of every error the engine throws on bad input or an impossible request.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, const std::string& hint = "")
      : std::runtime_error(hint.empty() ? what : what + "\n---> HINT: " + hint),
        message_(what),
        hint_(hint) {}
  const std::string& message() const { return message_; }
  const std::string& hint() const { return hint_; }

 private:
  std::string message_;
  std::string hint_;
};

// An allocation that would exceed the configured memory budget. what() holds the full report.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

}  // namespace mantissa

// Checks a condition that depends on user input; throws mantissa::Error with a message and hint.
#define MANTISSA_CHECK(cond, msg, hint)                  \
  do {                                                   \
    if (!(cond)) throw ::mantissa::Error((msg), (hint)); \
  } while (0)
