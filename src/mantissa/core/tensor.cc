#include "mantissa/core/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>

#include "mantissa/core/checked.h"
#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"

namespace mantissa {

std::string Device::str() const {
  return type == DeviceType::kCpu ? "cpu" : "cuda:" + std::to_string(index);
}

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  if (s.size() == 1) out += ",";
  return out + ")";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1, extent = 1;  // extent: the product with zeros counted as ones
  for (int64_t d : shape) {
    if (d < 0) throw Error("negative dimension in shape " + shape_str(shape), "sizes must be >= 0");
    const std::optional<int64_t> e = checked_mul(extent, std::max<int64_t>(d, 1));
    if (!e)
      throw Error("shape " + shape_str(shape) + " has too many elements", "use a smaller shape");
    extent = *e;
    n *= d;  // cannot overflow: |n| <= extent
  }
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

// ---- Storage -----------------------------------------------------------------------------------

namespace {
// Freed blocks of 1 MiB or more are kept, by exact size, for the next allocation of that size: a
// training loop allocates the same activation sizes every step, and a fresh block from the system
// costs a page fault per 4 KiB (the kernel zeroes each page) — measured as a quarter of a large
// elementwise op's time. Budgets and reports count live tensors only; at most kCacheLimit bytes
// are kept, and release_cached_memory() returns them.
class BlockCache {
 public:
  static BlockCache& instance() {
    static BlockCache* cache = new BlockCache();  // never destroyed: storages may outlive statics
    return *cache;
  }
  void* take(size_t bytes) {
    if (bytes < kMinBlock) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(bytes);
    if (it == blocks_.end()) return nullptr;
    void* p = it->second;
    blocks_.erase(it);
    total_ -= bytes;
    return p;
  }
  void give(void* p, size_t bytes) {
    if (bytes < kMinBlock) return std::free(p);
    std::lock_guard<std::mutex> lock(mu_);
    if (total_ + bytes > kCacheLimit) return std::free(p);
    blocks_.emplace(bytes, p);
    total_ += bytes;
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [bytes, p] : blocks_) std::free(p);
    blocks_.clear();
    total_ = 0;
  }

 private:
  static constexpr size_t kMinBlock = size_t{1} << 20;
  static constexpr size_t kCacheLimit = size_t{4} << 30;
  std::mutex mu_;
  std::multimap<size_t, void*> blocks_;
  size_t total_ = 0;
};
}  // namespace

void release_cached_memory() { BlockCache::instance().release(); }

std::shared_ptr<Storage> Storage::allocate(size_t bytes, MemoryCategory category, std::string owner,
                                           Device device, MemoryTracker* tracker) {
  if (device.type != DeviceType::kCpu)
    throw Error(
        "cannot allocate on " + device.str() + ": this build of Mantissa has no CUDA support",
        "use the CPU device, or rebuild with CUDA on a machine that has it");
  if (bytes > static_cast<size_t>(std::numeric_limits<std::ptrdiff_t>::max()))
    throw OutOfMemoryError("cannot allocate " + format_bytes(bytes) + " for " +
                               std::string(memory_category_name(category)) +
                               ": more than the address space holds",
                           "reduce the batch size or the model");
  if (!tracker) tracker = &default_memory_tracker();
  if (owner.empty()) owner = current_module_path();  // the module running, if any
  tracker->on_allocate(bytes, category, owner);      // throws over budget, before anything is held
  std::shared_ptr<Storage> s(new Storage());
  s->bytes_ = bytes;
  s->category_ = category;
  s->owner_ = std::move(owner);
  s->device_ = device;
  s->tracker_ = tracker;
  if (bytes > 0) {
    constexpr size_t kAlign = 64;  // a cache line; also what AVX-512 loads like
    const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    s->data_ = BlockCache::instance().take(rounded);
    if (!s->data_) s->data_ = std::aligned_alloc(kAlign, rounded);
    if (!s->data_) {
      tracker->on_free(bytes, category, s->owner_);
      s->tracker_ = nullptr;
      throw OutOfMemoryError("the system could not provide " + format_bytes(bytes) + " for " +
                                 std::string(memory_category_name(category)),
                             "reduce the batch size or the model, or free memory on the machine");
    }
  }
  return s;
}

