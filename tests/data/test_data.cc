// Datasets and the loader: IDX and CIFAR-10 readers (and their errors), the synthetic dataset,
// the transforms against PyTorch's F.interpolate, shuffling, batching, prefetching and resuming.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "mantissa/io/safetensors.h"
#include "mantissa/mantissa.h"
#include "support/compare.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/golden.h"

namespace mantissa {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::idx_bytes;
using testing::TempDir;
using testing::write_gz;
using testing::write_raw;

std::vector<uint8_t> iota_bytes(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 7);
  return v;
}

TEST(Idx, ReadsRawAndGzipFiles) {
  TempDir d;
  const std::string bytes = idx_bytes({3, 2, 4}, iota_bytes(24));
  write_raw(d.file("a.idx"), bytes);
  write_gz(d.file("a.idx.gz"), bytes);
  for (const std::string f : {"a.idx", "a.idx.gz"}) {
    Tensor t = data::read_idx(d.file(f));
    EXPECT_EQ(t.shape(), (Shape{3, 2, 4}));
    EXPECT_EQ(t.dtype(), DType::u8);
    EXPECT_EQ(static_cast<const uint8_t*>(t.data_ptr())[5], 35);
  }
}

TEST(Idx, BadFilesAreNamedWithTheFault) {
  TempDir d;
  write_raw(d.file("magic"), "\x01\x02\x08\x01\0\0\0\x01x");
  EXPECT_NE(error_of([&] { data::read_idx(d.file("magic")); }).find("bad magic number"),
            std::string::npos);
  write_raw(d.file("type"), idx_bytes({2}, {1, 2}, 0x0d));
  EXPECT_NE(error_of([&] { data::read_idx(d.file("type")); }).find("type code 13"),
            std::string::npos);
  std::string truncated = idx_bytes({10, 28, 28}, iota_bytes(100));
  write_raw(d.file("short"), truncated);
  const std::string e = error_of([&] { data::read_idx(d.file("short")); });
  EXPECT_NE(
      e.find(d.file("short") + " holds 100 data bytes but its header declares (10, 28, 28) = 7840"),
      std::string::npos)
      << e;
  EXPECT_NE(e.find("truncated"), std::string::npos);
  std::string gz_broken;
  {
    write_gz(d.file("full.gz"), idx_bytes({100, 28, 28}, iota_bytes(78400)));
    std::ifstream in(d.file("full.gz"), std::ios::binary);
    gz_broken.assign(std::istreambuf_iterator<char>(in), {});
    gz_broken.resize(gz_broken.size() / 2);
    write_raw(d.file("broken.gz"), gz_broken);
  }
  EXPECT_NE(error_of([&] { data::read_idx(d.file("broken.gz")); }), "");
  EXPECT_NE(error_of([&] {
              data::read_idx(d.file("absent"));
            }).find("cannot find IDX file " + d.file("absent")),
            std::string::npos);
  std::filesystem::create_directory(d.file("dir"));
  EXPECT_NE(error_of([&] {
              data::read_idx(d.file("dir"));
            }).find("IDX file " + d.file("dir") + " is a directory, not a regular file"),
            std::string::npos);
}

TEST(Idx, DeclaredSizesAreCheckedBeforeAllocating) {
  TempDir d;
  // Four dimensions whose product overflows 64 bits.
  const std::string huge = idx_bytes({(1u << 28) - 1, (1u << 28) - 1, (1u << 28) - 1, 3}, {1, 2});
  write_raw(d.file("huge"), huge);
  std::string e = error_of([&] { data::read_idx(d.file("huge")); });
  EXPECT_NE(e.find("holds 2 data bytes but its header declares (268435455, 268435455, 268435455, "
                   "3) = too many"),
            std::string::npos)
      << e;
  // A gzip file whose header declares far more than its trailer's length: refused before any
  // data is inflated or allocated.
  write_gz(d.file("big.gz"), idx_bytes({100000, 1000}, iota_bytes(100)));
  e = error_of([&] { data::read_idx(d.file("big.gz")); });
  EXPECT_NE(e.find("holds 100 data bytes (by its gzip trailer) but its header declares (100000, "
                   "1000) = 100000000"),
            std::string::npos)
      << e;
}

