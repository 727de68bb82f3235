// The examples a run trains and evaluates on, behind one interface that makes its loaders: a
// built-in image dataset by name (TrainConfig::dataset, with its resize, augmentation and limits),
// or a user's data::ExampleSources, batched as they are.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "mantissa/data/datasets.h"
#include "mantissa/data/loader.h"
#include "mantissa/data/source.h"
#include "mantissa/train/config.h"

namespace mantissa::train {

// A built-in dataset's split (train: the training split), shortened to train_limit / test_limit;
// the synthetic dataset is made for the model's channels and image size from the seed.
data::Dataset load_split(const TrainConfig& c, bool train);

// The loader settings of a split: batch size, shuffling (training only), drop-last (training
// only), seed, workers, and the batches' dtype (`input`; u8 with 8-bit I/O). For a built-in image
// dataset of `channels` channels also the transform: the resize, augmentation (training only) and
// the normalization to [-1, 1]; `channels` 0 is a user's ExampleSource, whose examples are
// delivered as they are. Data parallelism: `rank`'s slice of each batch of `ranks` x the batch
// size (data::LoaderConfig::ranks).
data::LoaderConfig loader_config(const TrainConfig& c, DType input, bool train, int64_t channels,
                                 int64_t ranks = 1, int64_t rank = 0);

class RunData {
 public:
  // A built-in dataset: the training split is read now, the test split at each evaluation. The
  // loaders deliver `rank`'s slice of batches of `ranks` x the batch size (data parallelism).
  RunData(const TrainConfig& c, DType input, int64_t ranks = 1, int64_t rank = 0);
  // A user's examples; `test` may be null (the run is not evaluated).
  RunData(const TrainConfig& c, DType input, std::shared_ptr<const data::ExampleSource> train,
          std::shared_ptr<const data::ExampleSource> test, int64_t ranks = 1, int64_t rank = 0);

  // The training split's name ("fashion-mnist (train)", a source's name()).
  std::string name() const;
  // Built-in datasets: the images' channels and the classes, which the model is built for.
  int64_t channels() const { return train_.channels(); }
  int64_t num_classes() const { return train_.num_classes; }
  // The transform of the training images (8-bit I/O leaves its normalization to the model).
  data::Transform transform() const;

  std::unique_ptr<data::Loader> train_loader() const;
  // Whether there is a test split (a user's run may have none), and a loader of it (null if not).
  bool has_test() const { return !train_source_ || test_source_; }
  std::unique_ptr<data::Loader> test_loader() const;

 private:
  TrainConfig config_;
  DType input_;
  int64_t ranks_ = 1, rank_ = 0;
  data::Dataset train_;  // a built-in dataset's training split
  std::shared_ptr<const data::ExampleSource> train_source_, test_source_;  // or a user's
};

}  // namespace mantissa::train
