#include "mantissa/data/loader.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <new>

#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/core/philox.h"
#include "mantissa/kernels/elementwise.h"

namespace mantissa::data {
namespace {

constexpr uint64_t kShuffleStream = 0x5348554600000000ull;  // "SHUF"
constexpr uint64_t kAugmentStream = 0x4155474d00000000ull;  // "AUGM"

// PyTorch's upsample_bilinear2d (align_corners=False) taps for one axis: source index, next
// index offset and the weight of the second tap, computed in float as its CPU kernel does.
struct Taps {
  std::vector<int64_t> i0, step;
  std::vector<float> lambda;
};
Taps bilinear_taps(int64_t in, int64_t out) {
  Taps t;
  const float scale = static_cast<float>(in) / static_cast<float>(out);
  for (int64_t o = 0; o < out; ++o) {
    float src = scale * (static_cast<float>(o) + 0.5f) - 0.5f;
    if (src < 0) src = 0;
    const int64_t i = static_cast<int64_t>(src);
    t.i0.push_back(i);
    t.step.push_back(i < in - 1 ? 1 : 0);
    t.lambda.push_back(src - static_cast<float>(i));
  }
  return t;
}

// The batch size and the slice of each global batch, for a dataset of n examples.
void check_slices(const LoaderConfig& c, int64_t n, const std::string& name, const char* fix) {
  MANTISSA_CHECK(c.ranks >= 1 && c.rank >= 0 && c.rank < c.ranks,
                 "loader slice " + std::to_string(c.rank) + " of " + std::to_string(c.ranks) +
                     " is out of range",
                 "rank must lie in [0, ranks)");
  const int64_t global = c.batch_size * c.ranks;
  MANTISSA_CHECK(!c.drop_last || n >= global,
                 "dataset " + name + " has " + std::to_string(n) + " examples, fewer than one " +
                     (c.ranks > 1 ? "global batch of " + std::to_string(c.ranks) + " ranks x " +
                                        std::to_string(c.batch_size)
                                  : "batch of " + std::to_string(c.batch_size)),
                 fix);
}

}  // namespace

void transform_image(const uint8_t* src, int64_t C, int64_t H, int64_t W, const Transform& t,
                     uint32_t random, float* dst) {
  const int64_t S = t.image_size > 0 ? t.image_size : H;
  const int64_t SW = t.image_size > 0 ? t.image_size : W;
  MANTISSA_CHECK(t.mean.size() == 1 || static_cast<int64_t>(t.mean.size()) == C,
                 "normalization has " + std::to_string(t.mean.size()) + " means for " +
                     std::to_string(C) + " channels",
                 "give one mean per channel, or one for all");
  MANTISSA_CHECK(t.std.size() == t.mean.size(), "normalization needs as many std values as means",
                 "");
  // A pixel in [0, 1]: the byte divided by 255 (one division per byte value, not per pixel).
  static const std::array<float, 256> kUnit = [] {
    std::array<float, 256> u{};
    for (int v = 0; v < 256; ++v) u[static_cast<size_t>(v)] = static_cast<float>(v) / 255.0f;
    return u;
  }();
  // Resized image in [0, 1] (C, S, SW), when the size changes.
  const bool resize = S != H || SW != W;
  std::vector<float> resized;
  if (resize) {
    std::vector<float> unit(static_cast<size_t>(C * H * W));
    for (int64_t i = 0; i < C * H * W; ++i) unit[static_cast<size_t>(i)] = kUnit[src[i]];
    resized.resize(static_cast<size_t>(C * S * SW));
    const Taps th = bilinear_taps(H, S), tw = bilinear_taps(W, SW);
    for (int64_t c = 0; c < C; ++c)
      for (int64_t y = 0; y < S; ++y) {
        const float* r0 = unit.data() + (c * H + th.i0[static_cast<size_t>(y)]) * W;
        const float* r1 = r0 + th.step[static_cast<size_t>(y)] * W;
        const float h1 = th.lambda[static_cast<size_t>(y)], h0 = 1.0f - h1;
        for (int64_t x = 0; x < SW; ++x) {
          const int64_t x0 = tw.i0[static_cast<size_t>(x)], xs = tw.step[static_cast<size_t>(x)];
          const float w1 = tw.lambda[static_cast<size_t>(x)], w0 = 1.0f - w1;
          resized[static_cast<size_t>((c * S + y) * SW + x)] =
              h0 * (w0 * r0[x0] + w1 * r0[x0 + xs]) + h1 * (w0 * r1[x0] + w1 * r1[x0 + xs]);
        }
      }
  }
  // Crop offsets and flip from the random word: output (y, x) reads source row y + oy and
  // column (flip ? SW - 1 - x : x) + ox, zero (before normalization) outside the image.
  int64_t oy = 0, ox = 0;
  const int64_t P = t.crop_padding;
  if (P > 0) {
    oy = static_cast<int64_t>(random % static_cast<uint32_t>(2 * P + 1)) - P;
    ox = static_cast<int64_t>((random >> 8) % static_cast<uint32_t>(2 * P + 1)) - P;
  }
  const bool flip = t.random_flip && ((random >> 31) & 1u);
  // The columns x whose source column lies in the image: [x0, x1).
  const int64_t x0 = std::clamp<int64_t>(flip ? ox : -ox, 0, SW),
                x1 = std::clamp<int64_t>(flip ? SW + ox : SW - ox, x0, SW);
  for (int64_t c = 0; c < C; ++c) {
    const size_t k = t.mean.size() == 1 ? 0 : static_cast<size_t>(c);
    const float mean = t.mean[k], sd = t.std[k];
    // Each value normalized as (v - mean) / sd; without a resize, once per byte value.
    const float pad = (0.0f - mean) / sd;
    std::array<float, 256> norm{};
    if (!resize)
      for (size_t v = 0; v < 256; ++v) norm[v] = (kUnit[v] - mean) / sd;
    for (int64_t y = 0; y < S; ++y) {
      float* out = dst + (c * S + y) * SW;
      const int64_t sy = y + oy;
      if (sy < 0 || sy >= S) {
        std::fill(out, out + SW, pad);
        continue;
      }
      std::fill(out, out + x0, pad);
      std::fill(out + x1, out + SW, pad);
      if (resize) {
        const float* row = resized.data() + (c * S + sy) * SW;
        if (flip)
          for (int64_t x = x0; x < x1; ++x) out[x] = (row[SW - 1 - x + ox] - mean) / sd;
        else
          for (int64_t x = x0; x < x1; ++x) out[x] = (row[x + ox] - mean) / sd;
      } else {
        const uint8_t* row = src + (c * S + sy) * SW;
        if (flip)
          for (int64_t x = x0; x < x1; ++x) out[x] = norm[row[SW - 1 - x + ox]];
        else
          for (int64_t x = x0; x < x1; ++x) out[x] = norm[row[x + ox]];
      }
    }
  }
}

Loader::Loader(const Dataset& data, const LoaderConfig& config) : data_(data), config_(config) {
  MANTISSA_CHECK(config.batch_size > 0,
                 "batch size " + std::to_string(config.batch_size) + " is not positive",
                 "use --batch-size 1 or more");
  MANTISSA_CHECK(data.size() > 0, "dataset " + data.name + " is empty", "");
  check_slices(config, data.size(), data.name,
               "lower --batch-size, or use more examples (--train-limit, --synthetic-size)");
  MANTISSA_CHECK(config.transform.crop_padding >= 0, "crop padding must be non-negative", "");
  MANTISSA_CHECK(config.dtype == DType::u8 || is_compute_float(config.dtype),
                 "the loader cannot deliver " + std::string(dtype_name(config.dtype)) + " images",
                 "use u8 (8-bit I/O), f32, f16 or bf16");
  out_size_ = config.transform.image_size > 0 ? config.transform.image_size : data.height();
  MANTISSA_CHECK(config.transform.image_size > 0 || data.height() == data.width(),
                 "dataset images are not square", "set an image size");
}

Loader::Loader(std::shared_ptr<const ExampleSource> source, const LoaderConfig& config)
    : source_(std::move(source)), config_(config) {
  MANTISSA_CHECK(source_ != nullptr, "the loader got no dataset", "pass an ExampleSource");
  const std::string name = source_->name();
  MANTISSA_CHECK(config.batch_size > 0,
                 "batch size " + std::to_string(config.batch_size) + " is not positive",
                 "use --batch-size 1 or more");
  MANTISSA_CHECK(source_->size() > 0, "dataset " + name + " is empty", "");
  check_slices(config, source_->size(), name, "lower the batch size, or use more examples");
  MANTISSA_CHECK(config.transform.image_size == 0 && config.transform.crop_padding == 0 &&
                     !config.transform.random_flip,
                 "dataset " + name + ": resizing, cropping and flipping are for image datasets",
                 "transform the examples in your ExampleSource::get instead");
  MANTISSA_CHECK(is_compute_float(config.dtype),
                 "dataset " + name +
                     ": the loader delivers user examples in f32, f16 or bf16, not " +
                     std::string(dtype_name(config.dtype)),
                 "8-bit input is for the built-in image datasets");
  const Shape shape = source_->example_shape();
  int64_t numel = 1;
  for (int64_t d : shape) {
    MANTISSA_CHECK(d > 0,
                   "dataset " + name + ": example shape " + shape_str(shape) +
                       " has a dimension that is not positive",
                   "");
    numel *= d;
  }
  MANTISSA_CHECK(!shape.empty(), "dataset " + name + ": example shape is empty",
                 "give each example at least one dimension, e.g. (1)");
  out_size_ = numel;
}

Loader::~Loader() { stop(); }

int64_t Loader::batches_per_epoch() const {
  const int64_t n = size(), b = config_.batch_size, g = b * config_.ranks;
  if (config_.drop_last) return n / g;
  // The global batches whose slice for this rank starts inside the dataset.
  const int64_t first = config_.rank * b;
  return n > first ? (n - first + g - 1) / g : 0;
}

std::vector<int64_t> Loader::batch_indices(int64_t epoch, int64_t b) const {
  const int64_t n = size();
  const int64_t begin =
      std::min(n, b * config_.batch_size * config_.ranks + config_.rank * config_.batch_size);
  const int64_t end = std::min(n, begin + config_.batch_size);
  std::vector<int64_t> idx;
  if (!config_.shuffle) {
    for (int64_t i = begin; i < end; ++i) idx.push_back(i);
    return idx;
  }
  // Fisher-Yates over the whole epoch from (seed, epoch), cached for the epoch.
  std::lock_guard<std::mutex> lock(perm_mu_);
  std::vector<int64_t>& perm = perm_;
  if (perm_epoch_ != epoch) {
    const uint64_t stream = kShuffleStream + static_cast<uint64_t>(epoch);
    perm.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) perm[static_cast<size_t>(i)] = i;
    for (int64_t i = n - 1; i > 0; --i) {
      const uint64_t k = 2 * static_cast<uint64_t>(i);
      const uint64_t r = (static_cast<uint64_t>(philox_bits(config_.seed, stream, k)) << 32) |
                         philox_bits(config_.seed, stream, k + 1);
      const int64_t j = static_cast<int64_t>(r % static_cast<uint64_t>(i + 1));
      std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(j)]);
    }
    perm_epoch_ = epoch;
  }
  for (int64_t i = begin; i < end; ++i) idx.push_back(perm[static_cast<size_t>(i)]);
  return idx;
}