Storage::~Storage() {
  if (data_) BlockCache::instance().give(data_, (bytes_ + 63) / 64 * 64);
  if (tracker_) tracker_->on_free(bytes_, category_, owner_);
}

void Storage::recharge(MemoryCategory category, std::string owner) {
  if (tracker_) {
    tracker_->on_free(bytes_, category_, owner_);
    try {
      tracker_->on_allocate(bytes_, category, owner);
    } catch (...) {
      tracker_->on_allocate(bytes_, category_, owner_);  // cannot fail: the bytes were just freed
      throw;
    }
  }
  category_ = category;
  owner_ = std::move(owner);
}

// ---- Construction ------------------------------------------------------------------------------

namespace {
// The bytes of `shape` in `dtype`; throws if they could not be addressed (more than PTRDIFF_MAX,
// the largest object C++ can index).
size_t checked_nbytes(const Shape& shape, DType dtype) {
  const std::optional<int64_t> bytes =
      checked_mul(shape_numel(shape), static_cast<int64_t>(dtype_size(dtype)));
  if (!bytes || static_cast<uint64_t>(*bytes) > std::numeric_limits<std::ptrdiff_t>::max())
    throw Error("shape " + shape_str(shape) + " of " + std::string(dtype_name(dtype)) +
                    " is too large for memory",
                "use a smaller shape");
  return static_cast<size_t>(*bytes);
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, const TensorOptions& opt) {
  Tensor t;
  t.storage_ = Storage::allocate(checked_nbytes(shape, dtype), opt.category, opt.owner, opt.device,
                                 opt.tracker);
  t.dtype_ = dtype;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, const TensorOptions& opt) {
  Tensor t = empty(shape, dtype, opt);
  // Every dtype here encodes +0 as all-zero bits.
  if (t.nbytes()) std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, const TensorOptions& opt) {
  Tensor t = empty(shape, dtype, opt);
  t.fill(value);
  return t;
}

Tensor Tensor::from_floats(const std::vector<float>& values, const Shape& shape, DType dtype,
                           const TensorOptions& opt) {
  const int64_t n = shape_numel(shape);
  if (static_cast<size_t>(n) != values.size())
    throw Error("from_floats: " + std::to_string(values.size()) + " values for shape " +
                    shape_str(shape) + " (" + std::to_string(n) + " elements)",
                "pass as many values as the shape has elements");
  Tensor t = empty(shape, dtype, opt);
  convert(values.data(), DType::f32, t.data_ptr(), dtype, values.size());
  return t;
}

// ---- Properties --------------------------------------------------------------------------------

int64_t Tensor::numel() const {
  int64_t n = 1;  // cannot overflow: the shape passed shape_numel
  for (int64_t d : shape_) n *= d;
  return n;
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element to lay out (PyTorch's rule too)
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

void* Tensor::data_ptr() {
  if (!storage_) throw Error("use of an undefined tensor", "create it with Tensor::empty or zeros");
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}
const void* Tensor::data_ptr() const { return const_cast<Tensor*>(this)->data_ptr(); }

int64_t Tensor::normalize_dim(int64_t d) const {
  const int64_t n = dim();
  if (d < -n || d >= n)
    throw Error("dimension " + std::to_string(d) + " is out of range for a tensor of shape " +
                    shape_str(shape_),
                "use a dimension in [" + std::to_string(-n) + ", " + std::to_string(n - 1) + "]");
  return d < 0 ? d + n : d;
}

void Tensor::check_type(DType t) const {
  if (t != dtype_)
    throw Error("tensor holds " + std::string(dtype_name(dtype_)) + " but was read as " +
                    std::string(dtype_name(t)),
                "convert it first with .to(" + std::string(dtype_name(t)) + ")");
}

// ---- Views -------------------------------------------------------------------------------------

Tensor Tensor::view(Shape shape) const {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0)
        throw Error("view: more than one -1 in " + shape_str(shape), "use at most one -1");
      infer = static_cast<int64_t>(i);
    } else {
      if (shape[i] < 0)
        throw Error("view: negative size in " + shape_str(shape), "sizes must be >= 0");
      const std::optional<int64_t> k = checked_mul(known, shape[i]);
      if (!k)
        throw Error("view: shape " + shape_str(shape) + " has too many elements",
                    "keep the number of elements the same");
      known = *k;
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel() % known != 0)
      throw Error("view: cannot infer -1 in " + shape_str(shape) + " for " +
                      std::to_string(numel()) + " elements",
                  "make the other sizes divide the element count");
    shape[infer] = numel() / known;
    known *= shape[infer];
  }
  if (known != numel())
    throw Error("view: shape " + shape_str(shape) + " has " + std::to_string(known) +
                    " elements but the tensor " + shape_str(shape_) + " has " +
                    std::to_string(numel()),
                "keep the number of elements the same");
  shape_numel(shape);  // the same count; also the invariant on dimensions of size 0
  if (!is_contiguous())
    throw Error("view: tensor of shape " + shape_str(shape_) + " is not contiguous",
                "call .contiguous() first, or use reshape()");
  Tensor t = detach();
  t.shape_ = std::move(shape);
  t.strides_ = contiguous_strides(t.shape_);
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  return is_contiguous() ? view(std::move(shape)) : contiguous().view(std::move(shape));
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  Tensor t = detach();
  d0 = normalize_dim(d0);
  d1 = normalize_dim(d1);
  std::swap(t.shape_[d0], t.shape_[d1]);
  std::swap(t.strides_[d0], t.strides_[d1]);
  return t;
}

