// What a collective operation is, as comm::Communicator hands it to a backend: the kind, the
// buffers, the element type and the reduction. Nothing here names a transport (MPI, NCCL), so a
// backend can be added behind the interface without changing its callers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "mantissa/core/dtype.h"

namespace mantissa::comm {

// How all_reduce and reduce_scatter combine the ranks' values, element by element.
enum class ReduceOp : uint8_t { kSum, kMax, kMin };
std::string_view reduce_op_name(ReduceOp op);  // "sum", "max", "min"

// The element types collectives carry: f32, f64, f16, bf16, i32, i64, u8. The 16-bit floats are
// reduced in FP32 and rounded to nearest even after each combination (comm/half_reduce.h).
// Integer sums must stay within the type's range: beyond it the result is the transport's (Open
// MPI 4.1's AVX reduction saturates 8-bit sums in its vector loop and wraps them in its scalar
// tail, open-mpi/ompi#8045; 32- and 64-bit sums wrap).
bool is_supported_dtype(DType dtype);

struct Collective {
  enum class Kind : uint8_t { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kBarrier };
  Kind kind = Kind::kBarrier;
  // Buffer sizes in elements of `dtype`, with N the number of ranks:
  //   all_reduce:     recv (count), in place: every rank's recv ends up holding op over the ranks
  //   reduce_scatter: send (N * count) -> recv (count): rank r gets op over the ranks of part r
  //   all_gather:     send (count) -> recv (N * count): part r of recv is rank r's send; send
  //                   may be recv + rank * count (in place)
  //   broadcast:      recv (count), in place: every rank gets the root's values
  //   barrier:        no buffers
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  DType dtype = DType::u8;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  // Held by the backend until the operation has finished (the owner of the buffers, so a caller
  // that drops its Request does not free memory the transport still writes). May be empty.
  std::shared_ptr<const void> keep_alive;
};

}  // namespace mantissa::comm
