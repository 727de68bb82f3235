#include "mantissa/data/source.h"

#include "mantissa/core/convert.h"
#include "mantissa/core/error.h"

namespace mantissa::data {

TensorDataset::TensorDataset(Tensor inputs, Tensor labels, int64_t num_classes, std::string name)
    : num_classes_(num_classes), name_(std::move(name)) {
  MANTISSA_CHECK(inputs.defined() && labels.defined(), name_ + ": inputs or labels are undefined",
                 "pass an (N, ...) input tensor and an i64 (N) label tensor");
  MANTISSA_CHECK(inputs.dim() >= 2,
                 name_ + ": inputs must be (N, ...) with at least one dimension per example, got " +
                     shape_str(inputs.shape()),
                 "add the example dimensions, e.g. reshape (N) to (N, 1)");
  MANTISSA_CHECK(inputs.dtype() == DType::f32 || inputs.dtype() == DType::f16 ||
                     inputs.dtype() == DType::bf16 || inputs.dtype() == DType::u8,
                 name_ + ": inputs must be f32, f16, bf16 or u8, got " +
                     std::string(dtype_name(inputs.dtype())),
                 "convert them with cast() first");
  MANTISSA_CHECK(labels.dtype() == DType::i64 && labels.dim() == 1,
                 name_ + ": labels must be i64 (N), got " +
                     std::string(dtype_name(labels.dtype())) + " " + shape_str(labels.shape()),
                 "pass one int64 class index per example");
  MANTISSA_CHECK(labels.size(0) == inputs.size(0),
                 name_ + ": " + std::to_string(inputs.size(0)) + " inputs but " +
                     std::to_string(labels.size(0)) + " labels",
                 "pass one label per example");
  MANTISSA_CHECK(labels.size(0) > 0, name_ + " is empty", "pass at least one example");
  MANTISSA_CHECK(num_classes > 0, name_ + ": the class count must be positive", "");
  inputs_ = inputs.contiguous();
  labels_ = labels.contiguous();
  const int64_t* l = labels_.data<int64_t>();
  for (int64_t i = 0; i < labels_.size(0); ++i)
    MANTISSA_CHECK(l[i] >= 0 && l[i] < num_classes,
                   name_ + ": label " + std::to_string(l[i]) + " of example " + std::to_string(i) +
                       " is outside [0, " + std::to_string(num_classes) + ")",
                   "labels are class indices from 0 to the class count - 1");
  example_numel_ = inputs_.numel() / inputs_.size(0);
}

Shape TensorDataset::example_shape() const {
  const Shape& s = inputs_.shape();
  return Shape(s.begin() + 1, s.end());
}

int64_t TensorDataset::get(int64_t index, float* input) const {
  MANTISSA_CHECK(index >= 0 && index < size(),
                 name_ + ": example " + std::to_string(index) + " asked of " +
                     std::to_string(size()) + " examples",
                 "ask for an example from 0 to size() - 1");
  const size_t esize = dtype_size(inputs_.dtype());
  const char* src = static_cast<const char*>(inputs_.data_ptr()) +
                    static_cast<size_t>(index * example_numel_) * esize;
  convert(src, inputs_.dtype(), input, DType::f32, static_cast<size_t>(example_numel_));
  return labels_.data<int64_t>()[index];
}

}  // namespace mantissa::data