Tensor Tensor::permute(const std::vector<int64_t>& order) const {
  if (static_cast<int64_t>(order.size()) != dim())
    throw Error("permute: " + std::to_string(order.size()) +
                    " dimensions given for a tensor of shape " + shape_str(shape_),
                "give each dimension exactly once");
  std::vector<bool> seen(order.size(), false);
  Tensor t = detach();
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t d = normalize_dim(order[i]);
    if (seen[d])
      throw Error("permute: dimension " + std::to_string(d) + " repeated",
                  "give each dimension exactly once");
    seen[d] = true;
    t.shape_[i] = shape_[d];
    t.strides_[i] = strides_[d];
  }
  return t;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = normalize_dim(d);
  if (start < 0 || length < 0 || start > shape_[d] || length > shape_[d] - start)
    throw Error("narrow: start " + std::to_string(start) + " and length " + std::to_string(length) +
                    " are outside dimension " + std::to_string(d) + " of size " +
                    std::to_string(shape_[d]),
                "keep start >= 0 and start + length <= size");
  Tensor t = detach();
  t.offset_ += start * strides_[d];
  t.shape_[d] = length;
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = normalize_dim(d);
  if (index < -shape_[d] || index >= shape_[d])
    throw Error("select: index " + std::to_string(index) + " is out of range for dimension " +
                    std::to_string(d) + " of size " + std::to_string(shape_[d]),
                "use an index in [-size, size)");
  if (index < 0) index += shape_[d];
  Tensor t = narrow(d, index, 1);
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  const int64_t n = dim() + 1;
  if (d < -n || d >= n)
    throw Error(
        "unsqueeze: dimension " + std::to_string(d) + " is out of range for " + shape_str(shape_),
        "use a dimension in [" + std::to_string(-n) + ", " + std::to_string(n - 1) + "]");
  if (d < 0) d += n;
  Tensor t = detach();
  const int64_t stride = d < dim() ? shape_[d] * strides_[d] : 1;
  t.shape_.insert(t.shape_.begin() + d, 1);
  t.strides_.insert(t.strides_.begin() + d, stride);
  return t;
}

