#include "mantissa/train/run_data.h"

#include <algorithm>

#include "mantissa/core/error.h"

namespace mantissa::train {

data::Dataset load_split(const TrainConfig& c, bool train) {
  data::SyntheticConfig sc;
  sc.size = train ? c.synthetic_size : std::max<int64_t>(1, c.synthetic_size / 4);
  sc.channels = nn::default_in_channels(c.model);
  sc.image_size = c.effective_image_size();
  sc.seed = c.seed;
  data::Dataset d = data::load_dataset(c.dataset, c.data_dir, train, sc);
  return d.head(train ? c.train_limit : c.test_limit);
}

data::LoaderConfig loader_config(const TrainConfig& c, DType input, bool train, int64_t channels,
                                 int64_t ranks, int64_t rank) {
  data::LoaderConfig lc;
  lc.ranks = ranks;
  lc.rank = rank;
  lc.dtype = input;
  lc.batch_size = train ? c.batch_size : c.eval_batch_size;
  lc.shuffle = train && c.shuffle;
  lc.drop_last = train;
  lc.seed = c.seed;
  if (channels > 0) {
    lc.transform.image_size = c.effective_image_size();
    lc.transform.crop_padding = train && c.augment ? 4 : 0;
    lc.transform.random_flip = train && c.augment;
    lc.transform.mean = std::vector<float>(static_cast<size_t>(channels), 0.5f);
    lc.transform.std = std::vector<float>(static_cast<size_t>(channels), 0.5f);
  }
  lc.prefetch = c.prefetch;
  lc.workers = c.async_loader ? c.workers : 0;
  return lc;
}

RunData::RunData(const TrainConfig& c, DType input, int64_t ranks, int64_t rank)
    : config_(c), input_(input), ranks_(ranks), rank_(rank), train_(load_split(c, true)) {}

RunData::RunData(const TrainConfig& c, DType input,
                 std::shared_ptr<const data::ExampleSource> train,
                 std::shared_ptr<const data::ExampleSource> test, int64_t ranks, int64_t rank)
    : config_(c),
      input_(input),
      ranks_(ranks),
      rank_(rank),
      train_source_(std::move(train)),
      test_source_(std::move(test)) {
  MANTISSA_ASSERT(train_source_ != nullptr, "a run without training data");
}

std::string RunData::name() const { return train_source_ ? train_source_->name() : train_.name; }

data::Transform RunData::transform() const {
  MANTISSA_ASSERT(!train_source_, "a user's examples have no image transform");
  return loader_config(config_, input_, true, channels()).transform;
}

std::unique_ptr<data::Loader> RunData::train_loader() const {
  if (train_source_)
    return std::make_unique<data::Loader>(train_source_,
                                          loader_config(config_, input_, true, 0, ranks_, rank_));
  return std::make_unique<data::Loader>(
      train_, loader_config(config_, input_, true, channels(), ranks_, rank_));
}

std::unique_ptr<data::Loader> RunData::test_loader() const {
  if (train_source_)
    return test_source_ ? std::make_unique<data::Loader>(
                              test_source_, loader_config(config_, input_, false, 0, ranks_, rank_))
                        : nullptr;
  const data::Dataset test = load_split(config_, false);
  return std::make_unique<data::Loader>(
      test, loader_config(config_, input_, false, test.channels(), ranks_, rank_));
}

}  // namespace mantissa::train
