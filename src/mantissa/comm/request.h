// The handle of an asynchronous collective operation (comm::Communicator's *_async calls): wait()
// for it, or test() whether it has finished, while the calling thread does other work (the
// gradient all-reduces of a backward pass run while the pass computes the layers below).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

namespace mantissa::comm {

namespace detail {
class RequestState;
}

class Request {
 public:
  using Clock = std::chrono::steady_clock;

  // An empty handle: already complete (what a world of one process returns for most calls).
  Request() = default;
  explicit Request(std::shared_ptr<detail::RequestState> state) : state_(std::move(state)) {}

  // Blocks until the operation has finished; then its output buffers hold the result. Throws
  // mantissa::Error if the operation failed. Waiting again returns (or throws) at once.
  void wait();
  // Whether the operation has finished (never blocks); throws as wait() does if it failed.
  bool test();

  // When the backend started the operation and when it finished (both equal for an operation
  // done in the call). Valid once wait() or test() has said it finished.
  Clock::time_point started() const;
  Clock::time_point finished() const;

 private:
  std::shared_ptr<detail::RequestState> state_;
};

namespace detail {

// Shared by a Request and the backend that completes it. The backend calls start() when it hands
// the operation to the transport and complete() once, when the output buffers hold the result;
// complete() publishes them to the waiting thread (through the mutex).
class RequestState {
 public:
  RequestState() = default;
  // `blocked` counts the threads blocked in wait() on this operation (and on others sharing the
  // counter): a backend that progresses operations in the background polls without pausing
  // while a thread waits for one (nothing else then needs the core).
  explicit RequestState(std::shared_ptr<std::atomic<int>> blocked) : blocked_(std::move(blocked)) {}
  void start();
  // `error` empty: success; otherwise wait() throws it as a mantissa::Error.
  void complete(std::string error = {});
  // An operation done in the call: started and completed now.
  static std::shared_ptr<RequestState> done_now();

  void wait();
  bool test();
  Request::Clock::time_point started() const;
  Request::Clock::time_point finished() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::string error_;
  Request::Clock::time_point started_{}, finished_{};
  std::shared_ptr<std::atomic<int>> blocked_;
};

}  // namespace detail

}  // namespace mantissa::comm