Batch Loader::make_batch(int64_t epoch, int64_t b) const {
  MANTISSA_CHECK(b >= 0 && b < batches_per_epoch(),
                 "batch " + std::to_string(b) + " is out of range", "");
  const std::vector<int64_t> idx = batch_indices(epoch, b);
  if (source_) return make_source_batch(epoch, b, idx);
  const int64_t B = static_cast<int64_t>(idx.size()), C = data_.channels(), H = data_.height(),
                W = data_.width();
  const int64_t S = out_size_;
  Batch out;
  out.epoch = epoch;
  out.index = b;
  out.labels = Tensor::empty({B}, DType::i64, charged_to(MemoryCategory::input_data));
  out.images = Tensor::empty({B, C, S, S}, config_.dtype, charged_to(MemoryCategory::input_data));
  const Tensor images = data_.images.contiguous();  // held: src must outlive a copy
  const uint8_t* src = static_cast<const uint8_t*>(images.data_ptr());
  const int64_t* labels = data_.labels.data<int64_t>();
  const size_t elem = dtype_size(config_.dtype);
  char* dst = static_cast<char*>(out.images.data_ptr());
  // 8-bit output: the geometric transforms on [0, 1] pixels, then the nearest of 0..255; the
  // model normalizes (Classifier::set_input_normalization).
  const bool bytes = config_.dtype == DType::u8;
  Transform t = config_.transform;
  if (bytes) t.mean = {0.0f}, t.std = {1.0f};
  // Images in parallel (each depends only on its index; a loader worker's call, made while the
  // step's kernels hold the pool, runs them in order on its own thread).
  parallel_for(static_cast<size_t>(B), 1, default_num_threads(), [&](size_t i0, size_t i1) {
    std::vector<float> buf(static_cast<size_t>(C * S * S));  // (C, S, S)
    for (int64_t i = static_cast<int64_t>(i0); i < static_cast<int64_t>(i1); ++i) {
      const int64_t k = idx[static_cast<size_t>(i)];
      out.labels.data<int64_t>()[i] = labels[k];
      const uint32_t random = philox_bits(
          config_.seed, kAugmentStream + static_cast<uint64_t>(epoch), static_cast<uint64_t>(k));
      transform_image(src + k * C * H * W, C, H, W, t, random, buf.data());
      if (bytes) {
        uint8_t* d = reinterpret_cast<uint8_t*>(dst) + i * C * S * S;
        for (int64_t j = 0; j < C * S * S; ++j)
          d[j] = static_cast<uint8_t>(
              std::lrint(std::clamp(buf[static_cast<size_t>(j)] * 255.0f, 0.0f, 255.0f)));
      } else {
        kernels::store_f32(buf.data(), C * S * S, dst + static_cast<size_t>(i * C * S * S) * elem,
                           config_.dtype, 1);
      }
    }
  });
  return out;
}

