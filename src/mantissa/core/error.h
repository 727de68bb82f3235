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

// A broken internal invariant: a bug in Mantissa, never the user's input. Deliberately not an
// Error, so that the program reports it as an internal error (exit status 1) with the place it
// was detected, instead of as bad input with a hint.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {
[[noreturn]] inline void internal_error(const char* file, int line, const char* cond,
                                        const std::string& msg) {
  throw InternalError(std::string(file) + ":" + std::to_string(line) + ": internal error: " + msg +
                      " (" + cond + " failed)");
}
}  // namespace detail

}  // namespace mantissa

// Checks a condition that depends on user input; throws mantissa::Error with a message and hint.
#define MANTISSA_CHECK(cond, msg, hint)                  \
  do {                                                   \
    if (!(cond)) throw ::mantissa::Error((msg), (hint)); \
  } while (0)

// Checks an internal invariant (always on: these are cheap and guard against silent garbage);
// throws mantissa::InternalError naming the file, line, condition and `msg`. For conditions that
// depend on what a user passed, use MANTISSA_CHECK.
#define MANTISSA_ASSERT(cond, msg)                                                     \
  do {                                                                                 \
    if (!(cond)) ::mantissa::detail::internal_error(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)
