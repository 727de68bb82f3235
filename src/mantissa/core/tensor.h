// Tensors: a dtype, a shape and strides (in elements) over shared, accounted storage. Views
// (view, transpose, permute, narrow, select, expand) share storage; contiguous() and to() copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mantissa/core/convert.h"
#include "mantissa/core/dtype.h"
#include "mantissa/core/memory.h"

namespace mantissa {

namespace autograd {
class Node;  // defined by the autograd layer; core only holds pointers to it
}
class Tensor;

enum class DeviceType : uint8_t { kCpu, kCuda };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;
  bool operator==(const Device&) const = default;
  std::string str() const;
};

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "(2, 3, 4)"
// The number of elements of `shape`. Throws mantissa::Error naming the shape if a dimension is
// negative or if the product of its dimensions (a zero counted as one) does not fit in int64_t:
// every shape a tensor takes passes this check, so no partial product of its dimensions (a
// stride, a row count, a flattened size) can overflow either.
int64_t shape_numel(const Shape& shape);

// A block of device memory, charged to a tracker under a category and owner until freed.
class Storage {
 public:
  // Throws OutOfMemoryError if over the tracker's budget, mantissa::Error for an unavailable
  // device.
  static std::shared_ptr<Storage> allocate(size_t bytes, MemoryCategory category,
                                           std::string owner = {}, Device device = {},
                                           MemoryTracker* tracker = nullptr);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemoryCategory category() const { return category_; }
  const std::string& owner() const { return owner_; }
  Device device() const { return device_; }
  MemoryTracker* tracker() const { return tracker_; }
  // Moves the accounting of these bytes to another category/owner (a buffer that changes role).
  void recharge(MemoryCategory category, std::string owner);

 private:
  Storage() = default;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemoryCategory category_ = MemoryCategory::workspace;
  std::string owner_;
  Device device_;
  MemoryTracker* tracker_ = nullptr;
};

struct TensorOptions {
  MemoryCategory category = MemoryCategory::workspace;
  std::string owner;  // for memory reports: module path or buffer name
  Device device;
  MemoryTracker* tracker = nullptr;  // nullptr: the device's default tracker
};
// Options charging a new tensor to `category` (default device and tracker, no owner).
inline TensorOptions charged_to(MemoryCategory category) {
  TensorOptions o;
  o.category = category;
  return o;
}

// Consumes elements [begin, begin + n) of a flat gradient: n values of `dtype` (the type the op
// would have returned the gradient in) contiguous at g. It may be called from several threads at
// once for disjoint parts; each element must be given exactly once.
using GradPartConsumer = std::function<void(int64_t begin, int64_t n, const void* g, DType dtype)>;
// Gives every part of a gradient to a consumer, computing the parts anew on each call (the same
// bits each time): a gradient kept as what computes it instead of as its values.
using GradPartProducer = std::function<void(const GradPartConsumer& consume)>;
// Takes a gradient as its producer, with an upper bound of |v| over the values it gives
// (+infinity when none is known): AutogradMeta::defer_grad_parts.
using GradPartDeferral = std::function<void(GradPartProducer produce, double bound)>;
// A weight gradient that is the product of two factors (a linear layer's dW = dY^T X): computes
// the product of `a` and `b` as the op would for its own batch.
using FactorProduct = std::function<Tensor(const Tensor& a, const Tensor& b)>;
// What an op hands AutogradMeta::gather_grad_factors (defined after Tensor).
struct GradFactorCall;