Tensor Tensor::expand(const Shape& shape) const {
  if (shape.size() < shape_.size())
    throw Error(
        "expand: cannot expand " + shape_str(shape_) + " to fewer dimensions " + shape_str(shape),
        "give at least as many dimensions as the tensor has");
  checked_nbytes(shape, dtype_);  // a view, but its numel() and nbytes() must not overflow
  Tensor t = detach();
  const size_t lead = shape.size() - shape_.size();
  t.shape_ = shape;
  t.strides_.assign(shape.size(), 0);
  for (size_t i = 0; i < shape_.size(); ++i) {
    const size_t j = lead + i;
    if (shape_[i] == shape[j]) {
      t.strides_[j] = strides_[i];
    } else if (shape_[i] != 1) {
      throw Error("expand: dimension " + std::to_string(i) + " of size " +
                      std::to_string(shape_[i]) + " cannot become " + std::to_string(shape[j]) +
                      " (" + shape_str(shape_) + " to " + shape_str(shape) + ")",
                  "only size-1 dimensions can be expanded");
    }
  }
  return t;
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  start_dim = normalize_dim(start_dim);
  end_dim = normalize_dim(end_dim);
  if (start_dim > end_dim)
    throw Error("flatten: start_dim " + std::to_string(start_dim) + " is after end_dim " +
                    std::to_string(end_dim),
                "pass start_dim <= end_dim");
  Shape s(shape_.begin(), shape_.begin() + start_dim);
  int64_t m = 1;
  for (int64_t i = start_dim; i <= end_dim; ++i) m *= shape_[i];
  s.push_back(m);
  s.insert(s.end(), shape_.begin() + end_dim + 1, shape_.end());
  return reshape(s);
}

// ---- Copies ------------------------------------------------------------------------------------

namespace {
// Calls fn(src_offset, dst_offset, logical_index) for each row of the last dimension (both offsets
// in elements from each tensor's first element), walking all other dimensions in row-major order.
template <typename Fn>
void for_each_row(const Shape& shape, const Shape& src_strides, const Shape& dst_strides, Fn&& fn) {
  const size_t nd = shape.size();
  const int64_t row = nd ? shape[nd - 1] : 1;
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < nd; ++i) rows *= shape[i];
  if (row == 0 || rows == 0) return;
  std::vector<int64_t> idx(nd > 0 ? nd - 1 : 0, 0);
  int64_t so = 0, dof = 0;
  for (int64_t r = 0; r < rows; ++r) {
    fn(so, dof, r * row);
    for (size_t k = idx.size(); k-- > 0;) {  // odometer increment
      ++idx[k];
      so += src_strides[k];
      dof += dst_strides[k];
      if (idx[k] < shape[k]) break;
      so -= src_strides[k] * shape[k];
      dof -= dst_strides[k] * shape[k];
      idx[k] = 0;
    }
  }
}
}  // namespace

void Tensor::copy_from(const Tensor& src, const CastOptions& cast) {
  if (src.shape_ != shape_)
    throw Error(
        "copy_from: source shape " + shape_str(src.shape_) + " differs from " + shape_str(shape_),
        "copy between tensors of the same shape (expand the source to broadcast)");
  if (numel() == 0) return;
  // A destination whose elements share memory (a stride of 0 along a dimension of more than one
  // element: an expand()ed view) would keep one of the values written there.
  for (int64_t k = 0; k < dim(); ++k)
    MANTISSA_CHECK(strides_[k] != 0 || shape_[k] == 1,
                   "copy_from: the tensor written to, " + shape_str(shape_) +
                       ", has elements that share memory (stride 0 along dimension " +
                       std::to_string(k) + ", as an expand()ed view has)",
                   "write into a tensor of its own (clone() the view, or copy into the tensor "
                   "it was expanded from)");
  // A source that overlaps the destination in memory (two views of one storage) is read from a
  // copy of itself: the elements are written as they were before the copy, in any order.
  if (src.overlaps_memory_of(*this)) {
    if (src.data_ptr() == data_ptr() && src.strides_ == strides_ && src.dtype_ == dtype_)
      return;  // the same view in the same dtype: every element is already what it would be
    copy_from(src.clone(), cast);
    return;
  }
  const size_t ss = dtype_size(src.dtype_), ds = dtype_size(dtype_);
  const char* sbase = static_cast<const char*>(src.data_ptr());
  char* dbase = static_cast<char*>(data_ptr());
  if (src.is_contiguous() && is_contiguous()) {
    // Large copies (an FP16 copy of a weight, every step) on all threads: the same values.
    const size_t n = static_cast<size_t>(numel());
    if (n >= (size_t{1} << 16))
      convert_parallel(sbase, src.dtype_, dbase, dtype_, n, cast, default_num_threads());
    else
      convert(sbase, src.dtype_, dbase, dtype_, n, cast);
    return;
  }
  const int64_t nd = dim();
  const int64_t row = nd ? shape_[nd - 1] : 1;
  const int64_t s_inner = nd ? src.strides_[nd - 1] : 1, d_inner = nd ? strides_[nd - 1] : 1;
  for_each_row(shape_, src.strides_, strides_, [&](int64_t so, int64_t dof, int64_t logical) {
    CastOptions o = cast;
    if (s_inner == 1 && d_inner == 1) {
      o.index = cast.index + static_cast<uint64_t>(logical);
      convert(sbase + so * static_cast<int64_t>(ss), src.dtype_,
              dbase + dof * static_cast<int64_t>(ds), dtype_, static_cast<size_t>(row), o);
      return;
    }
    for (int64_t j = 0; j < row; ++j) {
      o.index = cast.index + static_cast<uint64_t>(logical + j);
      convert(sbase + (so + j * s_inner) * static_cast<int64_t>(ss), src.dtype_,
              dbase + (dof + j * d_inner) * static_cast<int64_t>(ds), dtype_, 1, o);
    }
  });
}