TEST(Idx, AGzipStreamThatExpandsBeyondItsHeaderIsRefused) {
  TempDir d;
  // The header declares 10 bytes; the stream holds 2^32 + 10 (its trailer's length, modulo 2^32,
  // agrees). Reading stops one byte past the declared size.
  const std::string head = idx_bytes({10}, iota_bytes(10));
  std::string bytes = head + std::string(1 << 20, 'x');
  write_gz(d.file("bomb.gz"), bytes);
  std::string gz;
  {
    std::ifstream in(d.file("bomb.gz"), std::ios::binary);
    gz.assign(std::istreambuf_iterator<char>(in), {});
  }
  // Make the trailer's length claim the header's size: only the stream itself tells the truth.
  const uint32_t declared = static_cast<uint32_t>(head.size());
  for (int i = 0; i < 4; ++i) gz[gz.size() - 4 + i] = static_cast<char>(declared >> (8 * i));
  write_raw(d.file("bomb.gz"), gz);
  const std::string e = error_of([&] { data::read_idx(d.file("bomb.gz")); });
  EXPECT_NE(e.find("IDX file " + d.file("bomb.gz") +
                   " holds more data than its header declares ((10,) = 10 bytes)"),
            std::string::npos)
      << e;
  // A stream shorter than its header declares, whose trailer lies to agree: zlib's check of the
  // length at the stream's end catches it.
  write_gz(d.file("short.gz"), idx_bytes({10}, iota_bytes(4)));
  {
    std::ifstream in(d.file("short.gz"), std::ios::binary);
    gz.assign(std::istreambuf_iterator<char>(in), {});
  }
  for (int i = 0; i < 4; ++i) gz[gz.size() - 4 + i] = static_cast<char>(18 >> (8 * i));
  write_raw(d.file("short.gz"), gz);
  const std::string e2 = error_of([&] { data::read_idx(d.file("short.gz")); });
  EXPECT_NE(e2.find("IDX file " + d.file("short.gz") +
                    " is not valid gzip data (incorrect length check)"),
            std::string::npos)
      << e2;
}

TEST(Idx, ImageAndLabelCountsMustAgree) {
  TempDir d;
  write_raw(d.file("train-images-idx3-ubyte"), idx_bytes({3, 2, 2}, iota_bytes(12)));
  write_raw(d.file("train-labels-idx1-ubyte"), idx_bytes({2}, {1, 2}));
  EXPECT_NE(
      error_of([&] { data::load_mnist_dir(d.file(""), true, "x"); }).find("holds 3 images but"),
      std::string::npos);
  write_raw(d.file("train-labels-idx1-ubyte"), idx_bytes({3}, {1, 2, 10}));
  EXPECT_NE(
      error_of([&] { data::load_mnist_dir(d.file(""), true, "x"); }).find("label 10 of example 2"),
      std::string::npos);
  write_raw(d.file("train-labels-idx1-ubyte"), idx_bytes({3}, {1, 2, 9}));
  data::Dataset ds = data::load_mnist_dir(d.file(""), true, "x");
  EXPECT_EQ(ds.images.shape(), (Shape{3, 1, 2, 2}));
  EXPECT_EQ(ds.labels.data<int64_t>()[2], 9);
  EXPECT_EQ(ds.head(2).size(), 2);
}