// Autograd state of a tensor, shared by every copy of the Tensor handle (not by views, which are
// new tensors). A leaf that requires grad accumulates into `grad`; a computed tensor points to the
// node that made it.
struct AutogradMeta {
  bool requires_grad = false;
  std::unique_ptr<Tensor> grad;  // same shape as the tensor; dtype: grad_dtype
  // The type gradients accumulate in (PopTorch's accum_type); the tensor's own when unset.
  std::optional<DType> grad_dtype;
  // A leaf's own type, which ops compute its gradient in (also when a 16-bit stand-in of the
  // leaf was what they read; see Tensor::stand_in_for).
  DType dtype = DType::f32;
  // A parameter stored in FP32 that the ops of a forward pass read as its 16-bit values (f16 or
  // bf16) while an ops::ReadAsScope is alive, and whose gradient they compute in that type, as
  // they would a 16-bit parameter's (O2: the FP32 masters are the model, read as its 16-bit
  // copy, which is never made). Unset: read as stored.
  std::optional<DType> read_as;
  std::shared_ptr<autograd::Node> grad_fn;  // null for leaves
  // Set on a leaf by an optimizer that updates it during the backward pass
  // (optim::Optimizer::begin_backward_step): the leaf's gradient, converted to grad_dtype as
  // `grad` would hold it (elements [begin, begin+n) of the flat tensor, contiguous, of dtype
  // `dtype`), goes to this function instead of into `grad`. The backward pass clears it once
  // used, and beforehand where the leaf would get more than one gradient (a shared weight) or
  // already has one.
  std::function<void(int64_t begin, int64_t n, const void* g, DType dtype)> consume_grad;
  // Set with consume_grad, by the same optimizer: the same update (the parts converted to
  // grad_dtype as `grad` would be) for a gradient an op computes in parts and hands over while each
  // part is in cache, instead of materializing it (a linear layer's weight gradient: the update's
  // reads of the parameter and its state are then the only pass over them). Called once, on the
  // backward thread (see autograd::take_grad_part_consumer), it prepares the update and returns the
  // part consumer.
  std::function<GradPartConsumer()> consume_grad_parts;
  // Set on a leaf by an optimizer that keeps the step's gradients as what computes them
  // (optim::Optimizer::defer_gradients): an op that can compute the leaf's gradient in parts
  // (a linear layer's weight gradient; a convolution's, as one part) hands this function a
  // producer of those parts (holding the small operands it needs) instead of storing the
  // gradient, and an upper bound of |v| over every value v the producer gives (+infinity when
  // none is known); the optimizer's step then computes the parts twice, once to check them and
  // once to apply them, or only to apply them when the bound alone proves them finite. Cleared as
  // consume_grad is: where the leaf would get more than one gradient or already has one.
  GradPartDeferral defer_grad_parts;
  // Set on a leaf by code that needs the leaf's gradient as soon as a backward pass has finished
  // computing it (dist::Reducer starts the gradient's all-reduce from here, while the pass goes
  // on with the layers below). Called once per backward pass whose graph reaches the leaf, on the
  // thread running the pass, after the last of the pass's contributions has been accumulated into
  // `grad` (a weight used twice: after the second), and before the pass goes on to the next node.
  // A pass run inside a node's backward (a recomputed module's) calls no hooks: the outer pass
  // calls them once the node is done.
  // `grad` may be undefined then: the leaf was in the graph but no op gave it a gradient. A leaf
  // with this hook keeps its gradient in `grad`: consume_grad and consume_grad_parts are not used
  // for it (the pass clears them, as for a shared weight), since the hook's owner needs it.
  std::function<void()> on_grad_ready;
  // Set on a leaf by data-parallel training (dist::FactorGradients) for a weight whose gradient an
  // op computes as a product of two factors that are smaller than it (a linear layer's
  // dW = dY^T X at a small batch): such an op hands this function its factors and how it forms
  // their product, and takes what it returns as its gradient for the leaf, in place of the
  // product of its own factors: the gradient over every rank's batch (the ranks' products summed
  // in rank order, identical on every rank), or nothing when the call carried a deferral (the
  // gradient then went to it as its producer). Kept across passes; the owner clears it.
  std::function<Tensor(const GradFactorCall& call)> gather_grad_factors;
  // Set with gather_grad_factors, by the same owner: an op that will hand that gatherer its input
  // factor b (rows, in) calls this in its forward pass (with gradients recorded) with that tensor,
  // so that every rank's input can travel while the rest of the forward pass and the backward
  // pass down to the op run; the gatherer then uses what arrived. Kept across passes; the owner
  // clears it.
  std::function<void(const Tensor& b)> gather_input_factor;
  // Set on a leaf whose values may still be arriving (dist::Zero1: the all-gather of a factored
  // weight's rows after a step, which runs while the next forward pass computes the layers below
  // the weight): an op that reads the leaf as a weight (ops::linear) calls it first, and it
  // returns once the values are in place. Kept across passes; the owner clears it.
  std::function<void()> before_read;
};

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false

  static Tensor empty(const Shape& shape, DType dtype, const TensorOptions& opt = {});
  static Tensor zeros(const Shape& shape, DType dtype, const TensorOptions& opt = {});
  static Tensor full(const Shape& shape, double value, DType dtype, const TensorOptions& opt = {});
  // A tensor of `dtype` holding `values` (converted with round to nearest even).
  static Tensor from_floats(const std::vector<float>& values, const Shape& shape,
                            DType dtype = DType::f32, const TensorOptions& opt = {});

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const { return shape_[normalize_dim(d)]; }
  int64_t stride(int64_t d) const { return strides_[normalize_dim(d)]; }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  int64_t storage_offset() const { return offset_; }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  Device device() const { return storage_ ? storage_->device() : Device{}; }

  // Pointer to the first element. data<T>() checks that T is this tensor's storage type.
  void* data_ptr();
  const void* data_ptr() const;
  template <typename T>
  T* data() {
    check_type(dtype_of<T>);
    return static_cast<T*>(data_ptr());
  }
  template <typename T>
  const T* data() const {
    check_type(dtype_of<T>);
    return static_cast<const T*>(data_ptr());
  }

  // ---- Views (share storage) ----
  // Same elements, new shape; one dimension may be -1. Needs a contiguous tensor.
  Tensor view(Shape shape) const;
  // view() when possible, else a contiguous copy.
  Tensor reshape(Shape shape) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(const std::vector<int64_t>& order) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;  // removes the dimension
  Tensor unsqueeze(int64_t dim) const;
  // Broadcast size-1 dimensions (stride 0) to `shape`; new leading dimensions allowed.
  Tensor expand(const Shape& shape) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;

  // ---- Copies ----
  Tensor contiguous() const;  // itself if already contiguous
  Tensor clone(const TensorOptions& opt) const;
  Tensor clone() const;  // charged like this tensor
  // The options that charge a new tensor like this one.
  TensorOptions options() const;
  // A contiguous copy in `dtype` (itself if the dtype matches and it is contiguous), rounded as
  // `cast` says; charged like this tensor (tracker, category, owner).
  Tensor to(DType dtype, const CastOptions& cast = {}) const;
  // Copies src's elements into this tensor (same shape), converting the dtype.
  void copy_from(const Tensor& src, const CastOptions& cast = {});
  // Whether the elements of this tensor and `other` span overlapping bytes of one storage (their
  // first-to-last element ranges intersect; two interleaved views count as overlapping).
  bool overlaps_memory_of(const Tensor& other) const;
  void fill(double value);

  // ---- Element access (tests, debugging, small tensors) ----
  double item() const;  // one-element tensors
  double at(std::initializer_list<int64_t> index) const;
  std::vector<float> to_float_vector() const;
  std::string str(int64_t max_elements = 16) const;  // "f16 (2, 3) [1, 2, ...]"

  // ---- Autograd state (the autograd layer records and differentiates; see autograd/) ----
  bool requires_grad() const { return autograd_ && autograd_->requires_grad; }
  // Marks a leaf as needing its gradient. Returns *this for chaining.
  Tensor& set_requires_grad(bool on = true);
  // The accumulated gradient (undefined until a backward pass reaches this leaf).
  Tensor grad() const;
  void set_grad(const Tensor& g);
  void zero_grad();  // drops the gradient
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  const std::shared_ptr<AutogradMeta>& autograd_meta() const { return autograd_; }
  // The same data without autograd state (what ops see inside a backward pass).
  Tensor detach() const;
  // These values (e.g. a 16-bit copy of an FP32 weight) standing in for the leaf `leaf` in ops:
  // they share its autograd state, so the ops' gradients go to `leaf`, computed directly in
  // `leaf`'s type. Automatic casting uses it for its cached weight copies.
  Tensor stand_in_for(const Tensor& leaf) const;
  // Used by the autograd layer to attach a result to the node that computed it.
  void set_grad_fn(std::shared_ptr<autograd::Node> fn);

 private:
  int64_t normalize_dim(int64_t d) const;
  void check_type(DType t) const;

  std::shared_ptr<Storage> storage_;
  DType dtype_ = DType::f32;
  Shape shape_;
  Shape strides_;
  int64_t offset_ = 0;  // in elements
  std::shared_ptr<AutogradMeta> autograd_;
};

// What an op hands AutogradMeta::gather_grad_factors: its factors a (rows, out) and b (rows, in),
// how it forms their product, the gradient's dtype, and, when the leaf's gradient is deferred this
// pass (AutogradMeta::defer_grad_parts, taken by the op) and the op's product is the FMA chain that
// kernels::linear_weight_grad_parts gives (FP32 partials), that deferral: the gatherer must then
// hand it a producer of the whole gradient and return an undefined tensor.
struct GradFactorCall {
  Tensor a, b;
  FactorProduct product;
  DType dtype = DType::f32;
  GradPartDeferral defer;
};

// Returns the blocks kept for reuse (freed tensors of 1 MiB or more, by size) to the system.
void release_cached_memory();

// Contiguous (row-major) strides for a shape.
Shape contiguous_strides(const Shape& shape);

}  // namespace mantissa
