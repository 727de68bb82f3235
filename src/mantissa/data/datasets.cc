#include "mantissa/data/datasets.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numbers>
#include <optional>

#include "mantissa/core/checked.h"
#include "mantissa/core/error.h"
#include "mantissa/core/philox.h"
#include "mantissa/io/input_file.h"

namespace mantissa::data {
namespace fs = std::filesystem;
namespace {

// Whole datasets live in host memory (host_memory_tracker()); the loader's batches are what the
// device holds.
TensorOptions input_data() {
  TensorOptions o = charged_to(MemoryCategory::input_data);
  o.tracker = &host_memory_tracker();
  return o;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

std::string first_existing(const std::string& dir, const std::string& base) {
  for (const std::string& c : {base + ".gz", base}) {
    const std::string p = (fs::path(dir) / c).string();
    if (fs::exists(p)) return p;
  }
  return (fs::path(dir) / (base + ".gz")).string();
}

}  // namespace

Dataset Dataset::head(int64_t n) const {
  if (n <= 0 || n >= size()) return *this;
  Dataset d = *this;
  d.images = images.narrow(0, 0, n);
  d.labels = labels.narrow(0, 0, n);
  return d;
}

Tensor read_idx(const std::string& path) {
  const io::InputFile file(path, "IDX file", io::kMaxDatasetFileBytes,
                           "pass --data-dir with the directory that holds the IDX files");
  io::ContentReader in(file);
  uint8_t head[4 + 4 * 4];
  in.read_exact(head, 4, "an IDX file starts with a 4-byte magic number");
  MANTISSA_CHECK(head[0] == 0 && head[1] == 0,
                 "IDX file " + path + " has a bad magic number (first bytes must be 0 0)",
                 "this is not an IDX file: point --data-dir at the MNIST-format files");
  MANTISSA_CHECK(head[2] == 0x08,
                 "IDX file " + path + " holds type code " + std::to_string(head[2]) +
                     ", not unsigned bytes (8)",
                 "only 8-bit image and label files are supported");
  const int dims = head[3];
  MANTISSA_CHECK(dims >= 1 && dims <= 4,
                 "IDX file " + path + " declares " + std::to_string(dims) + " dimensions",
                 "expected 1 (labels) or 3 (images)");
  const uint64_t header = 4 + 4 * static_cast<uint64_t>(dims);
  in.read_exact(head + 4, header - 4,
                "its header declares " + std::to_string(dims) + " dimensions of 4 bytes each");
  Shape shape;
  std::optional<uint64_t> count = 1;
  for (int d = 0; d < dims; ++d) {
    const uint32_t s = be32(&head[4 + 4 * d]);
    MANTISSA_CHECK(s > 0 && s < (1u << 28),
                   "IDX file " + path + " has a dimension of size " + std::to_string(s),
                   "the file is damaged");
    shape.push_back(s);
    if (count) count = checked_mul<uint64_t>(*count, s);
  }
  // The data the header declares must be what the file holds, checked before allocating it: a raw
  // file's size, a gzip file's trailer (its length modulo 2^32) and deflate's limit on expansion.
  const std::optional<uint64_t> content = in.declared_size();
  const uint64_t held = content && *content >= header ? *content - header : 0;
  const bool fits = count && *count <= io::kMaxDatasetFileBytes && *count <= in.max_size();
  const bool agrees =
      content && (in.compressed() ? (header + *count) % (uint64_t{1} << 32) == *content
                                  : header + *count == *content);
  MANTISSA_CHECK(fits && agrees,
                 "IDX file " + path + " holds " + std::to_string(held) + " data bytes" +
                     (in.compressed() ? " (by its gzip trailer)" : "") +
                     " but its header declares " + shape_str(shape) + " = " +
                     (count ? std::to_string(*count) : "too many"),
                 "the file is truncated or damaged: download or reinstall it");
  Tensor t = Tensor::empty(shape, DType::u8, input_data());
  in.read_exact(
      t.data_ptr(), static_cast<size_t>(*count),
      "its header declares " + shape_str(shape) + " = " + std::to_string(*count) + " data bytes");
  MANTISSA_CHECK(in.at_end(),
                 "IDX file " + path + " holds more data than its header declares (" +
                     shape_str(shape) + " = " + std::to_string(*count) + " bytes)",
                 "the file is damaged: download or reinstall it");
  return t;
}

Dataset load_idx(const std::string& images_path, const std::string& labels_path,
                 const std::string& name) {
  Tensor images = read_idx(images_path);
  Tensor labels = read_idx(labels_path);
  MANTISSA_CHECK(images.dim() == 3,
                 "IDX images file " + images_path + " has shape " + shape_str(images.shape()) +
                     ", not (N, H, W)",
                 "pass the images file (idx3)");
  MANTISSA_CHECK(
      labels.dim() == 1,
      "IDX labels file " + labels_path + " has shape " + shape_str(labels.shape()) + ", not (N)",
      "pass the labels file (idx1)");
  MANTISSA_CHECK(images.size(0) == labels.size(0),
                 images_path + " holds " + std::to_string(images.size(0)) + " images but " +
                     labels_path + " " + std::to_string(labels.size(0)) + " labels",
                 "the two files come from different datasets or splits");
  Dataset d;
  d.name = name;
  d.images = images.view({images.size(0), 1, images.size(1), images.size(2)});
  d.labels = Tensor::empty({labels.size(0)}, DType::i64, input_data());
  const uint8_t* l = static_cast<const uint8_t*>(labels.data_ptr());
  int64_t* out = d.labels.data<int64_t>();
  for (int64_t i = 0; i < labels.size(0); ++i) {
    MANTISSA_CHECK(l[i] < 10,
                   labels_path + ": label " + std::to_string(l[i]) + " of example " +
                       std::to_string(i) + " is not a class 0-9",
                   "the file is damaged");
    out[i] = l[i];
  }
  return d;
}

Dataset load_mnist_dir(const std::string& dir, bool train, const std::string& name) {
  const std::string split = train ? "train" : "t10k";
  return load_idx(first_existing(dir, split + "-images-idx3-ubyte"),
                  first_existing(dir, split + "-labels-idx1-ubyte"),
                  name + (train ? " (train)" : " (test)"));
}

Dataset load_cifar10(const std::string& dir_in, bool train) {
  std::string dir = dir_in;
  if (fs::is_directory(fs::path(dir) / "cifar-10-batches-bin"))
    dir = (fs::path(dir) / "cifar-10-batches-bin").string();
  std::vector<std::string> files;
  if (train)
    for (int i = 1; i <= 5; ++i)
      files.push_back((fs::path(dir) / ("data_batch_" + std::to_string(i) + ".bin")).string());
  else
    files.push_back((fs::path(dir) / "test_batch.bin").string());
  // A file holds whole records: a label byte, then the 3x32x32 image. Every file's record count
  // is known (its size, or a gzip file's trailer) and checked before the dataset is allocated.
  constexpr size_t kRecord = 1 + 3 * 32 * 32;
  std::vector<std::unique_ptr<io::InputFile>> inputs;
  std::vector<uint64_t> records;
  uint64_t total = 0;
  for (const std::string& f : files) {
    inputs.push_back(std::make_unique<io::InputFile>(
        f, "CIFAR-10 file", io::kMaxDatasetFileBytes,
        "pass --data-dir with the directory of the CIFAR-10 binary version "
        "(cifar-10-batches-bin)"));
    const io::ContentReader in(*inputs.back());
    const uint64_t bytes = in.declared_size().value_or(0);
    MANTISSA_CHECK(bytes > 0 && bytes % kRecord == 0 && bytes <= in.max_size(),
                   "CIFAR-10 file " + f + " has " + std::to_string(bytes) + " bytes" +
                       (in.compressed() ? " (by its gzip trailer)" : "") +
                       ", not a whole number of 3073-byte records",
                   "the file is truncated or not the binary version of CIFAR-10");
    records.push_back(bytes / kRecord);
    total += records.back();  // at most 16 GiB / 3073 per file
  }
  Dataset d;
  d.name = std::string("cifar10") + (train ? " (train)" : " (test)");
  const int64_t n = static_cast<int64_t>(total);
  d.images = Tensor::empty({n, 3, 32, 32}, DType::u8, input_data());
  d.labels = Tensor::empty({n}, DType::i64, input_data());
  uint8_t* img = static_cast<uint8_t*>(d.images.data_ptr());
  int64_t* lab = d.labels.data<int64_t>();
  constexpr uint64_t kChunk = 256;  // records per read
  std::vector<uint8_t> buf(std::min(kChunk, *std::max_element(records.begin(), records.end())) *
                           kRecord);
  int64_t k = 0;
  for (size_t fi = 0; fi < files.size(); ++fi) {
    io::ContentReader in(*inputs[fi]);
    for (uint64_t r0 = 0; r0 < records[fi]; r0 += kChunk) {
      const uint64_t m = std::min(kChunk, records[fi] - r0);
      in.read_exact(buf.data(), static_cast<size_t>(m * kRecord),
                    "expected " + std::to_string(records[fi] * kRecord));
      for (uint64_t r = 0; r < m; ++r, ++k) {
        const uint8_t* rec = &buf[r * kRecord];
        MANTISSA_CHECK(rec[0] < 10,
                       "CIFAR-10 file " + files[fi] + ": record " + std::to_string(r0 + r) +
                           " has label " + std::to_string(rec[0]),
                       "the file is damaged or not CIFAR-10 (CIFAR-100 has 2 label bytes)");
        lab[k] = rec[0];
        std::memcpy(img + k * 3072, rec + 1, 3072);
      }
    }
    MANTISSA_CHECK(in.at_end(),
                   "CIFAR-10 file " + files[fi] + " holds more than the " +
                       std::to_string(records[fi] * kRecord) + " bytes its gzip trailer declares",
                   "the file is damaged: download it again");
  }
  return d;
}

Dataset synthetic(const SyntheticConfig& c, bool train) {
  MANTISSA_CHECK(c.size > 0 && c.channels > 0 && c.image_size > 0 && c.num_classes >= 2,
                 "synthetic dataset needs positive sizes and at least 2 classes", "");
  Dataset d;
  d.name = std::string("synthetic") + (train ? " (train)" : " (test)");
  d.num_classes = c.num_classes;
  const int64_t S = c.image_size, C = c.channels;
  d.images = Tensor::empty({c.size, C, S, S}, DType::u8, input_data());
  d.labels = Tensor::empty({c.size}, DType::i64, input_data());
  uint8_t* img = static_cast<uint8_t*>(d.images.data_ptr());
  int64_t* lab = d.labels.data<int64_t>();
  const uint64_t stream = train ? 0x5917000000000001ull : 0x5917000000000002ull;
  for (int64_t i = 0; i < c.size; ++i) {
    const uint32_t r = philox_bits(c.seed, stream, static_cast<uint64_t>(i));
    const int64_t y = static_cast<int64_t>(r % static_cast<uint32_t>(c.num_classes));
    lab[i] = y;
    // Class y: a wave of orientation y * pi / classes and 2 + y % 3 periods across the image.
    const double angle =
        std::numbers::pi * static_cast<double>(y) / static_cast<double>(c.num_classes);
    const double freq =
        2.0 * std::numbers::pi * static_cast<double>(2 + y % 3) / static_cast<double>(S);
    const double fx = std::cos(angle) * freq, fy = std::sin(angle) * freq;
    const double phase = 2.0 * std::numbers::pi * (r >> 16) / 65536.0;  // random shift
    for (int64_t ch = 0; ch < C; ++ch)
      for (int64_t h = 0; h < S; ++h)
        for (int64_t w = 0; w < S; ++w) {
          const uint64_t idx = static_cast<uint64_t>(((i * C + ch) * S + h) * S + w);
          const double noise = (philox_bits(c.seed, stream + 16, idx) >> 8) * 0x1p-24 - 0.5;
          const double v = 0.5 + 0.3 * std::sin(fx * w + fy * h + phase + ch) + 0.3 * noise;
          img[idx] = static_cast<uint8_t>(std::lround(std::clamp(v, 0.0, 1.0) * 255.0));
        }
  }
  return d;
}

std::vector<std::string> dataset_names() {
  return {"fashion-mnist", "mnist", "cifar10", "synthetic"};
}

std::string default_data_dir(const std::string& dataset) {
  if (dataset == "fashion-mnist") return "/usr/share/datasets/fashion-mnist";
  if (dataset == "mnist") return "/usr/share/datasets/mnist";
  if (dataset == "cifar10") return "data/cifar-10-batches-bin";
  return "";
}

Dataset load_dataset(const std::string& name, const std::string& dir_in, bool train,
                     const SyntheticConfig& sc) {
  const std::string dir = dir_in.empty() ? default_data_dir(name) : dir_in;
  if (name == "fashion-mnist" || name == "mnist") {
    const std::string hint =
        name == "fashion-mnist"
            ? "install Debian's dataset-fashion-mnist (bash scripts/setup.sh does), or pass "
              "--data-dir with the directory of the IDX files"
            : "pass --data-dir with the directory of the MNIST IDX files";
    std::error_code ec;
    MANTISSA_CHECK(fs::is_directory(dir, ec),
                   "data directory " + dir + " of " + name + " does not exist", hint);
    return load_mnist_dir(dir, train, name);
  }
  if (name == "cifar10") return load_cifar10(dir, train);
  if (name == "synthetic") return synthetic(sc, train);
  std::string names;
  for (auto& n : dataset_names()) names += (names.empty() ? "" : ", ") + n;
  throw Error("unknown dataset '" + excerpt(name) + "'", "choose one of: " + names);
}

}  // namespace mantissa::data
