#include "mantissa/dist/agreement.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "mantissa/core/error.h"

namespace mantissa::dist {

namespace {

// Fields as bytes: for each, the name's and the value's length (8 bytes each) and their text.
std::vector<uint8_t> serialize(const ConfigFields& fields) {
  std::vector<uint8_t> out;
  auto put = [&out](const std::string& s) {
    const uint64_t n = s.size();
    const auto* p = reinterpret_cast<const uint8_t*>(&n);
    out.insert(out.end(), p, p + sizeof n);
    out.insert(out.end(), s.begin(), s.end());
  };
  for (const auto& [name, value] : fields) put(name), put(value);
  return out;
}

ConfigFields deserialize(const uint8_t* data, size_t bytes) {
  ConfigFields fields;
  size_t at = 0;
  auto get = [&](std::string& s) {
    uint64_t n = 0;
    MANTISSA_ASSERT(at + sizeof n <= bytes, "a truncated configuration from another rank");
    std::memcpy(&n, data + at, sizeof n);
    at += sizeof n;
    MANTISSA_ASSERT(n <= bytes - at, "a truncated configuration from another rank");
    s.assign(reinterpret_cast<const char*>(data + at), n);
    at += n;
  };
  while (at < bytes) {
    std::pair<std::string, std::string> f;
    get(f.first);
    get(f.second);
    fields.push_back(std::move(f));
  }
  return fields;
}

}  // namespace

void check_config_agreement(comm::Communicator& comm, const ConfigFields& fields,
                            const std::string& what, const std::string& hint) {
  const std::vector<uint8_t> mine = serialize(fields);
  const size_t n = static_cast<size_t>(comm.size());
  std::vector<int64_t> lengths(n);
  const int64_t my_length = static_cast<int64_t>(mine.size());
  comm.all_gather(&my_length, lengths.data(), 1, DType::i64);
  int64_t longest = 0;
  for (int64_t l : lengths) longest = std::max(longest, l);
  const size_t stride = static_cast<size_t>(longest);
  std::vector<uint8_t> padded(stride, 0), all(stride * n, 0);
  std::copy(mine.begin(), mine.end(), padded.begin());
  comm.all_gather(padded.data(), all.data(), stride, DType::u8);

  const ConfigFields first = deserialize(all.data(), static_cast<size_t>(lengths[0]));
  const std::string advice =
      !hint.empty() ? hint
                    : "start every rank with the same program and flags (mpirun runs one command "
                      "line on every rank; check per-host environment and files)";
  for (size_t r = 1; r < n; ++r) {
    const ConfigFields other =
        deserialize(all.data() + r * stride, static_cast<size_t>(lengths[r]));
    const std::string rank = std::to_string(r);
    for (size_t i = 0; i < std::max(first.size(), other.size()); ++i) {
      if (i >= first.size())
        throw Error("ranks disagree on the " + what + ": rank " + rank + " has '" + other[i].first +
                        "', which rank 0 does not",
                    advice);
      if (i >= other.size())
        throw Error("ranks disagree on the " + what + ": rank 0 has '" + first[i].first +
                        "', which rank " + rank + " does not",
                    advice);
      if (first[i].first != other[i].first)
        throw Error("ranks disagree on the " + what + ": field " + std::to_string(i + 1) + " is '" +
                        first[i].first + "' on rank 0 but '" + other[i].first + "' on rank " + rank,
                    advice);
      if (first[i].second != other[i].second)
        throw Error("ranks disagree on the " + what + ": '" + first[i].first + "' is '" +
                        first[i].second + "' on rank 0 but '" + other[i].second + "' on rank " +
                        rank,
                    advice);
    }
  }
}

bool found_inf_on_any_rank(comm::Communicator& comm, bool found_here) {
  uint8_t flag = found_here ? 1 : 0;
  comm.all_reduce(&flag, 1, DType::u8, comm::ReduceOp::kMax);
  return flag != 0;
}

double global_norm(comm::Communicator& comm, double sum_of_squares_here) {
  double total = sum_of_squares_here;
  comm.all_reduce(&total, 1, DType::f64, comm::ReduceOp::kSum);
  return std::sqrt(total);
}

}  // namespace mantissa::dist
