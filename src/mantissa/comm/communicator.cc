#include "mantissa/comm/communicator.h"

#include <climits>
#include <cstdlib>
#include <string>

#include "mantissa/core/error.h"
#if defined(MANTISSA_HAVE_MPI)
#include "mantissa/comm/mpi_communicator.h"
#endif

namespace mantissa::comm {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

bool is_supported_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32:
    case DType::f64:
    case DType::f16:
    case DType::bf16:
    case DType::i32:
    case DType::i64:
    case DType::u8:
      return true;
    default:
      return false;
  }
}

Communicator::Communicator(int rank, int size, int local_rank, int local_size)
    : rank_(rank), size_(size), local_rank_(local_rank), local_size_(local_size) {
  MANTISSA_ASSERT(size > 0 && rank >= 0 && rank < size, "communicator rank out of range");
  MANTISSA_ASSERT(local_size > 0 && local_rank >= 0 && local_rank < local_size,
                  "communicator local rank out of range");
}

namespace {

bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

}  // namespace

Request Communicator::checked_start(Collective c, const char* what) {
  using Kind = Collective::Kind;
  const std::string op = std::string("comm: ") + what;
  if (c.kind != Kind::kBarrier) {
    MANTISSA_CHECK(is_supported_dtype(c.dtype),
                   op + " of " + std::string(dtype_name(c.dtype)) + " values is not supported",
                   "collectives carry f32, f64, f16, bf16, i32, i64 and u8: convert first");
    // MPI counts are C ints; a buffer of 2^31 elements or more goes in several calls.
    const size_t parts = c.kind == Kind::kReduceScatter || c.kind == Kind::kAllGather
                             ? static_cast<size_t>(size_)
                             : 1;
    MANTISSA_CHECK(c.count <= static_cast<size_t>(INT_MAX) / parts,
                   op + " of " + std::to_string(c.count) + (parts > 1 ? " x " : "") +
                       (parts > 1 ? std::to_string(parts) : "") + " elements in one call",
                   "split the buffer into calls of at most 2^31 - 1 elements in all");
    MANTISSA_CHECK(c.count == 0 || (c.recv && (c.send || c.kind == Kind::kAllReduce ||
                                               c.kind == Kind::kBroadcast)),
                   op + " of " + std::to_string(c.count) + " elements with a null buffer",
                   "pass the buffers the operation reads and writes");
  }
  if (c.kind == Kind::kAllReduce || c.kind == Kind::kReduceScatter)
    MANTISSA_CHECK(c.op == ReduceOp::kSum || c.op == ReduceOp::kMax || c.op == ReduceOp::kMin,
                   op + " with an unknown reduction", "use ReduceOp::kSum, kMax or kMin");
  if (c.kind == Kind::kBroadcast)
    MANTISSA_CHECK(c.root >= 0 && c.root < size_,
                   op + " from rank " + std::to_string(c.root) + " in a job of " +
                       std::to_string(size_) + " ranks",
                   "the root is a rank in [0, size())");
  const size_t es = c.kind == Kind::kBarrier ? 0 : dtype_size(c.dtype);
  if (c.kind == Kind::kReduceScatter)
    MANTISSA_CHECK(!overlap(c.send, c.count * size_ * es, c.recv, c.count * es),
                   op + ": the send and receive buffers overlap",
                   "reduce into a separate buffer of count elements");
  if (c.kind == Kind::kAllGather) {
    const bool in_place =
        c.send == static_cast<const char*>(c.recv) + static_cast<size_t>(rank_) * c.count * es;
    MANTISSA_CHECK(in_place || !overlap(c.send, c.count * es, c.recv, c.count * size_ * es),
                   op + ": the send buffer overlaps the receive buffer but is not this rank's part",
                   "gather in place with send = recv + rank() * count, or use separate buffers");
  }
  return start(std::move(c));
}

void Communicator::all_reduce(void* data, size_t count, DType dtype, ReduceOp op) {
  all_reduce_async(data, count, dtype, op).wait();
}
void Communicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                  ReduceOp op) {
  reduce_scatter_async(send, recv, recv_count, dtype, op).wait();
}
void Communicator::all_gather(const void* send, void* recv, size_t send_count, DType dtype) {
  all_gather_async(send, recv, send_count, dtype).wait();
}
void Communicator::broadcast(void* data, size_t count, DType dtype, int root) {
  broadcast_async(data, count, dtype, root).wait();
}
void Communicator::barrier() { barrier_async().wait(); }

namespace {

Collective make(Collective::Kind kind, const void* send, void* recv, size_t count, DType dtype,
                std::shared_ptr<const void> keep_alive) {
  Collective c;
  c.kind = kind;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.dtype = dtype;
  c.keep_alive = std::move(keep_alive);
  return c;
}

}  // namespace

Request Communicator::all_reduce_async(void* data, size_t count, DType dtype, ReduceOp op,
                                       std::shared_ptr<const void> keep_alive) {
  Collective c =
      make(Collective::Kind::kAllReduce, nullptr, data, count, dtype, std::move(keep_alive));
  c.op = op;
  return checked_start(std::move(c), "all_reduce");
}