Batch Loader::make_source_batch(int64_t epoch, int64_t b, const std::vector<int64_t>& idx) const {
  const int64_t B = static_cast<int64_t>(idx.size()), E = out_size_;  // E: values per example
  const int64_t classes = source_->num_classes();
  Shape shape = source_->example_shape();
  shape.insert(shape.begin(), B);
  Batch out;
  out.epoch = epoch;
  out.index = b;
  out.labels = Tensor::empty({B}, DType::i64, charged_to(MemoryCategory::input_data));
  out.images = Tensor::empty(shape, config_.dtype, charged_to(MemoryCategory::input_data));
  std::vector<float> buf(static_cast<size_t>(E));
  const size_t elem = dtype_size(config_.dtype);
  char* dst = static_cast<char*>(out.images.data_ptr());
  for (int64_t i = 0; i < B; ++i) {
    const int64_t k = idx[static_cast<size_t>(i)];
    const int64_t label = source_->get(k, buf.data());
    MANTISSA_CHECK(label >= 0 && label < classes,
                   source_->name() + ": example " + std::to_string(k) + " has label " +
                       std::to_string(label) + ", outside [0, " + std::to_string(classes) + ")",
                   "ExampleSource::get must return a class index below num_classes()");
    out.labels.data<int64_t>()[i] = label;
    kernels::store_f32(buf.data(), E, dst + static_cast<size_t>(i * E) * elem, config_.dtype, 1);
  }
  return out;
}

