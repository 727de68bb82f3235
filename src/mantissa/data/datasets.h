// Datasets held in memory as 8-bit images: readers for the IDX format (MNIST, Fashion-MNIST; gzip
// or raw) and the CIFAR-10 binary format, and a seeded synthetic dataset that a model can learn.
// Every reader validates magic numbers, sizes and counts and names the file and the fault.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mantissa/core/tensor.h"

namespace mantissa::data {

struct Dataset {
  std::string name;  // "fashion-mnist (train)", for messages
  Tensor images;     // u8 (N, C, H, W)
  Tensor labels;     // i64 (N), in [0, num_classes)
  int64_t num_classes = 10;
  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
  int64_t channels() const { return images.size(1); }
  int64_t height() const { return images.size(2); }
  int64_t width() const { return images.size(3); }
  // The first n examples (all when n <= 0 or n >= size()).
  Dataset head(int64_t n) const;
};

// The contents of one IDX file: u8 data with the file's dimensions. Gzip-compressed files are
// recognised by their magic bytes.
Tensor read_idx(const std::string& path);
// An images file (N, H, W) and a labels file (N) of the same count.
Dataset load_idx(const std::string& images_path, const std::string& labels_path,
                 const std::string& name);
// MNIST or Fashion-MNIST from a directory holding {train,t10k}-{images-idx3,labels-idx1}-ubyte
// (with or without .gz).
Dataset load_mnist_dir(const std::string& dir, bool train, const std::string& name);
// CIFAR-10 from a directory holding data_batch_1..5.bin and test_batch.bin (or its
// cifar-10-batches-bin sub-directory).
Dataset load_cifar10(const std::string& dir, bool train);

struct SyntheticConfig {
  int64_t size = 1024;  // examples
  int64_t channels = 1;
  int64_t image_size = 28;
  int64_t num_classes = 10;
  uint64_t seed = 0;
};
// Images of class-specific oriented waves plus noise: learnable, reproducible from the seed. The
// test split uses another stream than the training split.
Dataset synthetic(const SyntheticConfig& c, bool train);

// "fashion-mnist", "mnist", "cifar10", "synthetic".
std::vector<std::string> dataset_names();
// Where a dataset is looked for when --data-dir is not given (Debian's package for
// Fashion-MNIST: /usr/share/datasets/fashion-mnist).
std::string default_data_dir(const std::string& dataset);
// Loads by name; for "synthetic" the config gives the shape.
Dataset load_dataset(const std::string& name, const std::string& dir, bool train,
                     const SyntheticConfig& synthetic_config = {});

}  // namespace mantissa::data
