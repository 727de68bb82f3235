#include "mantissa/io/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <vector>

#include "mantissa/core/error.h"
#include "mantissa/io/file_kind.h"

namespace mantissa::io {

InputFile::InputFile(const std::string& path, std::string what, uint64_t max_bytes,
                     const std::string& missing_hint)
    : path_(path), what_(std::move(what)) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer before fstat can refuse it (it has no
  // effect on reads of a regular file).
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd_ < 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) throw Error("cannot find " + name(), missing_hint);
    // A socket cannot be opened at all (ENXIO): say what it is rather than why open failed.
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
      throw Error(name() + " is " + detail::file_kind(st.st_mode) + ", not a regular file",
                  "give the path of a regular file");
    throw Error("cannot open " + name() + ": " + std::strerror(err),
                "check the path and its permissions");
  }
  struct stat st {};
  const bool stat_ok = ::fstat(fd_, &st) == 0;
  if (!stat_ok || !S_ISREG(st.st_mode)) {
    const std::string kind = stat_ok ? detail::file_kind(st.st_mode) : "unreadable";
    ::close(fd_);
    throw Error(name() + " is " + kind + ", not a regular file", "give the path of a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ > max_bytes) {
    ::close(fd_);
    throw Error(name() + " has " + std::to_string(size_) + " bytes; the limit is " +
                    std::to_string(max_bytes),
                "check that the path names the right file");
  }
}

InputFile::~InputFile() { ::close(fd_); }

void InputFile::read_at(uint64_t offset, void* dst, size_t n) const {
  char* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd_, out + done, std::min<size_t>(n - done, size_t{1} << 30),
                              static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      throw Error("cannot read " + name() + ": " + std::strerror(errno),
                  "check the file and the disk");
    if (r == 0)
      throw Error(name() + " ended at byte " + std::to_string(offset + done) + ", before the " +
                      std::to_string(offset + n) + " it had when opened",
                  "the file changed while being read: run again once it is complete");
    done += static_cast<size_t>(r);
  }
}

std::string InputFile::read_all() const {
  std::string out(static_cast<size_t>(size_), '\0');
  read_at(0, out.data(), out.size());
  return out;
}

// ---- ContentReader -----------------------------------------------------------------------------

struct ContentReader::Inflater {
  z_stream z{};
  std::vector<unsigned char> input = std::vector<unsigned char>(size_t{1} << 16);
  bool ended = false;  // the gzip member's end (checksum and length verified) was reached
  ~Inflater() { inflateEnd(&z); }
};

ContentReader::ContentReader(const InputFile& file) : file_(file) {
  unsigned char magic[2];
  if (file.size() >= 2) {
    file.read_at(0, magic, 2);
    compressed_ = magic[0] == 0x1f && magic[1] == 0x8b;
  }
  if (!compressed_) return;
  inflater_ = std::make_unique<Inflater>();
  // 16 + MAX_WBITS: a gzip wrapper (header, CRC-32 and length checked by zlib), nothing else.
  MANTISSA_ASSERT(inflateInit2(&inflater_->z, 16 + MAX_WBITS) == Z_OK, "zlib initialisation");
}

ContentReader::~ContentReader() = default;

std::optional<uint64_t> ContentReader::declared_size() const {
  if (!compressed_) return file_.size();
  if (file_.size() < 18) return std::nullopt;  // a 10-byte header and an 8-byte trailer
  unsigned char b[4];
  file_.read_at(file_.size() - 4, b, 4);
  return uint64_t{b[0]} | uint64_t{b[1]} << 8 | uint64_t{b[2]} << 16 | uint64_t{b[3]} << 24;
}

uint64_t ContentReader::max_size() const {
  if (!compressed_) return file_.size();
  // Deflate's densest code turns 258 bytes into about 2 bits: at most 1032 bytes out per byte in.
  return file_.size() > UINT64_MAX / 1032 ? UINT64_MAX : file_.size() * 1032;
}

void ContentReader::fill_input() {
  Inflater& in = *inflater_;
  const size_t n =
      static_cast<size_t>(std::min<uint64_t>(in.input.size(), file_.size() - file_offset_));
  file_.read_at(file_offset_, in.input.data(), n);
  file_offset_ += n;
  in.z.next_in = in.input.data();
  in.z.avail_in = static_cast<uInt>(n);
}

size_t ContentReader::read(void* dst, size_t n) {
  unsigned char* out = static_cast<unsigned char*>(dst);
  size_t got = 0;
  if (n > 0 && peeked_) {
    out[got++] = *peeked_;
    peeked_.reset();
  }
  if (!compressed_) {
    const size_t k = static_cast<size_t>(std::min<uint64_t>(n - got, file_.size() - file_offset_));
    file_.read_at(file_offset_, out + got, k);
    file_offset_ += k;
    got += k;
    position_ += got;
    return got;
  }
  Inflater& in = *inflater_;
  while (got < n && !in.ended) {
    if (in.z.avail_in == 0 && file_offset_ < file_.size()) fill_input();
    in.z.next_out = out + got;
    in.z.avail_out = static_cast<uInt>(std::min<size_t>(n - got, UINT_MAX));
    const uInt before = in.z.avail_out;
    const int r = inflate(&in.z, Z_NO_FLUSH);
    got += before - in.z.avail_out;
    if (r == Z_STREAM_END) {
      in.ended = true;
      MANTISSA_CHECK(in.z.avail_in == 0 && file_offset_ == file_.size(),
                     file_.name() + " has data after the end of its gzip stream",
                     "the file is damaged, or several files were joined: decompress it and "
                     "check its contents");
    } else if (r == Z_BUF_ERROR && in.z.avail_in == 0 && file_offset_ == file_.size()) {
      throw Error(file_.name() + " is truncated: its gzip stream ends after " +
                      std::to_string(position_ + got) + " bytes of content, without its trailer",
                  "the file is incomplete: download or copy it again");
    } else if (r != Z_OK && r != Z_BUF_ERROR) {
      throw Error(file_.name() + " is not valid gzip data (" +
                      (in.z.msg ? std::string(in.z.msg) : "zlib error " + std::to_string(r)) + ")",
                  "the file is damaged: download or copy it again");
    }
  }
  position_ += got;
  return got;
}

void ContentReader::read_exact(void* dst, size_t n, const std::string& expected) {
  const uint64_t start = position_;
  const size_t got = read(dst, n);
  if (got < n)
    throw Error(file_.name() + " ends after " + std::to_string(start + got) + " bytes" +
                    (compressed_ ? " of decompressed content" : "") + "; " + expected,
                "the file is truncated or damaged: download or copy it again");
}

bool ContentReader::at_end() {
  if (peeked_) return false;
  unsigned char b;
  if (read(&b, 1) == 0) return true;
  peeked_ = b;
  --position_;  // not consumed yet
  return false;
}

}  // namespace mantissa::io
