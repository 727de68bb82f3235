// The reduction of 16-bit floats for collectives. MPI has no half types (Open MPI 4.1 has neither
// FP16 nor BF16), so the MPI backend sends them as 2-byte elements and reduces them with this
// function, registered as a commutative user-defined operation (Horovod's design for FP16).
//
// Each combination widens both operands to FP32 (exactly), combines them in FP32 and rounds the
// result once to nearest even; a sum beyond the format's range becomes infinity. A reduction over N
// ranks therefore rounds N - 1 times, in the order the transport combines the ranks. NaN results
// are the canonical quiet NaN (f16 0x7e00, bf16 0x7fc0) whatever the operands' payloads, and
// max/min order +0 above -0, so that the operation is commutative bit for bit and every rank gets
// the same bits in whichever order the transport pairs them. max and min return NaN if either
// operand is NaN (as torch.maximum does).
#pragma once

#include <cstddef>

#include "mantissa/comm/collective.h"
#include "mantissa/core/convert.h"

namespace mantissa::comm {

// inout[i] = op(in[i], inout[i]) for n values of `dtype` (f16 or bf16). The widening and
// rounding use the conversion kernels of `path` (AVX2/F16C or scalar: the same bits).
void reduce_16bit(ReduceOp op, DType dtype, const void* in, void* inout, size_t n, SimdPath path);
// The same on the engine's active path (active_simd_path()).
void reduce_16bit(ReduceOp op, DType dtype, const void* in, void* inout, size_t n);

}  // namespace mantissa::comm
