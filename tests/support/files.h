// Files for tests: a temporary directory removed at the end of its scope, and writers for the
// byte-level fixtures (IDX files, raw or gzip-compressed) that the dataset readers read back.
#pragma once

#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace mantissa::testing {

class TempDir {
 public:
  TempDir()
      : path_(std::filesystem::temp_directory_path() /
              (std::string("mantissa_test_") + std::to_string(::getpid()) + "_" +
               std::to_string(counter_++))) {
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
  static inline int counter_ = 0;
};

// An IDX file's bytes: magic 0 0 type rank, big-endian sizes, then the data.
inline std::string idx_bytes(const std::vector<uint32_t>& shape, const void* data, size_t bytes,
                             uint8_t type = 8) {
  std::string b = {0, 0, static_cast<char>(type), static_cast<char>(shape.size())};
  for (uint32_t s : shape)
    for (int k = 3; k >= 0; --k) b.push_back(static_cast<char>((s >> (8 * k)) & 0xff));
  b.append(static_cast<const char*>(data), bytes);
  return b;
}
inline std::string idx_bytes(const std::vector<uint32_t>& shape, const std::vector<uint8_t>& data,
                             uint8_t type = 8) {
  return idx_bytes(shape, data.data(), data.size(), type);
}

inline void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Returns false if the file could not be written whole.
inline bool write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const int n = gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  return gzclose(f) == Z_OK && n == static_cast<int>(bytes.size());
}

}  // namespace mantissa::testing