TEST(Cifar10, ReadsRecordsAndRejectsPartialOnes) {
  TempDir d;
  std::string bytes;
  for (int r = 0; r < 2; ++r) {
    bytes.push_back(static_cast<char>(3 + r));
    for (int i = 0; i < 3072; ++i) bytes.push_back(static_cast<char>((i + r) & 0xff));
  }
  write_raw(d.file("test_batch.bin"), bytes);
  data::Dataset ds = data::load_cifar10(d.file(""), false);
  EXPECT_EQ(ds.images.shape(), (Shape{2, 3, 32, 32}));
  EXPECT_EQ(ds.labels.data<int64_t>()[1], 4);
  EXPECT_EQ(static_cast<const uint8_t*>(ds.images.data_ptr())[3072 + 1024], (1024 + 1) & 0xff);
  write_raw(d.file("test_batch.bin"), bytes.substr(0, 4000));
  EXPECT_NE(error_of([&] {
              data::load_cifar10(d.file(""), false);
            }).find("not a whole number of 3073-byte records"),
            std::string::npos);
  EXPECT_NE(error_of([&] { data::load_cifar10(d.file(""), true); }).find("data_batch_1.bin"),
            std::string::npos);
  // Gzip-compressed records are read too; their count comes from the trailer, and a stream
  // longer than the trailer says is refused.
  ASSERT_TRUE(write_gz(d.file("test_batch.bin"), bytes));
  EXPECT_EQ(data::load_cifar10(d.file(""), false).labels.data<int64_t>()[1], 4);
  std::string gz;
  {
    std::ifstream in(d.file("test_batch.bin"), std::ios::binary);
    gz.assign(std::istreambuf_iterator<char>(in), {});
  }
  gz[gz.size() - 4] = static_cast<char>(3073 & 0xff);  // one record, by the trailer
  gz[gz.size() - 3] = static_cast<char>(3073 >> 8);
  write_raw(d.file("test_batch.bin"), gz);
  const std::string e = error_of([&] { data::load_cifar10(d.file(""), false); });
  EXPECT_NE(e.find("holds more than the 3073 bytes its gzip trailer declares"), std::string::npos)
      << e;
  std::filesystem::remove(d.file("test_batch.bin"));
  std::filesystem::create_directory(d.file("test_batch.bin"));
  EXPECT_NE(error_of([&] { data::load_cifar10(d.file(""), false); }).find("is a directory"),
            std::string::npos);
}

TEST(Datasets, UnknownNamesAndMissingDirectoriesAreExplained) {
  EXPECT_NE(error_of([] {
              data::load_dataset("imagenet", "", true);
            }).find("choose one of: fashion-mnist"),
            std::string::npos);
  const std::string e =
      error_of([] { data::load_dataset("fashion-mnist", "/nonexistent/dir", true); });
  EXPECT_NE(e.find("/nonexistent/dir"), std::string::npos) << e;
  EXPECT_NE(e.find("dataset-fashion-mnist"), std::string::npos) << e;
}

TEST(Synthetic, IsReproducibleBalancedAndSplit) {
  data::SyntheticConfig c;
  c.size = 500;
  c.channels = 3;
  c.image_size = 12;
  data::Dataset a = data::synthetic(c, true), b = data::synthetic(c, true),
                t = data::synthetic(c, false);
  EXPECT_EQ(a.images.shape(), (Shape{500, 3, 12, 12}));
  EXPECT_EQ(a.images.to_float_vector(), b.images.to_float_vector());
  EXPECT_NE(a.images.to_float_vector(), t.images.to_float_vector());
  std::vector<int> count(10);
  for (int64_t i = 0; i < 500; ++i) ++count[static_cast<size_t>(a.labels.data<int64_t>()[i])];
  for (int k : count) EXPECT_GT(k, 25);
}

TEST(Transform, BilinearResizeMatchesPyTorchInterpolate) {
  const io::SafetensorsFile& g = testing::golden_file("training.safetensors");
  const Tensor& in = g.at("resize/in");     // u8 (3, 5, 7)
  const Tensor& want = g.at("resize/out");  // F.interpolate(in / 255, (11, 11)), normalized by 0.5
  data::Transform t;
  t.image_size = 11;
  std::vector<float> out(3 * 11 * 11);
  data::transform_image(static_cast<const uint8_t*>(in.data_ptr()), 3, 5, 7, t, 0, out.data());
  std::vector<double> got(out.begin(), out.end());
  std::vector<double> w;
  for (float v : want.to_float_vector()) w.push_back(v);
  testing::expect_close("resize", got, w, 0, 0, 2e-6, "mantissa", "pytorch");
}

