// Reading input files (datasets, checkpoints, weights, op lists) so that no content can crash a
// reader or make it allocate what the file cannot hold. Every file Mantissa reads is opened here:
//  - the path must name a regular file: a directory, FIFO, device or socket is refused, checked on
//    the opened descriptor (fstat), so the file checked is the file read;
//  - the file's size is known before anything is read and bounded by the reader's limit;
//  - reads are exact: a file that ends before the bytes asked for (it shrank while being read) is
//    an error, never a buffer left partly filled;
//  - gzip-compressed content is inflated as it is read, never more than asked for, so a reader
//    checks a declared size before the data is decompressed (see ContentReader).
// Every failure throws mantissa::Error naming the file (as `what` and its path) and the fault.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace mantissa::io {

// An open regular file. Not copyable; closes its descriptor on destruction.
class InputFile {
 public:
  // Opens `path`. `what` names the file in messages ("IDX file", "checkpoint", "op list");
  // `missing_hint` is the hint when the file does not exist. A file of more than `max_bytes` bytes
  // is refused (its size as stored, before any decompression).
  InputFile(const std::string& path, std::string what, uint64_t max_bytes,
            const std::string& missing_hint);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& what() const { return what_; }
  uint64_t size() const { return size_; }

  // Reads exactly `n` bytes at `offset` into `dst`; throws if the file ends first.
  void read_at(uint64_t offset, void* dst, size_t n) const;
  // The whole file (size() bytes).
  std::string read_all() const;

  // "IDX file /data/x-ubyte" as messages start.
  std::string name() const { return what_ + " " + path_; }

 private:
  std::string path_;
  std::string what_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The content of a file, read in order: the bytes themselves, or, for a gzip file (recognised by
// its magic bytes 1f 8b), the decompressed bytes. Decompression is incremental and bounded: each
// read() inflates only what it returns (plus zlib's internal buffer), so a reader can check the
// sizes its format declares before reading the data they cover. A gzip file must hold exactly
// one gzip member (nothing after it); its checksum and length are verified when its end is read.
class ContentReader {
 public:
  explicit ContentReader(const InputFile& file);
  ~ContentReader();
  ContentReader(const ContentReader&) = delete;
  ContentReader& operator=(const ContentReader&) = delete;

  bool compressed() const { return compressed_; }
  // What the file says its content's size is, before any of it is read: a raw file's size; for a
  // gzip file, the length in its trailer, which is the size modulo 2^32 (std::nullopt if the file
  // is too short to have one).
  std::optional<uint64_t> declared_size() const;
  // The largest content the file could hold: a raw file's size; for a gzip file, deflate's
  // maximum expansion (1032:1) of its size. A size a header declares beyond this is impossible.
  uint64_t max_size() const;

  // Reads up to `n` bytes; fewer only at the end of the content.
  size_t read(void* dst, size_t n);
  // Reads exactly `n` bytes; throws "<file> ends after N bytes of content; `expected`" otherwise.
  void read_exact(void* dst, size_t n, const std::string& expected);
  // Whether the content is fully read: reads (and so inflates) at most one more byte.
  bool at_end();
  // Content bytes read so far.
  uint64_t position() const { return position_; }

 private:
  void fill_input();

  const InputFile& file_;
  bool compressed_ = false;
  uint64_t file_offset_ = 0;  // next byte of the file to read
  uint64_t position_ = 0;
  struct Inflater;
  std::unique_ptr<Inflater> inflater_;   // gzip only
  std::optional<unsigned char> peeked_;  // a byte read by at_end()
};

// Size limits of the readers (of the file as stored): each far above any real file of its kind,
// far below what would exhaust memory by mistake.
inline constexpr uint64_t kMaxDatasetFileBytes = uint64_t{16} << 30;  // IDX and CIFAR files
inline constexpr uint64_t kMaxTextFileBytes = uint64_t{1} << 20;      // op lists
inline constexpr uint64_t kMaxSafetensorsFileBytes = uint64_t{1} << 40;

}  // namespace mantissa::io