bool Tensor::overlaps_memory_of(const Tensor& other) const {
  if (!storage_ || storage_ != other.storage_ || numel() == 0 || other.numel() == 0) return false;
  // The byte range each view spans in the storage (first to last element, inclusive).
  auto span = [](const Tensor& t) {
    int64_t lo = t.offset_, hi = t.offset_;
    for (int64_t k = 0; k < t.dim(); ++k) {
      const int64_t reach = t.strides_[k] * (t.shape_[k] - 1);
      (reach < 0 ? lo : hi) += reach;
    }
    const int64_t es = static_cast<int64_t>(dtype_size(t.dtype_));
    return std::pair<int64_t, int64_t>{lo * es, (hi + 1) * es};
  };
  const auto [a0, a1] = span(*this);
  const auto [b0, b1] = span(other);
  return a0 < b1 && b0 < a1;
}

Tensor Tensor::clone(const TensorOptions& opt) const {
  Tensor t = empty(shape_, dtype_, opt);
  t.copy_from(*this);
  return t;
}

TensorOptions Tensor::options() const {
  TensorOptions opt;
  if (storage_) {
    opt.category = storage_->category();
    opt.owner = storage_->owner();
    opt.device = storage_->device();
    opt.tracker = storage_->tracker();
  }
  return opt;
}

Tensor Tensor::clone() const { return clone(options()); }

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::to(DType dtype, const CastOptions& cast) const {
  if (dtype == dtype_ && is_contiguous()) return *this;
  Tensor t = empty(shape_, dtype, options());
  t.copy_from(*this, cast);
  return t;
}

void Tensor::fill(double value) {
  if (numel() == 0) return;
  // Convert once, then replicate the bytes.
  alignas(8) unsigned char one[8];
  convert(&value, DType::f64, one, dtype_, 1);
  const size_t es = dtype_size(dtype_);
  char* base = static_cast<char*>(data_ptr());
  const Shape zero_strides(shape_.size(), 0);
  const int64_t nd = dim();
  const int64_t row = nd ? shape_[nd - 1] : 1;
  const int64_t inner = nd ? strides_[nd - 1] : 1;
  for_each_row(shape_, zero_strides, strides_, [&](int64_t, int64_t dof, int64_t) {
    for (int64_t j = 0; j < row; ++j)
      std::memcpy(base + (dof + j * inner) * static_cast<int64_t>(es), one, es);
  });
}

// ---- Autograd state ----------------------------------------------------------------------------