TEST(Transform, FlipAndPaddedCrop) {
  std::vector<uint8_t> img(4 * 4);
  for (int i = 0; i < 16; ++i) img[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 10);
  data::Transform t;
  t.mean = {0};
  t.std = {1};
  std::vector<float> plain(16), flipped(16), cropped(16);
  data::transform_image(img.data(), 1, 4, 4, t, 0, plain.data());
  t.random_flip = true;
  data::transform_image(img.data(), 1, 4, 4, t, 0x80000000u, flipped.data());
  for (int y = 0; y < 4; ++y)
    for (int x = 0; x < 4; ++x)
      EXPECT_EQ(flipped[static_cast<size_t>(y * 4 + x)], plain[static_cast<size_t>(y * 4 + 3 - x)]);
  t.random_flip = false;
  t.crop_padding = 1;
  // random % 3 = 0 -> row offset -1; (random >> 8) % 3 = 2 -> column offset +1.
  data::transform_image(img.data(), 1, 4, 4, t, 0x201u, cropped.data());
  for (int x = 0; x < 4; ++x) EXPECT_EQ(cropped[static_cast<size_t>(x)], 0.0f);  // padding row
  EXPECT_EQ(cropped[4 + 0], plain[1]);
  EXPECT_EQ(cropped[4 + 3], 0.0f);  // padding column
}

// The transform's definition, one pixel at a time: v = byte / 255, bilinear resize as
// F.interpolate (align_corners=False) when the size changes, then output (y, x) reads row y + oy,
// column (flip ? S - 1 - x : x) + ox of the result (0 outside), normalized as (v - mean) / std.
std::vector<float> transform_reference(const std::vector<uint8_t>& src, int64_t C, int64_t H,
                                       int64_t S, const data::Transform& t, int64_t oy, int64_t ox,
                                       bool flip) {
  std::vector<float> img(static_cast<size_t>(C * S * S));
  const float scale = static_cast<float>(H) / static_cast<float>(S);
  auto tap = [&](int64_t o, int64_t& i0, int64_t& step, float& lambda) {
    float f = scale * (static_cast<float>(o) + 0.5f) - 0.5f;
    if (f < 0) f = 0;
    i0 = static_cast<int64_t>(f);
    step = i0 < H - 1 ? 1 : 0;
    lambda = f - static_cast<float>(i0);
  };
  auto px = [&](int64_t c, int64_t y, int64_t x) {
    return static_cast<float>(src[static_cast<size_t>((c * H + y) * H + x)]) / 255.0f;
  };
  for (int64_t c = 0; c < C; ++c)
    for (int64_t y = 0; y < S; ++y)
      for (int64_t x = 0; x < S; ++x) {
        float& v = img[static_cast<size_t>((c * S + y) * S + x)];
        if (S == H) {
          v = px(c, y, x);
          continue;
        }
        int64_t y0, ys, x0, xs;
        float h1, w1;
        tap(y, y0, ys, h1);
        tap(x, x0, xs, w1);
        const float h0 = 1.0f - h1, w0 = 1.0f - w1;
        v = h0 * (w0 * px(c, y0, x0) + w1 * px(c, y0, x0 + xs)) +
            h1 * (w0 * px(c, y0 + ys, x0) + w1 * px(c, y0 + ys, x0 + xs));
      }
  std::vector<float> out(img.size());
  for (int64_t c = 0; c < C; ++c) {
    const size_t k = t.mean.size() == 1 ? 0 : static_cast<size_t>(c);
    for (int64_t y = 0; y < S; ++y)
      for (int64_t x = 0; x < S; ++x) {
        const int64_t sy = y + oy, sx = (flip ? S - 1 - x : x) + ox;
        const float v = sy >= 0 && sy < S && sx >= 0 && sx < S
                            ? img[static_cast<size_t>((c * S + sy) * S + sx)]
                            : 0.0f;
        out[static_cast<size_t>((c * S + y) * S + x)] = (v - t.mean[k]) / t.std[k];
      }
  }
  return out;
}

