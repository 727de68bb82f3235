#include "mantissa/comm/request.h"

#include "mantissa/core/error.h"

namespace mantissa::comm {

void Request::wait() {
  if (state_) state_->wait();
}

bool Request::test() { return !state_ || state_->test(); }

Request::Clock::time_point Request::started() const {
  return state_ ? state_->started() : Clock::time_point{};
}

Request::Clock::time_point Request::finished() const {
  return state_ ? state_->finished() : Clock::time_point{};
}

namespace detail {

namespace {
const char* const kFailedHint =
    "the other ranks wait for this collective: end the job (Communicator::abort) instead of going "
    "on without it";
}

void RequestState::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  started_ = Request::Clock::now();
}

void RequestState::complete(std::string error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    MANTISSA_ASSERT(!done_, "a communication request completed twice");
    finished_ = Request::Clock::now();
    if (started_ == Request::Clock::time_point{}) started_ = finished_;
    error_ = std::move(error);
    done_ = true;
  }
  done_cv_.notify_all();
}

std::shared_ptr<RequestState> RequestState::done_now() {
  auto s = std::make_shared<RequestState>();
  s->complete();
  return s;
}

void RequestState::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!done_) {
    if (blocked_) blocked_->fetch_add(1);
    done_cv_.wait(lock, [this] { return done_; });
    if (blocked_) blocked_->fetch_sub(1);
  }
  if (!error_.empty()) throw Error(error_, kFailedHint);
}

bool RequestState::test() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (done_ && !error_.empty()) throw Error(error_, kFailedHint);
  return done_;
}

Request::Clock::time_point RequestState::started() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return started_;
}

Request::Clock::time_point RequestState::finished() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_;
}

}  // namespace detail

}  // namespace mantissa::comm
