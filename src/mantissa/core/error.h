// Errors raised by the engine. Every message says what went wrong and, where there is one, how to
// fix it (the `hint`), so a user never has to read the source to act on an error.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

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

// An allocation that could not be made: one that would exceed the configured memory budget
// (over_budget(); what() holds the full report), or one the system refused. The program reports
// either with exit status 3.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
  OutOfMemoryError(const std::string& what, const std::string& hint, bool over_budget)
      : Error(what, hint), over_budget_(over_budget) {}
  bool over_budget() const { return over_budget_; }

 private:
  bool over_budget_ = false;
};

// A broken internal invariant: a bug in Mantissa, never the user's input. Deliberately not an
// Error, so that the program reports it as an internal error (exit status 1) with the place it
// was detected, instead of as bad input with a hint.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// `text` as an error message may quote it: non-printable bytes written as \xHH, and cut after
// `max_chars` characters with "... (N bytes)" marking the cut, so that a huge or binary token
// read from a file cannot flood or garble the terminal.
inline std::string excerpt(std::string_view text, size_t max_chars = 64) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (out.size() >= max_chars) return out + "... (" + std::to_string(text.size()) + " bytes)";
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

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