TEST(Transform, MatchesItsDefinitionBitForBitForEveryCropAndFlip) {
  // Crop offsets and flips of a padding of 3, with and without a resize, per-channel
  // normalization: the row-wise implementation (tables of the 256 byte values, padding runs)
  // against the pixel-by-pixel definition.
  const int64_t C = 3, P = 3;
  std::vector<uint8_t> src(static_cast<size_t>(C * 9 * 9));
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
  src[5] = 0;
  src[6] = 255;
  for (const int64_t size : {int64_t{9}, int64_t{13}}) {
    data::Transform t;
    t.image_size = size;
    t.crop_padding = P;
    t.random_flip = true;
    t.mean = {0.4914f, 0.4822f, 0.4465f};
    t.std = {0.247f, 0.243f, 0.261f};
    for (uint32_t cy = 0; cy < 2 * P + 1; ++cy)
      for (uint32_t cx = 0; cx < 2 * P + 1; ++cx)
        for (uint32_t flip = 0; flip < 2; ++flip) {
          const uint32_t random = cy | (cx << 8) | (flip << 31);
          std::vector<float> got(static_cast<size_t>(C * size * size));
          data::transform_image(src.data(), C, 9, 9, t, random, got.data());
          // The offsets as the random word gives them (its flip bit counts in the modulo).
          const int64_t oy = static_cast<int64_t>(random % (2 * P + 1)) - P,
                        ox = static_cast<int64_t>((random >> 8) % (2 * P + 1)) - P;
          const std::vector<float> want =
              transform_reference(src, C, 9, size, t, oy, ox, flip != 0);
          ASSERT_EQ(got, want) << "size " << size << " offsets " << cy << "," << cx << " flip "
                               << flip;
        }
  }
}

data::Dataset tiny(int64_t n) {
  data::SyntheticConfig c;
  c.size = n;
  c.image_size = 8;
  return data::synthetic(c, true);
}

TEST(Loader, DropLastShuffleAndOrder) {
  data::Dataset ds = tiny(50);
  data::LoaderConfig c;
  c.batch_size = 8;
  c.shuffle = false;
  data::Loader plain(ds, c);
  EXPECT_EQ(plain.batches_per_epoch(), 6);
  EXPECT_EQ(plain.batch_indices(0, 1), (std::vector<int64_t>{8, 9, 10, 11, 12, 13, 14, 15}));
  c.shuffle = true;
  data::Loader shuffled(ds, c);
  std::set<int64_t> seen;
  for (int64_t b = 0; b < 6; ++b)
    for (int64_t i : shuffled.batch_indices(0, b)) seen.insert(i);
  EXPECT_EQ(seen.size(), 48u);  // a permutation, less the dropped remainder
  EXPECT_NE(shuffled.batch_indices(0, 0), shuffled.batch_indices(1, 0));  // reshuffled per epoch
  data::Loader again(ds, c);
  EXPECT_EQ(again.batch_indices(1, 3), shuffled.batch_indices(1, 3));
  c.seed = 1;
  data::Loader other(ds, c);
  EXPECT_NE(other.batch_indices(0, 0), shuffled.batch_indices(0, 0));
  c.drop_last = false;
  EXPECT_EQ(data::Loader(ds, c).batches_per_epoch(), 7);
  c.batch_size = 51;
  c.drop_last = true;
  EXPECT_NE(error_of([&] { data::Loader l(ds, c); }).find("fewer than one batch"),
            std::string::npos);
}