Request Communicator::reduce_scatter_async(const void* send, void* recv, size_t recv_count,
                                           DType dtype, ReduceOp op,
                                           std::shared_ptr<const void> keep_alive) {
  Collective c =
      make(Collective::Kind::kReduceScatter, send, recv, recv_count, dtype, std::move(keep_alive));
  c.op = op;
  return checked_start(std::move(c), "reduce_scatter");
}

Request Communicator::all_gather_async(const void* send, void* recv, size_t send_count, DType dtype,
                                       std::shared_ptr<const void> keep_alive) {
  return checked_start(
      make(Collective::Kind::kAllGather, send, recv, send_count, dtype, std::move(keep_alive)),
      "all_gather");
}

Request Communicator::broadcast_async(void* data, size_t count, DType dtype, int root,
                                      std::shared_ptr<const void> keep_alive) {
  Collective c =
      make(Collective::Kind::kBroadcast, nullptr, data, count, dtype, std::move(keep_alive));
  c.root = root;
  return checked_start(std::move(c), "broadcast");
}

Request Communicator::barrier_async() {
  return checked_start(make(Collective::Kind::kBarrier, nullptr, nullptr, 0, DType::u8, {}),
                       "barrier");
}

namespace {

void check_tensor(const Tensor& t, const char* what, const char* role) {
  MANTISSA_CHECK(t.defined(), std::string("comm: ") + what + ": the " + role + " is undefined",
                 "pass a tensor");
  MANTISSA_CHECK(t.is_contiguous(),
                 std::string("comm: ") + what + ": the " + role + " " + shape_str(t.shape()) +
                     " is not contiguous",
                 "pass t.contiguous() and copy the result back, or a contiguous tensor");
}

// Keeps both tensors' storage alive while the operation runs.
std::shared_ptr<const void> keep(const Tensor& a, const Tensor& b) {
  return std::make_shared<std::pair<std::shared_ptr<Storage>, std::shared_ptr<Storage>>>(
      a.storage(), b.storage());
}

}  // namespace

Request Communicator::all_reduce_async(Tensor& t, ReduceOp op) {
  check_tensor(t, "all_reduce", "tensor");
  return all_reduce_async(t.data_ptr(), static_cast<size_t>(t.numel()), t.dtype(), op, t.storage());
}

Request Communicator::reduce_scatter_async(const Tensor& send, Tensor& recv, ReduceOp op) {
  check_tensor(send, "reduce_scatter", "send tensor");
  check_tensor(recv, "reduce_scatter", "receive tensor");
  MANTISSA_CHECK(send.dtype() == recv.dtype() && send.numel() == recv.numel() * size_,
                 "comm: reduce_scatter from " + std::string(dtype_name(send.dtype())) + " " +
                     shape_str(send.shape()) + " into " + std::string(dtype_name(recv.dtype())) +
                     " " + shape_str(recv.shape()) + " over " + std::to_string(size_) + " ranks",
                 "the send tensor holds size() times the receive tensor's elements, same dtype");
  return reduce_scatter_async(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(recv.numel()),
                              recv.dtype(), op, keep(send, recv));
}

Request Communicator::all_gather_async(const Tensor& send, Tensor& recv) {
  check_tensor(send, "all_gather", "send tensor");
  check_tensor(recv, "all_gather", "receive tensor");
  MANTISSA_CHECK(send.dtype() == recv.dtype() && recv.numel() == send.numel() * size_,
                 "comm: all_gather of " + std::string(dtype_name(send.dtype())) + " " +
                     shape_str(send.shape()) + " into " + std::string(dtype_name(recv.dtype())) +
                     " " + shape_str(recv.shape()) + " over " + std::to_string(size_) + " ranks",
                 "the receive tensor holds size() times the send tensor's elements, same dtype");
  return all_gather_async(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(send.numel()),
                          send.dtype(), keep(send, recv));
}

Request Communicator::broadcast_async(Tensor& t, int root) {
  check_tensor(t, "broadcast", "tensor");
  return broadcast_async(t.data_ptr(), static_cast<size_t>(t.numel()), t.dtype(), root,
                         t.storage());
}

bool launched_by_mpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"})
    if (std::getenv(name)) return true;
  return false;
}

namespace {

std::unique_ptr<Communicator> make_world() {
  if (!launched_by_mpi()) return make_single_process();
#if defined(MANTISSA_HAVE_MPI)
  return make_mpi_communicator();
#else
  throw Error("this process was started by an MPI launcher, but Mantissa was built without MPI",
              "rebuild with -DMANTISSA_MPI=ON (Debian: libopenmpi-dev, openmpi-bin), or run "
              "without mpirun");
#endif
}

}  // namespace

Communicator& world() {
  static const std::unique_ptr<Communicator> w = make_world();
  return *w;
}

}  // namespace mantissa::comm