int64_t Loader::batch_bytes() const {
  if (source_)
    return config_.batch_size * out_size_ * static_cast<int64_t>(dtype_size(config_.dtype)) +
           config_.batch_size * static_cast<int64_t>(sizeof(int64_t));
  return config_.batch_size * data_.channels() * out_size_ * out_size_ *
             static_cast<int64_t>(dtype_size(config_.dtype)) +
         config_.batch_size * static_cast<int64_t>(sizeof(int64_t));
}

void Loader::start(int64_t epoch, int64_t first_batch) {
  stop();
  epoch_ = epoch;
  next_batch_ = first_batch;
  end_batch_ = batches_per_epoch();
  ready_.clear();
  error_ = nullptr;
  stopping_ = false;
  produce_next_ = first_batch;
  const int workers = config_.prefetch > 0 ? config_.workers : 0;
  for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { worker(); });
}

void Loader::worker() {
  for (;;) {
    int64_t b;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // At most `prefetch` batches ahead of the one the consumer waits for.
      cv_.wait(lock, [&] {
        return stopping_ || error_ || produce_next_ < next_batch_ + config_.prefetch;
      });
      if (stopping_ || error_ || produce_next_ >= end_batch_) return;
      b = produce_next_++;
    }
    try {
      Batch batch = make_batch(epoch_, b);
      std::lock_guard<std::mutex> lock(mu_);
      ready_.emplace(b, std::move(batch));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_ || b < error_batch_) {
        error_ = std::current_exception();
        error_batch_ = b;
      }
      cv_.notify_all();
      return;
    }
    cv_.notify_all();
  }
}

namespace {
[[noreturn]] void rethrow_worker_error(const std::exception_ptr& e, int64_t epoch, int64_t b) {
  const std::string where = "data loader worker, batch " + std::to_string(b) + " of epoch " +
                            std::to_string(epoch + 1) + ": ";
  try {
    std::rethrow_exception(e);
  } catch (const OutOfMemoryError&) {
    throw;  // its report is the message
  } catch (const std::bad_alloc&) {
    throw;  // out of memory too (exit status 3), not a fault of the data
  } catch (const Error& err) {
    throw Error(where + err.message(), err.hint());
  } catch (const std::exception& err) {
    throw Error(where + err.what(), "check the dataset files and the transform settings");
  }
}
}  // namespace

std::optional<Batch> Loader::next() {
  if (next_batch_ >= end_batch_) return std::nullopt;
  const auto t0 = std::chrono::steady_clock::now();
  auto waited = [&] {
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (threads_.empty()) {
    Batch b = make_batch(epoch_, next_batch_++);
    waited();
    return b;
  }
  std::unique_lock<std::mutex> lock(mu_);
  const int64_t want = next_batch_;
  cv_.wait(lock, [&] { return ready_.count(want) || (error_ && error_batch_ <= want); });
  waited();
  if (!ready_.count(want)) rethrow_worker_error(error_, epoch_, error_batch_);
  Batch b = std::move(ready_.at(want));
  ready_.erase(want);
  ++next_batch_;
  cv_.notify_all();
  return b;
}

void Loader::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

}  // namespace mantissa::data