TEST(Loader, WorkersGiveTheSameBatchesInOrderAndResumeMidEpoch) {
  data::Dataset ds = tiny(64);
  data::LoaderConfig c;
  c.batch_size = 4;
  c.transform.image_size = 12;
  c.transform.random_flip = true;
  c.transform.crop_padding = 2;
  c.dtype = DType::bf16;
  data::Loader sync(ds, c);  // no workers: made by next()
  std::vector<std::vector<float>> want;
  sync.start(2);
  while (auto batch = sync.next()) {
    EXPECT_EQ(batch->images.shape(), (Shape{4, 1, 12, 12}));
    EXPECT_EQ(batch->images.dtype(), DType::bf16);
    want.push_back(batch->images.to_float_vector());
    const std::vector<float> labels = batch->labels.to_float_vector();
    want.back().insert(want.back().end(), labels.begin(), labels.end());
  }
  ASSERT_EQ(want.size(), 16u);
  EXPECT_GT(sync.wait_seconds(), 0.0);  // the time spent making them
  for (int workers : {1, 2, 4})
    for (int prefetch : {1, 3}) {
      c.workers = workers;
      c.prefetch = prefetch;
      data::Loader async(ds, c);
      for (int64_t first : {0, 5}) {  // from the start, and resumed mid-epoch
        async.start(2, first);
        int64_t b = first;
        while (auto batch = async.next()) {
          EXPECT_EQ(batch->index, b);
          std::vector<float> got = batch->images.to_float_vector();
          const std::vector<float> labels = batch->labels.to_float_vector();
          got.insert(got.end(), labels.begin(), labels.end());
          EXPECT_EQ(got, want[static_cast<size_t>(b)]) << workers << " workers, batch " << b;
          ++b;
        }
        EXPECT_EQ(b, 16);
      }
      // Stopped early: the workers end, and a new epoch starts cleanly.
      async.start(0);
      ASSERT_TRUE(async.next().has_value());
      async.stop();
      async.start(2, 15);
      auto last = async.next();
      ASSERT_TRUE(last.has_value());
      EXPECT_EQ(last->index, 15);
      EXPECT_FALSE(async.next().has_value());
    }
  EXPECT_EQ(sync.batch_bytes(), 4 * 12 * 12 * 2 + 4 * 8);
}

TEST(Loader, AnErrorInAWorkerReachesTheConsumerWithItsCause) {
  data::Dataset ds = tiny(64);
  data::LoaderConfig c;
  c.batch_size = 4;
  c.transform.mean = {0.5f, 0.5f};  // two means for one channel: every batch fails
  c.transform.std = {0.5f, 0.5f};
  for (int workers : {0, 1, 3}) {
    c.workers = workers;
    data::Loader loader(ds, c);
    loader.start(0);
    const std::string e = error_of([&] { loader.next(); });
    EXPECT_NE(e.find("2 means for 1 channels"), std::string::npos) << e;
    if (workers > 0) {
      EXPECT_NE(e.find("data loader worker, batch 0 of epoch 1"), std::string::npos) << e;
    }
  }  // the destructor joins the workers that stopped on the error
}

// A user's dataset: (N, 3) f32 inputs whose values encode their index, labels index % 4.
data::TensorDataset indexed_tensors(int64_t n) {
  Tensor x = Tensor::empty({n, 3}, DType::f32);
  Tensor y = Tensor::empty({n}, DType::i64);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < 3; ++j) x.data<float>()[i * 3 + j] = static_cast<float>(10 * i + j);
    y.data<int64_t>()[i] = i % 4;
  }
  return data::TensorDataset(x, y, 4, "indexed");
}

TEST(ExampleSource, TensorDatasetChecksItsTensors) {
  Tensor x = Tensor::zeros({5, 2}, DType::f32);
  Tensor y = Tensor::zeros({5}, DType::i64);
  EXPECT_NO_THROW(data::TensorDataset(x, y, 3));
  EXPECT_NE(error_of([&] {
              data::TensorDataset(x, Tensor::zeros({4}, DType::i64), 3);
            }).find("5 inputs but 4 labels"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              data::TensorDataset(x, Tensor::zeros({5}, DType::f32), 3);
            }).find("labels must be i64 (N)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              data::TensorDataset(Tensor::zeros({5}, DType::f32), y, 3);
            }).find("at least one dimension per example"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              data::TensorDataset(Tensor::zeros({5, 2}, DType::i64), y, 3);
            }).find("must be f32, f16, bf16 or u8"),
            std::string::npos);
  Tensor bad = Tensor::zeros({5}, DType::i64);
  bad.data<int64_t>()[3] = 3;
  EXPECT_NE(error_of([&] {
              data::TensorDataset(x, bad, 3);
            }).find("label 3 of example 3 is outside [0, 3)"),
            std::string::npos);
  // An example outside the dataset is a user's error, named, not an internal one.
  const data::TensorDataset five(x, y, 3, "five");
  std::vector<float> row(2);
  for (const int64_t i : {int64_t{5}, int64_t{-1}})
    EXPECT_NE(error_of([&] {
                five.get(i, row.data());
              }).find("five: example " + std::to_string(i) + " asked of 5 examples"),
              std::string::npos)
        << i;
}

