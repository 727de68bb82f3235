#include "mantissa/comm/mpi_communicator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mantissa/comm/half_reduce.h"
#include "mantissa/core/error.h"

// The C API only (Open MPI 4.1 may still declare the removed C++ bindings).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

namespace mantissa::comm {

namespace {

std::string mpi_error(int code, const std::string& call) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  return "comm: " + call +
         " failed: " + (len > 0 ? std::string(text, len) : "MPI error " + std::to_string(code));
}

void check_mpi(int code, const char* call) {
  if (code != MPI_SUCCESS)
    throw Error(mpi_error(code, call), "check the MPI installation and the launch (mpirun)");
}

// The MPI_User_function of a 16-bit reduction. Open MPI calls it on the communication thread
// (inside MPI_Testsome), with `len` elements of the 2-byte datatype.
template <DType D, ReduceOp O>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  reduce_16bit(O, D, in, inout, static_cast<size_t>(*len));
}

struct Topology {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
};

// The thread that makes every MPI call, and its queue.
class CommThread {
 public:
  // Starts the thread and waits until it has initialised MPI; throws Error if it could not.
  CommThread();
  // Finishes the queued and running collectives, releases MPI's objects, MPI_Finalize.
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  const Topology& topology() const { return topology_; }
  // The threads blocked waiting for one of this thread's collectives (detail::RequestState).
  const std::shared_ptr<std::atomic<int>>& blocked() const { return blocked_; }
  void enqueue(Collective c, std::shared_ptr<detail::RequestState> state);
  // The thread ends the job with MPI_Abort at its next poll.
  void request_abort(int exit_code);

 private:
  struct Job {
    Collective c;
    std::shared_ptr<detail::RequestState> state;
  };

  void run();
  void initialise();
  void start_job(Job job);
  void poll();
  void release();
  MPI_Datatype datatype(DType dtype) const;
  MPI_Op operation(ReduceOp op, DType dtype) const;

  // Shared between the caller threads and the communication thread, under mutex_.
  std::mutex mutex_;
  std::condition_variable work_cv_;   // queue_, stopping_ or abort_code_ changed
  std::condition_variable ready_cv_;  // initialised_ set
  std::deque<Job> queue_;
  bool stopping_ = false;
  int abort_code_ = -1;
  bool initialised_ = false;
  std::string init_error_;

  // Written by the thread before initialised_ is set; read-only afterwards.
  Topology topology_;

  // The communication thread's own.
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Datatype half_types_[2] = {MPI_DATATYPE_NULL, MPI_DATATYPE_NULL};  // f16, bf16
  MPI_Op half_ops_[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL},
                            {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};  // [type][ReduceOp]
  bool mpi_initialised_ = false;
  // Running collectives, in the order they were started: requests_[i] belongs to running_[i].
  std::vector<MPI_Request> requests_;
  std::vector<Job> running_;
  std::vector<int> done_;  // MPI_Testsome's outputs, kept between polls
  std::vector<MPI_Status> statuses_;
  int idle_polls_ = 0;  // polls in a row that finished nothing (the back-off's step)
  std::shared_ptr<std::atomic<int>> blocked_ = std::make_shared<std::atomic<int>>(0);

  std::thread thread_;  // last: started once everything above exists
};

CommThread::CommThread() : thread_([this] { run(); }) {
  std::unique_lock<std::mutex> lock(mutex_);
  ready_cv_.wait(lock, [this] { return initialised_; });
  if (!init_error_.empty()) {
    const std::string error = init_error_;
    lock.unlock();
    thread_.join();
    throw Error(error, "check the MPI installation and the launch (mpirun)");
  }
}

CommThread::~CommThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

void CommThread::enqueue(Collective c, std::shared_ptr<detail::RequestState> state) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    MANTISSA_ASSERT(!stopping_, "a collective started while the communicator shuts down");
    queue_.push_back({std::move(c), std::move(state)});
  }
  work_cv_.notify_one();
}

void CommThread::request_abort(int exit_code) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abort_code_ < 0) abort_code_ = exit_code;
  }
  work_cv_.notify_one();
}

