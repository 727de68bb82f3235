// A user's own dataset: examples by index. The loader batches them exactly as it batches the
// built-in image datasets (seeded shuffle, drop-last, background workers, batches in order), so
// a model trained on one gets every lever, report and checkpoint the built-in models get.
//
//   class MyData : public data::ExampleSource {
//     int64_t size() const override { return 1000; }
//     Shape example_shape() const override { return {16}; }  // one example, no batch dimension
//     int64_t num_classes() const override { return 4; }
//     int64_t get(int64_t i, float* input) const override { ...; return label; }
//   };
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "mantissa/core/tensor.h"

namespace mantissa::data {

class ExampleSource {
 public:
  virtual ~ExampleSource() = default;
  virtual int64_t size() const = 0;
  // The shape of one example's input, without the batch dimension: (F), (C, H, W), ...
  virtual Shape example_shape() const = 0;
  virtual int64_t num_classes() const = 0;
  // Writes example `index`'s input as numel(example_shape()) FP32 values, row-major, to `input`
  // and returns its class label in [0, num_classes()). Loader workers call it concurrently from
  // several threads: it must not modify shared state.
  virtual int64_t get(int64_t index, float* input) const = 0;
  // For messages: "my dataset (train)".
  virtual std::string name() const { return "custom dataset"; }
};

// Examples held in memory: inputs (N, ...) in f32, f16, bf16 or u8 (widened to FP32 as they
// are, not scaled) and labels i64 (N) in [0, num_classes).
class TensorDataset : public ExampleSource {
 public:
  // Checks the shapes, the dtypes and every label; throws mantissa::Error naming the fault.
  TensorDataset(Tensor inputs, Tensor labels, int64_t num_classes,
                std::string name = "tensor dataset");
  int64_t size() const override { return labels_.size(0); }
  Shape example_shape() const override;
  int64_t num_classes() const override { return num_classes_; }
  int64_t get(int64_t index, float* input) const override;
  std::string name() const override { return name_; }

 private:
  Tensor inputs_;  // (N, ...) contiguous
  Tensor labels_;  // i64 (N)
  int64_t num_classes_;
  int64_t example_numel_ = 0;
  std::string name_;
};

}  // namespace mantissa::data