TEST(ExampleSource, LoaderBatchesExamplesAsTheyAreInTheSeededOrder) {
  auto src = std::make_shared<data::TensorDataset>(indexed_tensors(50));
  EXPECT_EQ(src->example_shape(), (Shape{3}));
  data::LoaderConfig c;
  c.batch_size = 8;
  c.seed = 7;
  data::Loader loader(src, c);
  EXPECT_EQ(loader.size(), 50);
  EXPECT_EQ(loader.batches_per_epoch(), 6);
  // The same shuffle as an image dataset of the same size and seed.
  data::Loader images(tiny(50), c);
  EXPECT_EQ(loader.batch_indices(1, 2), images.batch_indices(1, 2));
  const data::Batch b = loader.make_batch(1, 2);
  ASSERT_EQ(b.images.shape(), (Shape{8, 3}));
  const std::vector<int64_t> idx = loader.batch_indices(1, 2);
  for (int64_t i = 0; i < 8; ++i) {
    const int64_t k = idx[static_cast<size_t>(i)];
    EXPECT_EQ(b.labels.data<int64_t>()[i], k % 4);
    for (int64_t j = 0; j < 3; ++j)
      EXPECT_EQ(b.images.data<float>()[i * 3 + j], static_cast<float>(10 * k + j));
  }
  EXPECT_EQ(loader.batch_bytes(), 8 * 3 * 4 + 8 * 8);
  // In a 16-bit input type, rounded once; and the same batches from background workers.
  c.dtype = DType::bf16;
  data::Loader narrow(src, c);
  c.workers = 2;
  data::Loader async(src, c);
  async.start(1);
  for (int64_t k = 0; k < 6; ++k) {
    auto got = async.next();
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->images.dtype(), DType::bf16);
    EXPECT_EQ(got->images.to_float_vector(), narrow.make_batch(1, k).images.to_float_vector());
  }
  EXPECT_FALSE(async.next().has_value());
}

// A source written by hand, as a user would, that breaks its contract on one example.
class BrokenLabels : public data::ExampleSource {
 public:
  int64_t size() const override { return 16; }
  Shape example_shape() const override { return {2, 2}; }
  int64_t num_classes() const override { return 2; }
  int64_t get(int64_t index, float* input) const override {
    for (int i = 0; i < 4; ++i) input[i] = static_cast<float>(index);
    return index == 5 ? 2 : index % 2;
  }
  std::string name() const override { return "broken"; }
};

TEST(ExampleSource, ContractViolationsAndImageSettingsAreRefused) {
  auto src = std::make_shared<BrokenLabels>();
  data::LoaderConfig c;
  c.batch_size = 4;
  c.shuffle = false;
  data::Loader loader(src, c);
  EXPECT_EQ(loader.make_batch(0, 0).images.shape(), (Shape{4, 2, 2}));
  EXPECT_NE(error_of([&] {
              loader.make_batch(0, 1);
            }).find("broken: example 5 has label 2, outside [0, 2)"),
            std::string::npos);
  data::LoaderConfig resize = c;
  resize.transform.image_size = 8;
  EXPECT_NE(error_of([&] { data::Loader l(src, resize); }).find("are for image datasets"),
            std::string::npos);
  data::LoaderConfig bytes = c;
  bytes.dtype = DType::u8;
  EXPECT_NE(error_of([&] { data::Loader l(src, bytes); }).find("8-bit input"), std::string::npos);
}

}  // namespace
}  // namespace mantissa