void CommThread::initialise() {
  int provided = MPI_THREAD_SINGLE;
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  mpi_initialised_ = true;
  if (provided < MPI_THREAD_FUNNELED)
    throw Error("comm: MPI provides thread level " + std::to_string(provided) +
                    ", below MPI_THREAD_FUNNELED (" + std::to_string(MPI_THREAD_FUNNELED) +
                    "), which the communication thread needs",
                "use an MPI library built with thread support (Debian's Open MPI has it)");
  // Errors are returned, not fatal, on the world communicator too: Open MPI reports some errors
  // of requests (a non-blocking collective's sub-request) through MPI_COMM_WORLD's handler, whose
  // default aborts inside MPI before Mantissa can name the problem.
  check_mpi(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  // Mantissa's own communicator: its collectives never mix with a user's on MPI_COMM_WORLD.
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(comm_, &topology_.rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &topology_.size), "MPI_Comm_size");
  MPI_Comm local = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, topology_.rank, MPI_INFO_NULL, &local),
            "MPI_Comm_split_type");
  check_mpi(MPI_Comm_rank(local, &topology_.local_rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(local, &topology_.local_size), "MPI_Comm_size");
  check_mpi(MPI_Comm_free(&local), "MPI_Comm_free");
  for (MPI_Datatype& t : half_types_) {
    check_mpi(MPI_Type_contiguous(2, MPI_BYTE, &t), "MPI_Type_contiguous");
    check_mpi(MPI_Type_commit(&t), "MPI_Type_commit");
  }
  // Commutative (1): the transport may combine the ranks in any order.
  check_mpi(MPI_Op_create(&half_op<DType::f16, ReduceOp::kSum>, 1, &half_ops_[0][0]),
            "MPI_Op_create");
  check_mpi(MPI_Op_create(&half_op<DType::f16, ReduceOp::kMax>, 1, &half_ops_[0][1]),
            "MPI_Op_create");
  check_mpi(MPI_Op_create(&half_op<DType::f16, ReduceOp::kMin>, 1, &half_ops_[0][2]),
            "MPI_Op_create");
  check_mpi(MPI_Op_create(&half_op<DType::bf16, ReduceOp::kSum>, 1, &half_ops_[1][0]),
            "MPI_Op_create");
  check_mpi(MPI_Op_create(&half_op<DType::bf16, ReduceOp::kMax>, 1, &half_ops_[1][1]),
            "MPI_Op_create");
  check_mpi(MPI_Op_create(&half_op<DType::bf16, ReduceOp::kMin>, 1, &half_ops_[1][2]),
            "MPI_Op_create");
}

void CommThread::release() {
  for (auto& ops : half_ops_)
    for (MPI_Op& op : ops)
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
  for (MPI_Datatype& t : half_types_)
    if (t != MPI_DATATYPE_NULL) MPI_Type_free(&t);
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  if (mpi_initialised_) MPI_Finalize();
}

void CommThread::run() {
  try {
    initialise();
  } catch (const Error& e) {
    release();
    std::lock_guard<std::mutex> lock(mutex_);
    init_error_ = e.message();
    initialised_ = true;
    ready_cv_.notify_all();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    initialised_ = true;
  }
  ready_cv_.notify_all();

  std::vector<Job> jobs;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // Nothing running: sleep until there is work. Collectives running: only look.
      if (running_.empty())
        work_cv_.wait(lock, [this] { return !queue_.empty() || stopping_ || abort_code_ >= 0; });
      if (abort_code_ >= 0) {
        const int code = abort_code_;
        lock.unlock();
        std::fflush(nullptr);
        MPI_Abort(MPI_COMM_WORLD, code);
        std::_Exit(code);  // MPI_Abort does not return; should it, the runtime ends the others
      }
      for (Job& job : queue_) jobs.push_back(std::move(job));
      queue_.clear();
      if (jobs.empty() && running_.empty() && stopping_) break;
    }
    for (Job& job : jobs) start_job(std::move(job));
    jobs.clear();
    if (!running_.empty()) poll();
  }
  release();
}