Tensor& Tensor::set_requires_grad(bool on) {
  if (on && !is_floating(dtype_))
    throw Error("only floating-point tensors can require gradients (this one is " +
                    std::string(dtype_name(dtype_)) + ")",
                "convert it to f32, f16 or bf16 first");
  if (!autograd_) autograd_ = std::make_shared<AutogradMeta>();
  autograd_->requires_grad = on;
  autograd_->dtype = dtype_;
  return *this;
}

Tensor Tensor::grad() const { return autograd_ && autograd_->grad ? *autograd_->grad : Tensor(); }

void Tensor::set_grad(const Tensor& g) {
  if (!autograd_) autograd_ = std::make_shared<AutogradMeta>();
  if (!g.defined()) {
    autograd_->grad.reset();
    return;
  }
  if (g.shape() != shape_)
    throw Error(
        "gradient of shape " + shape_str(g.shape()) + " for a tensor of shape " + shape_str(shape_),
        "a gradient has its tensor's shape");
  autograd_->grad = std::make_unique<Tensor>(g.detach());
}

void Tensor::zero_grad() {
  if (autograd_) autograd_->grad.reset();
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  static const std::shared_ptr<autograd::Node> none;
  return autograd_ ? autograd_->grad_fn : none;
}

Tensor Tensor::detach() const {
  Tensor t = *this;
  t.autograd_.reset();
  return t;
}

Tensor Tensor::stand_in_for(const Tensor& leaf) const {
  if (!leaf.requires_grad() || leaf.grad_fn())
    throw Error("stand_in_for: the tensor stood in for is not a leaf that requires grad",
                "use a parameter");
  if (leaf.shape() != shape_)
    throw Error("stand_in_for: shape " + shape_str(shape_) + " for a leaf of shape " +
                    shape_str(leaf.shape()),
                "a stand-in has its leaf's shape");
  Tensor t = *this;
  t.autograd_ = leaf.autograd_;
  return t;
}

void Tensor::set_grad_fn(std::shared_ptr<autograd::Node> fn) {
  autograd_ = std::make_shared<AutogradMeta>();
  autograd_->requires_grad = fn != nullptr;
  autograd_->grad_fn = std::move(fn);
}

// ---- Element access ----------------------------------------------------------------------------

double Tensor::item() const {
  if (numel() != 1)
    throw Error("item: tensor of shape " + shape_str(shape_) + " has " + std::to_string(numel()) +
                    " elements",
                "item() reads one-element tensors; use at({...}) for others");
  double v;
  Tensor self = contiguous();
  convert(self.data_ptr(), dtype_, &v, DType::f64, 1);
  return v;
}

double Tensor::at(std::initializer_list<int64_t> index) const {
  if (static_cast<int64_t>(index.size()) != dim())
    throw Error("at: " + std::to_string(index.size()) + " indices for a tensor of shape " +
                    shape_str(shape_),
                "give one index per dimension");
  int64_t off = 0, d = 0;
  for (int64_t i : index) {
    if (i < 0 || i >= shape_[d])
      throw Error("at: index " + std::to_string(i) + " is out of range for dimension " +
                      std::to_string(d) + " of size " + std::to_string(shape_[d]),
                  "use indices in [0, size)");
    off += i * strides_[d++];
  }
  double v;
  convert(static_cast<const char*>(data_ptr()) + off * static_cast<int64_t>(dtype_size(dtype_)),
          dtype_, &v, DType::f64, 1);
  return v;
}

std::vector<float> Tensor::to_float_vector() const {
  std::vector<float> out(static_cast<size_t>(numel()));
  if (out.empty()) return out;
  Tensor c = contiguous();
  convert(c.data_ptr(), dtype_, out.data(), DType::f32, out.size());
  return out;
}

std::string Tensor::str(int64_t max_elements) const {
  if (!defined()) return "undefined tensor";
  std::ostringstream out;
  out << dtype_name(dtype_) << ' ' << shape_str(shape_) << " [";
  const std::vector<float> v = to_float_vector();
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(v.size()), max_elements);
  for (int64_t i = 0; i < n; ++i) out << (i ? ", " : "") << v[i];
  if (static_cast<int64_t>(v.size()) > n) out << ", ...";
  out << ']';
  return out.str();
}

}  // namespace mantissa
