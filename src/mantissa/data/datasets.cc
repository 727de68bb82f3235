#include "mantissa/data/datasets.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numbers>

#include "mantissa/core/error.h"
#include "mantissa/core/philox.h"

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

// The whole (decompressed) contents of a file; zlib reads raw files unchanged.
std::vector<uint8_t> read_file(const std::string& path, const std::string& hint) {
  std::error_code ec;
  MANTISSA_CHECK(fs::is_regular_file(path, ec), "cannot find data file " + path, hint);
  gzFile f = gzopen(path.c_str(), "rb");
  MANTISSA_CHECK(f != nullptr, "cannot open data file " + path + ": " + std::strerror(errno),
                 "check the file's permissions");
  std::vector<uint8_t> out;
  std::vector<uint8_t> buf(1 << 20);
  for (;;) {
    const int n = gzread(f, buf.data(), static_cast<unsigned>(buf.size()));
    if (n < 0) {
      int code = 0;
      const std::string msg = gzerror(f, &code);
      gzclose(f);
      throw Error("data file " + path + " is corrupt (" + msg + ")",
                  "the file is truncated or damaged: download or reinstall it");
    }
    if (n == 0) break;
    out.insert(out.end(), buf.begin(), buf.begin() + n);
  }
  gzclose(f);
  return out;
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
  const std::vector<uint8_t> bytes =
      read_file(path, "pass --data-dir with the directory that holds the IDX files");
  MANTISSA_CHECK(bytes.size() >= 4, "IDX file " + path + " is too short for its header",
                 "the file is truncated: download or reinstall it");
  MANTISSA_CHECK(bytes[0] == 0 && bytes[1] == 0,
                 "IDX file " + path + " has a bad magic number (first bytes must be 0 0)",
                 "this is not an IDX file: point --data-dir at the MNIST-format files");
  MANTISSA_CHECK(bytes[2] == 0x08,
                 "IDX file " + path + " holds type code " + std::to_string(bytes[2]) +
                     ", not unsigned bytes (8)",
                 "only 8-bit image and label files are supported");
  const int dims = bytes[3];
  MANTISSA_CHECK(dims >= 1 && dims <= 4,
                 "IDX file " + path + " declares " + std::to_string(dims) + " dimensions",
                 "expected 1 (labels) or 3 (images)");
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  MANTISSA_CHECK(bytes.size() >= header, "IDX file " + path + " is too short for its header",
                 "the file is truncated: download or reinstall it");
  Shape shape;
  size_t count = 1;
  for (int d = 0; d < dims; ++d) {
    const uint32_t s = be32(&bytes[4 + 4 * static_cast<size_t>(d)]);
    MANTISSA_CHECK(s > 0 && s < (1u << 28),
                   "IDX file " + path + " has a dimension of size " + std::to_string(s),
                   "the file is damaged");
    shape.push_back(s);
    count *= s;
  }
  MANTISSA_CHECK(bytes.size() - header == count,
                 "IDX file " + path + " holds " + std::to_string(bytes.size() - header) +
                     " data bytes but its header declares " + shape_str(shape) + " = " +
                     std::to_string(count),
                 "the file is truncated or damaged: download or reinstall it");
  Tensor t = Tensor::empty(shape, DType::u8, input_data());
  std::memcpy(t.data_ptr(), bytes.data() + header, count);
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
  constexpr size_t kRecord = 1 + 3 * 32 * 32;
  std::vector<std::vector<uint8_t>> contents;
  size_t total = 0;
  for (auto& f : files) {
    contents.push_back(read_file(f,
                                 "pass --data-dir with the directory of the CIFAR-10 binary "
                                 "version (cifar-10-batches-bin)"));
    MANTISSA_CHECK(!contents.back().empty() && contents.back().size() % kRecord == 0,
                   "CIFAR-10 file " + f + " has " + std::to_string(contents.back().size()) +
                       " bytes, not a whole number of 3073-byte records",
                   "the file is truncated or not the binary version of CIFAR-10");
    total += contents.back().size() / kRecord;
  }
  Dataset d;
  d.name = std::string("cifar10") + (train ? " (train)" : " (test)");
  const int64_t n = static_cast<int64_t>(total);
  d.images = Tensor::empty({n, 3, 32, 32}, DType::u8, input_data());
  d.labels = Tensor::empty({n}, DType::i64, input_data());
  uint8_t* img = static_cast<uint8_t*>(d.images.data_ptr());
  int64_t* lab = d.labels.data<int64_t>();
  int64_t k = 0;
  for (size_t fi = 0; fi < files.size(); ++fi) {
    const auto& c = contents[fi];
    for (size_t r = 0; r < c.size() / kRecord; ++r, ++k) {
      const uint8_t* rec = &c[r * kRecord];
      MANTISSA_CHECK(rec[0] < 10,
                     "CIFAR-10 file " + files[fi] + ": record " + std::to_string(r) +
                         " has label " + std::to_string(rec[0]),
                     "the file is damaged or not CIFAR-10 (CIFAR-100 has 2 label bytes)");
      lab[k] = rec[0];
      std::memcpy(img + k * 3072, rec + 1, 3072);
    }
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
  throw Error("unknown dataset '" + name + "'", "choose one of: " + names);
}

}  // namespace mantissa::data