MPI_Datatype CommThread::datatype(DType dtype) const {
  switch (dtype) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::f16:
      return half_types_[0];
    case DType::bf16:
      return half_types_[1];
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
    default:
      MANTISSA_ASSERT(false, "a collective of an unsupported dtype reached the MPI backend");
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op CommThread::operation(ReduceOp op, DType dtype) const {
  if (dtype == DType::f16 || dtype == DType::bf16)
    return half_ops_[dtype == DType::f16 ? 0 : 1][static_cast<int>(op)];
  switch (op) {
    case ReduceOp::kSum:
      return MPI_SUM;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kMin:
      return MPI_MIN;
  }
  return MPI_OP_NULL;
}

void CommThread::start_job(Job job) {
  const Collective& c = job.c;
  job.state->start();
  MPI_Request request = MPI_REQUEST_NULL;
  int rc = MPI_SUCCESS;
  const char* call = "";
  if (c.kind == Collective::Kind::kBarrier) {
    call = "MPI_Ibarrier";
    rc = MPI_Ibarrier(comm_, &request);
  } else {
    const MPI_Datatype type = datatype(c.dtype);
    const int count = static_cast<int>(c.count);  // Communicator checked the range
    switch (c.kind) {
      case Collective::Kind::kAllReduce:
        call = "MPI_Iallreduce";
        rc = MPI_Iallreduce(MPI_IN_PLACE, c.recv, count, type, operation(c.op, c.dtype), comm_,
                            &request);
        break;
      case Collective::Kind::kReduceScatter:
        call = "MPI_Ireduce_scatter_block";
        rc = MPI_Ireduce_scatter_block(c.send, c.recv, count, type, operation(c.op, c.dtype), comm_,
                                       &request);
        break;
      case Collective::Kind::kAllGather: {
        call = "MPI_Iallgather";
        const char* mine = static_cast<const char*>(c.recv) +
                           static_cast<size_t>(topology_.rank) * c.count * dtype_size(c.dtype);
        rc = MPI_Iallgather(c.send == mine ? MPI_IN_PLACE : c.send, count, type, c.recv, count,
                            type, comm_, &request);
        break;
      }
      case Collective::Kind::kBroadcast:
        call = "MPI_Ibcast";
        rc = MPI_Ibcast(c.recv, count, type, c.root, comm_, &request);
        break;
      case Collective::Kind::kBarrier:
        break;
    }
  }
  if (rc != MPI_SUCCESS) {
    job.state->complete(mpi_error(rc, call));
    return;
  }
  requests_.push_back(request);
  running_.push_back(std::move(job));
}

void CommThread::poll() {
  const int n = static_cast<int>(requests_.size());
  done_.resize(requests_.size());
  statuses_.resize(requests_.size());
  std::vector<int>& done = done_;
  std::vector<MPI_Status>& statuses = statuses_;
  int count = 0;
  const int rc = MPI_Testsome(n, requests_.data(), &count, done.data(), statuses.data());
  if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
    // The call itself failed: no request can be trusted to finish.
    for (Job& job : running_) job.state->complete(mpi_error(rc, "MPI_Testsome"));
    running_.clear();
    requests_.clear();
    return;
  }
  if (count == 0 || count == MPI_UNDEFINED) {
    // Nothing finished: let the rank's compute threads have the core. A few polls yield only
    // (a collective's next segment is often a few microseconds away); then the thread sleeps,
    // 10 us doubling to 160 us, so a rank whose collectives run during its backward pass does
    // not take half of a core that its compute thread needs (2 ranks on 2 cores). While a thread
    // is blocked waiting for a collective, nothing computes: the polls only yield, since MPI
    // moves a collective on only when polled (a large all-gather's rounds would each wait for
    // the next poll: 2.4 ms instead of 0.9 for fc1's 16 MiB on 2 ranks).
    ++idle_polls_;
    if (idle_polls_ <= 16 || blocked_->load(std::memory_order_relaxed) > 0)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(10 << std::min(idle_polls_ - 17, 4)));
    return;
  }
  idle_polls_ = 0;
  for (int k = 0; k < count; ++k) {
    const size_t i = static_cast<size_t>(done[static_cast<size_t>(k)]);
    const int error =
        rc == MPI_ERR_IN_STATUS ? statuses[static_cast<size_t>(k)].MPI_ERROR : MPI_SUCCESS;
    running_[i].state->complete(error == MPI_SUCCESS ? std::string()
                                                     : mpi_error(error, "a collective"));
    running_[i].state.reset();
    running_[i].c.keep_alive.reset();
  }
  // Drop the finished ones, keeping the order of the rest.
  size_t kept = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    if (!running_[i].state) continue;
    requests_[kept] = requests_[i];
    running_[kept] = std::move(running_[i]);
    ++kept;
  }
  requests_.resize(kept);
  running_.resize(kept);
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::unique_ptr<CommThread> thread)
      : Communicator(thread->topology().rank, thread->topology().size,
                     thread->topology().local_rank, thread->topology().local_size),
        thread_(std::move(thread)) {}
  std::string_view backend() const override { return "mpi"; }

  [[noreturn]] void abort(int exit_code) override {
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
    thread_->request_abort(exit_code);
    std::this_thread::sleep_for(std::chrono::seconds(10));
    std::_Exit(exit_code);
  }

 protected:
  Request start(Collective c) override {
    auto state = std::make_shared<detail::RequestState>(thread_->blocked());
    thread_->enqueue(std::move(c), state);
    return Request(std::move(state));
  }

 private:
  std::unique_ptr<CommThread> thread_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator() {
  return std::make_unique<MpiCommunicator>(std::make_unique<CommThread>());
}

}  // namespace mantissa::comm
