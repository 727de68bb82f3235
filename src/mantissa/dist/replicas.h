// Keeping the ranks' copies of a model identical: broadcasting parameters and buffers from one
// rank at start, and checking that every rank holds the same bits. Each function is a collective:
// every rank calls it with the same tensors (names, dtypes, shapes), in the same order as its other
// collectives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mantissa/comm/communicator.h"
#include "mantissa/nn/module.h"

namespace mantissa::dist {

using NamedTensor = nn::Module::NamedTensor;

// Copies `root`'s values of the tensors (any dtype, contiguous or not) into every other rank's,
// packed into byte buffers of at most 64 MiB per broadcast. PyTorch DDP does this at start with
// the parameters and buffers, so that ranks start from the same model whatever their seeds.
void broadcast_tensors(comm::Communicator& comm, const std::vector<NamedTensor>& tensors,
                       int root = 0);

// "" when every rank holds the same bits in every tensor; otherwise the first tensor (in order)
// that differs and the ranks that disagree with rank 0 ("fc1.weight differs from rank 0's on
// ranks 1, 2"). Each rank hashes its tensors (64-bit FNV-1a over dtype, shape and bytes) and the
// hashes are gathered; an undefined tensor hashes as such. For tests and checks, not every step.
std::string replica_mismatch(comm::Communicator& comm, const std::vector<NamedTensor>& tensors);

// The 64-bit FNV-1a digest of `n` bytes, as replica_mismatch hashes tensors: what ranks compare of
// a larger value they should hold alike (a checkpoint's losses).
uint64_t digest(const void* data, size_t n);

}  // namespace mantissa::dist
