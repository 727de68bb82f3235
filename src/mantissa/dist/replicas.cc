#include "mantissa/dist/replicas.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "mantissa/core/error.h"

namespace mantissa::dist {

void broadcast_tensors(comm::Communicator& comm, const std::vector<NamedTensor>& tensors,
                       int root) {
  constexpr size_t kPackBytes = size_t{64} << 20;
  std::vector<uint8_t> pack;
  std::vector<Tensor*> packed;  // the tensors in `pack`, in order
  auto flush = [&] {
    if (pack.empty()) return;
    comm.broadcast(pack.data(), pack.size(), DType::u8, root);
    size_t at = 0;
    for (Tensor* t : packed) {
      if (comm.rank() != root) {
        Tensor src = Tensor::empty(t->shape(), t->dtype());
        std::memcpy(src.data_ptr(), pack.data() + at, t->nbytes());
        t->copy_from(src);
      }
      at += t->nbytes();
    }
    pack.clear();
    packed.clear();
  };
  for (const NamedTensor& nt : tensors) {
    MANTISSA_CHECK(nt.tensor && nt.tensor->defined(),
                   "broadcast_tensors: '" + nt.name + "' is undefined",
                   "pass the model's parameters and buffers after it is built");
    Tensor& t = *nt.tensor;
    if (!pack.empty() && pack.size() + t.nbytes() > kPackBytes) flush();
    const Tensor c = t.contiguous();
    const auto* bytes = static_cast<const uint8_t*>(c.data_ptr());
    pack.insert(pack.end(), bytes, bytes + c.nbytes());
    packed.push_back(&t);
    if (pack.size() >= kPackBytes) flush();
  }
  flush();
}

namespace {

uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ull;

uint64_t hash_tensor(const Tensor* t) {
  uint64_t h = kFnvBasis;
  if (!t || !t->defined()) return fnv1a(h, "undefined", 9);
  const uint8_t id = static_cast<uint8_t>(t->dtype());
  h = fnv1a(h, &id, 1);
  h = fnv1a(h, t->shape().data(), t->shape().size() * sizeof(int64_t));
  const Tensor c = t->contiguous();
  return fnv1a(h, c.data_ptr(), c.nbytes());
}

}  // namespace

uint64_t digest(const void* data, size_t n) { return fnv1a(kFnvBasis, data, n); }

std::string replica_mismatch(comm::Communicator& comm, const std::vector<NamedTensor>& tensors) {
  const size_t n = tensors.size(), ranks = static_cast<size_t>(comm.size());
  std::vector<int64_t> mine(n), all(n * ranks);
  for (size_t i = 0; i < n; ++i) mine[i] = static_cast<int64_t>(hash_tensor(tensors[i].tensor));
  comm.all_gather(mine.data(), all.data(), n, DType::i64);
  for (size_t i = 0; i < n; ++i) {
    std::string ranks_differing;
    for (size_t r = 1; r < ranks; ++r)
      if (all[r * n + i] != all[i])
        ranks_differing += (ranks_differing.empty() ? "" : ", ") + std::to_string(r);
    if (!ranks_differing.empty())
      return tensors[i].name + " differs from rank 0's on rank" +
             (ranks_differing.find(',') == std::string::npos ? " " : "s ") + ranks_differing;
  }
  return "";
}

}  // namespace mantissa::dist
