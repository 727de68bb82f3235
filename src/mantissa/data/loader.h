// From 8-bit images to training batches: transforms (bilinear resize with PyTorch's
// F.interpolate(mode="bilinear", align_corners=False) arithmetic, random crop with zero padding,
// random horizontal flip, per-channel normalization, conversion to the input dtype), seeded
// shuffling, batching with drop-last, and a background thread that prepares the next batches.
//
// Every random choice is a function of (seed, epoch, position), so batch b of epoch e is the same
// whether it is made in order, by another thread, or after resuming from a checkpoint.
//
// Data parallelism: with `ranks` > 1 the loader of rank r delivers the r-th slice of each global
// batch of ranks x batch_size examples, taken from the one seeded order of the epoch. The ranks
// together see the images one process sees with a batch ranks x batch_size (or with
// ranks x batch_size split into gradient-accumulation micro-batches of batch_size), in the same
// order, each with the same augmentation.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "mantissa/data/datasets.h"
#include "mantissa/data/source.h"

namespace mantissa::data {

struct Transform {
  int64_t image_size = 0;    // output height and width (0: the dataset's); bilinear resize
  int64_t crop_padding = 0;  // > 0: random crop of image_size after zero-padding by this much
  bool random_flip = false;  // horizontal, probability 1/2
  std::vector<float> mean = {0.5f};  // per channel (one value: all channels), on [0, 1] pixels
  std::vector<float> std = {0.5f};
};

// One image: u8 (C, H, W) -> (C, S, S) floats, S = t.image_size. `random` drives crop and flip.
void transform_image(const uint8_t* src, int64_t C, int64_t H, int64_t W, const Transform& t,
                     uint32_t random, float* dst);

struct LoaderConfig {
  int64_t batch_size = 12;
  bool shuffle = true;
  bool drop_last = true;
  uint64_t seed = 0;
  Transform transform;
  // Of the image batches. u8: the geometric transforms only (resize rounded to the nearest
  // integer, crop, flip); normalization and the cast are left to the model (8-bit I/O).
  DType dtype = DType::f32;
  // Background workers that prepare batches while the step runs (0: each batch is made by the
  // caller of next()). Whatever their number, next() returns batches in order.
  int workers = 0;
  int prefetch = 2;  // with workers: batches made ahead of the consumer at most (queue depth)
  // This process's slice of each global batch (data parallelism): global batch b holds positions
  // [b * G, (b + 1) * G) of the epoch's order, G = ranks * batch_size, and rank `rank` takes
  // [b * G + rank * batch_size, + batch_size) of them (fewer, or none, in a last partial batch
  // without drop_last).
  int64_t ranks = 1, rank = 0;
};

struct Batch {
  Tensor images;  // (B, C, S, S) in LoaderConfig::dtype; from an ExampleSource (B, example_shape)
  Tensor labels;  // i64 (B)
  int64_t epoch = 0, index = 0;
};

class Loader {
 public:
  Loader(const Dataset& data, const LoaderConfig& config);
  // A user's dataset: its examples batched as they are (the transform must be the default: no
  // resize, crop or flip; no 8-bit output), shuffled and delivered like a built-in dataset's.
  Loader(std::shared_ptr<const ExampleSource> source, const LoaderConfig& config);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  // Batches this rank delivers in an epoch: with drop_last, the whole global batches; without,
  // those whose slice for this rank holds an example.
  int64_t batches_per_epoch() const;
  // The built-in image dataset (empty for an ExampleSource).
  const Dataset& dataset() const { return data_; }
  // Examples in the dataset or source.
  int64_t size() const { return source_ ? source_->size() : data_.size(); }
  // The dataset positions of the examples of batch b of `epoch` (shuffled when configured): this
  // rank's slice of global batch b.
  std::vector<int64_t> batch_indices(int64_t epoch, int64_t b) const;
  // Makes batch b of `epoch` on the calling thread.
  Batch make_batch(int64_t epoch, int64_t b) const;

  // Iteration: start(epoch, first) then next() until it returns nothing at the end of the
  // epoch. Seconds next() spent waiting for a batch that was not ready (with no workers: making
  // it): wait_seconds(). An error in a worker is rethrown by next() as mantissa::Error naming
  // the batch and the cause. stop() ends the workers (the destructor does too).
  void start(int64_t epoch, int64_t first_batch = 0);
  std::optional<Batch> next();
  void stop();
  double wait_seconds() const { return wait_seconds_; }
  // Bytes of one batch as the loader hands it over (images and labels).
  int64_t batch_bytes() const;

 private:
  void worker();
  Batch make_source_batch(int64_t epoch, int64_t b, const std::vector<int64_t>& idx) const;

  Dataset data_;
  std::shared_ptr<const ExampleSource> source_;  // or a user's dataset
  LoaderConfig config_;
  int64_t out_size_;  // image datasets: the output side S; a source: values per example
  // Iteration state.
  int64_t epoch_ = 0, next_batch_ = 0, end_batch_ = 0;
  double wait_seconds_ = 0;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, Batch> ready_;  // made, by batch index
  int64_t produce_next_ = 0;        // the next batch index a worker claims
  bool stopping_ = false;
  std::exception_ptr error_;  // the first failure, for batch error_batch_
  int64_t error_batch_ = 0;
  // The shuffled order of the current epoch.
  mutable std::mutex perm_mu_;
  mutable std::vector<int64_t> perm_;
  mutable int64_t perm_epoch_ = -1;
};

}  // namespace mantissa::data
