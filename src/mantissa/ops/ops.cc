#include "mantissa/ops/ops.h"

#include <cmath>
#include <functional>
#include <memory>

#include "mantissa/autograd/autograd.h"
#include "mantissa/core/error.h"
#include "mantissa/core/parallel.h"
#include "mantissa/core/profiler.h"
#include "mantissa/kernels/elementwise.h"
#include "mantissa/kernels/linear.h"
#include "mantissa/ops/autocast.h"

namespace mantissa::ops {

std::optional<OpId> op_from_name(std::string_view name) {
  for (int i = 0; i < kNumOps; ++i)
    if (kOpInfo[i].name == name) return static_cast<OpId>(i);
  return std::nullopt;
}

std::string_view autocast_category_name(AutocastCategory c) {
  switch (c) {
    case AutocastCategory::kLowerPrecision:
      return "lower_precision";
    case AutocastCategory::kFp32:
      return "fp32";
    case AutocastCategory::kPromote:
      return "promote";
    case AutocastCategory::kFollowInput:
      return "follow_input";
    case AutocastCategory::kNever:
      return "never";
  }
  return "?";
}

std::string_view op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kMatrix:
      return "matrix";
    case OpKind::kBinary:
      return "binary";
    case OpKind::kCompute:
      return "compute";
    case OpKind::kMove:
      return "move";
    case OpKind::kLoss:
      return "loss";
    case OpKind::kConvert:
      return "convert";
  }
  return "?";
}

namespace {

using autograd::Node;
using kernels::BinaryOp;
using kernels::UnaryOp;

// A node whose backward is a closure over exactly the tensors it needs, named after its op.
class FnNode : public Node {
 public:
  using Fn = std::function<std::vector<Tensor>(const Tensor& grad, const FnNode& self)>;
  FnNode(OpId op, Fn fn) : op_(op), fn_(std::move(fn)) {}
  const char* name() const override { return op_info(op_).name.data(); }
  std::vector<Tensor> backward(const Tensor& grad) override {
    MANTISSA_CHECK(fn_ != nullptr,
                   std::string("backward() reached ") + name() +
                       " a second time: its saved tensors were freed by the first pass",
                   "run the forward again before another backward()");
    return fn_(grad, *this);
  }
  void release() override { fn_ = nullptr; }
  DType input_dtype(size_t i) const { return inputs()[i].dtype; }

 private:
  OpId op_;
  Fn fn_;
};

// Records `fn` as the backward of `out` when an input needs a gradient.
Tensor recorded(Tensor out, OpId op, std::initializer_list<const Tensor*> inputs, FnNode::Fn fn) {
  if (autograd::needs_grad(inputs))
    autograd::record(out, std::make_shared<FnNode>(op, std::move(fn)), inputs);
  return out;
}

DType out_or(const OpOptions& opt, DType fallback) { return opt.out.value_or(fallback); }

// The type an operand is read as under OpOptions::weight_as or input_as (`option`): its own, or
// f16 / bf16 for an f32 operand; anything else throws, naming the op and the operand (`what`).
DType read_type(const char* op, const char* option, const std::optional<DType>& as, const Tensor& t,
                const char* what) {
  const DType d = as.value_or(t.dtype());
  MANTISSA_CHECK(d == t.dtype() || (t.dtype() == DType::f32 && is_16bit_float(d)),
                 std::string(op) + ": " + option + " " + std::string(dtype_name(d)) + " for an " +
                     std::string(dtype_name(t.dtype())) + " " + what,
                 std::string(option) + " reads an f32 " + what + " as f16 or bf16");
  return d;
}
Partials partials_of(const OpOptions& opt) { return opt.partials.value_or(default_partials()); }

// ReLU, sigmoid and tanh differentiate from their output, GELU from its input: the node keeps
// only that one tensor.
Tensor unary_op(OpId id, UnaryOp op, const Tensor& x, const OpOptions& opt, bool backward_from_y) {
  Tensor y = kernels::unary(op, x.detach(), out_or(opt, x.dtype()));
  const Tensor saved = backward_from_y ? y.detach() : x.detach();
  return recorded(
      y, id, {&x},
      [op, saved, backward_from_y](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        // dx over dy when nothing else holds dy: a pass keeps one gradient of this size.
        const DType dt = n.input_dtype(0);
        Tensor into =
            g.dtype() == dt && g.is_contiguous() && autograd::may_overwrite(g) ? g : Tensor();
        return {kernels::unary_backward(op, g, backward_from_y ? Tensor() : saved,
                                        backward_from_y ? saved : Tensor(), dt,
                                        MemoryCategory::gradients, std::move(into))};
      });
}

// Gradient of a broadcast binary op with respect to one operand: reduce to its shape.
Tensor reduce_grad(const Tensor& g, const Shape& shape, DType dtype) {
  return kernels::sum_to_shape(g, shape, dtype, MemoryCategory::gradients);
}

Tensor binary_op(OpId id, BinaryOp op, const Tensor& a, const Tensor& b, const OpOptions& opt) {
  const Tensor ad = a.detach(), bd = b.detach();
  Tensor y = kernels::binary(op, ad, bd, out_or(opt, promote_types(a.dtype(), b.dtype())));
  // add/sub need no saved tensors; mul and div keep their operands.
  const bool keep = op == BinaryOp::kMul || op == BinaryOp::kDiv;
  const Tensor sa = keep ? ad : Tensor(), sb = keep ? bd : Tensor();
  const Shape as = a.shape(), bs = b.shape();
  return recorded(
      y, id, {&a, &b},
      [op, sa, sb, as, bs](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        std::vector<Tensor> out(2);
        const DType ta = n.input_dtype(0), tb = n.input_dtype(1);
        switch (op) {
          case BinaryOp::kAdd:
            if (n.needs_input_grad(0)) out[0] = reduce_grad(g, as, ta);
            if (n.needs_input_grad(1)) out[1] = reduce_grad(g, bs, tb);
            break;
          case BinaryOp::kSub:
            if (n.needs_input_grad(0)) out[0] = reduce_grad(g, as, ta);
            if (n.needs_input_grad(1))
              out[1] = reduce_grad(
                  kernels::binary_scalar(BinaryOp::kMul, g, -1.0, false, DType::f32), bs, tb);
            break;
          case BinaryOp::kMul:
            if (n.needs_input_grad(0))
              out[0] = reduce_grad(kernels::binary(BinaryOp::kMul, g, sb, DType::f32), as, ta);
            if (n.needs_input_grad(1))
              out[1] = reduce_grad(kernels::binary(BinaryOp::kMul, g, sa, DType::f32), bs, tb);
            break;
          case BinaryOp::kDiv:
            // d(a/b)/da = 1/b; d(a/b)/db = -a/b^2
            if (n.needs_input_grad(0))
              out[0] = reduce_grad(kernels::binary(BinaryOp::kDiv, g, sb, DType::f32), as, ta);
            if (n.needs_input_grad(1)) {
              const Tensor q = kernels::binary(
                  BinaryOp::kDiv, kernels::binary(BinaryOp::kMul, g, sa, DType::f32),
                  kernels::unary(UnaryOp::kSquare, sb, DType::f32), DType::f32);
              out[1] = reduce_grad(
                  kernels::binary_scalar(BinaryOp::kMul, q, -1.0, false, DType::f32), bs, tb);
            }
            break;
        }
        return out;
      });
}

// The gradient of a reduction over dims, broadcast back to the input's shape (times scale).
Tensor expand_grad(const Tensor& g, const Shape& in_shape, const std::vector<int64_t>& dims,
                   bool keepdim, double scale, DType dtype) {
  Tensor gk = g;
  if (!keepdim) {
    Shape kept = in_shape;
    const int64_t rank = static_cast<int64_t>(in_shape.size());
    if (dims.empty()) {
      std::fill(kept.begin(), kept.end(), 1);
    } else {
      for (int64_t d : dims) kept[static_cast<size_t>(d < 0 ? d + rank : d)] = 1;
    }
    gk = g.reshape(kept);
  }
  return kernels::binary_scalar(BinaryOp::kMul, gk.expand(in_shape), scale, false, dtype,
                                MemoryCategory::gradients);
}

// A view of x (no copy), or a copy when another output type is asked for; the gradient goes back
// reshaped by `undo` and cast to the input's type.
Tensor layout_op(OpId op, const Tensor& x, Tensor view, const OpOptions& opt,
                 std::function<Tensor(const Tensor&)> undo) {
  Tensor y = opt.out && *opt.out != view.dtype() ? kernels::cast(view, *opt.out) : view;
  return recorded(
      y, op, {&x},
      [undo = std::move(undo)](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        const Tensor gx = undo(g);
        return {gx.dtype() == n.input_dtype(0)
                    ? gx
                    : kernels::cast(gx, n.input_dtype(0), {}, MemoryCategory::gradients)};
      });
}

// The kernels compute the loss in FP32; another output type (automatic casting) rounds it once.
Tensor loss_output(Tensor y, const OpOptions& opt) {
  return opt.out && *opt.out != y.dtype() ? kernels::cast(y, *opt.out) : y;
}

// ---- The FP8 path of linear and conv2d (ops::Fp8Scope, amp/fp8.h) ----
//
// An FP8 matrix product with FP32 accumulation, as FP8 hardware computes it: each operand is
// quantized with its tensor's scale (kernels/quantize.h), the FP8 values are multiplied exactly
// (a product of two FP8 values has at most 8 significant bits) and summed in FP32, and the sum is
// multiplied by the product of the operands' inverse scales (the GEMM's alpha), then the bias
// added (the epilogue). Emulated with the 16-bit kernels: the FP8 copies are widened exactly to
// BF16, whose products are exact in FP32 too, and the kernels accumulate in FP32. One path
// departs from exact products: the 3x3 stride-1 pad-1 convolutions of 16 or more channels take
// Winograd F(2x2, 3x3) whatever the operands' storage (kernels/conv_paths.h), whose transforms
// round in FP32, so there the FP8 product carries Winograd's rounding too. The backward pass
// quantizes the output's gradient and multiplies it with the FP8 copies the forward pass kept
// (one byte an element); the bias's gradient is the sum of the unquantized gradient.

// An operand in FP8 and the inverse of the scale it was quantized with.
struct Fp8Operand {
  Tensor q;
  float scale_inv = 1;
};

Fp8Operand quantized(const Tensor& t, Fp8Tensor& s) {
  const float scale = s.scale(s.needs_amax() ? kernels::amax(t) : 0.0f);
  kernels::QuantizeStats stats;
  Fp8Operand o{kernels::quantize(t, s.format(), scale, &stats), 1.0f / scale};
  s.record(stats, scale);
  return o;
}

// The FP8 values in BF16, exactly: what the kernels multiply.
Tensor widened(const Fp8Operand& o) {
  return kernels::cast(o.q, DType::bf16, {}, MemoryCategory::workspace);
}

// The epilogue of a gradient (no bias): in the accumulator itself when the gradient is FP32 (the
// weights' gradients), so one FP32 buffer of the weight's size is alive at a time, not two.
Tensor gradient_epilogue(Tensor acc, float scale_inv, DType out) {
  if (out != DType::f32)
    return kernels::fp8_epilogue(acc, scale_inv, Tensor(), -1, out, MemoryCategory::gradients);
  kernels::fp8_epilogue_in_place(acc, scale_inv);
  return acc;
}

Tensor fp8_linear(const Tensor& x, const Tensor& w, const Tensor& b, const Fp8OpScaling& sc,
                  const OpOptions& opt) {
  const Tensor bd = b.defined() ? b.detach() : Tensor();
  const Fp8Operand qx = quantized(x.detach(), *sc.input), qw = quantized(w.detach(), *sc.weight);
  const int64_t in = w.size(1), outf = w.size(0), rows = x.numel() / std::max<int64_t>(in, 1);
  const Tensor acc = kernels::linear(widened(qx).reshape({rows, in}), widened(qw), Tensor(),
                                     DType::f32, Partials::kF32);  // (rows, out)
  Shape ys = x.shape();
  ys.back() = outf;
  Tensor y = kernels::fp8_epilogue(acc, qx.scale_inv * qw.scale_inv, bd, 1,
                                   opt.out.value_or(autocast_dtype()))
                 .view(ys);
  count_macs(y.numel() * in);
  if (autograd::detect_anomaly()) detail::check_output(OpId::linear, y, {x, w, b});
  const Shape xs = x.shape();
  std::shared_ptr<Fp8Tensor> gs = sc.grad_output;
  return recorded(
      y, OpId::linear, {&x, &w, &b},
      [qx, qw, gs, xs, rows, in, outf](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        std::vector<Tensor> out(3);
        const Tensor g2 = g.reshape({rows, outf});
        if (n.needs_input_grad(0) || n.needs_input_grad(1)) {
          const Fp8Operand qg = quantized(g2, *gs);
          const Tensor gd = widened(qg);
          if (n.needs_input_grad(0)) {  // dx = g w
            const Tensor acc = kernels::matmul(gd, widened(qw), DType::f32, Partials::kF32,
                                               MemoryCategory::gradients);
            out[0] = gradient_epilogue(acc, qg.scale_inv * qw.scale_inv, n.input_dtype(0)).view(xs);
          }
          if (n.needs_input_grad(1)) {  // dw = g^T x
            const Tensor acc =
                kernels::matmul(gd.transpose(0, 1), widened(qx).reshape({rows, in}), DType::f32,
                                Partials::kF32, MemoryCategory::gradients);
            out[1] = gradient_epilogue(acc, qg.scale_inv * qx.scale_inv, n.input_dtype(1));
          }
        }
        if (n.needs_input_grad(2))
          out[2] = kernels::sum(g2, {0}, false, n.input_dtype(2), MemoryCategory::gradients);
        return out;
      });
}

Tensor fp8_conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dParams& prm,
                  const Fp8OpScaling& sc, const OpOptions& opt) {
  const Tensor bd = b.defined() ? b.detach() : Tensor();
  const Fp8Operand qx = quantized(x.detach(), *sc.input), qw = quantized(w.detach(), *sc.weight);
  const Tensor acc =
      kernels::conv2d(widened(qx), widened(qw), Tensor(), prm, DType::f32, Partials::kF32);
  Tensor y = kernels::fp8_epilogue(acc, qx.scale_inv * qw.scale_inv, bd, 1,
                                   opt.out.value_or(autocast_dtype()));
  count_macs(y.numel() * w.size(1) * w.size(2) * w.size(3));
  if (autograd::detect_anomaly()) detail::check_output(OpId::conv2d, y, {x, w, b});
  const Shape xs = x.shape(), wsh = w.shape();
  std::shared_ptr<Fp8Tensor> gs = sc.grad_output;
  return recorded(
      y, OpId::conv2d, {&x, &w, &b},
      [qx, qw, gs, xs, wsh, prm](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        std::vector<Tensor> out(3);
        if (n.needs_input_grad(0) || n.needs_input_grad(1)) {
          const Fp8Operand qg = quantized(g, *gs);
          const Tensor gd = widened(qg);
          if (n.needs_input_grad(0)) {
            const Tensor acc = kernels::conv2d_backward_input(gd, widened(qw), xs, prm, DType::f32,
                                                              Partials::kF32);
            out[0] = gradient_epilogue(acc, qg.scale_inv * qw.scale_inv, n.input_dtype(0));
          }
          if (n.needs_input_grad(1)) {
            const Tensor acc = kernels::conv2d_backward_weight(gd, widened(qx), wsh, prm,
                                                               DType::f32, Partials::kF32);
            out[1] = gradient_epilogue(acc, qg.scale_inv * qx.scale_inv, n.input_dtype(1));
          }
        }
        if (n.needs_input_grad(2))
          out[2] = kernels::sum(g, {0, 2, 3}, false, n.input_dtype(2), MemoryCategory::gradients);
        return out;
      });
}

}  // namespace

// ---- Matrix ops ----

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b, const OpOptions& opt) {
  // A weight whose values may still be arriving (AutogradMeta::before_read): in place first.
  if (const AutogradMeta* m = w.autograd_meta().get(); m && m->before_read) m->before_read();
  if (const auto fp8 = detail::fp8_scaling()) return fp8_linear(x, w, b, *fp8, opt);
  detail::OpCall call(OpId::linear, opt, {&x, &w, &b});
  if (call.active()) return call.finish(linear(call.in(0), call.in(1), call.in(2), call.options()));
  const DType w_as = read_type("linear", "weight_as", opt.weight_as, w, "weight");
  const DType x_as = read_type("linear", "input_as", opt.input_as, x, "input");
  // An input read as x_as: its 16-bit copy, which the kernels read and the weight gradient keeps
  // (as the cast's output would be); the input gradient is computed in FP32, each value rounded to
  // x_as as the GEMM stores it: the values of the cast's backward (the 16-bit gradient widened),
  // without the 16-bit gradient and the widening pass.
  const Tensor xd = x_as == x.dtype() ? x.detach() : kernels::cast(x.detach(), x_as);
  const Tensor wd = w.detach(), bd = b.defined() ? b.detach() : Tensor();
  // The type the kernels round w's values to as they read them (f32: none).
  const DType round_w = w_as == w.dtype() ? DType::f32 : w_as;
  Tensor y = kernels::linear(xd, wd, bd, out_or(opt, promote_types(x_as, w_as)), partials_of(opt),
                             round_w);
  count_macs(y.numel() * wd.size(1));
  // Data parallelism may gather every rank's input for the weight gradient from here on
  // (AutogradMeta::gather_input_factor), the backward's factor b as it will read it.
  if (const AutogradMeta* m = w.autograd_meta().get();
      m && m->gather_input_factor && autograd::grad_enabled() && w.requires_grad())
    m->gather_input_factor(xd.reshape({kernels::linear_rows(xd), wd.size(1)}));
  const Partials p = partials_of(opt);
  return recorded(
      y, OpId::linear, {&x, &w, &b},
      [xd, wd, p, round_w, read_x = x_as != x.dtype()](const Tensor& g,
                                                       const FnNode& n) -> std::vector<Tensor> {
        std::vector<Tensor> out(3);
        const int64_t in = wd.size(1), outf = wd.size(0), rows = kernels::linear_rows(xd);
        const Tensor g2 = g.reshape({rows, outf});
        if (n.needs_input_grad(0)) {  // dx = g w
          // Read as its 16-bit copy (input_as): the FP32 input's gradient holds the values of the
          // copy's gradient, rounded as the GEMM stores them.
          out[0] = kernels::matmul(g2, wd, n.input_dtype(0), p, MemoryCategory::gradients, round_w,
                                   read_x ? xd.dtype() : DType::f32)
                       .view(xd.shape());
        }
        if (n.needs_input_grad(1)) {  // dw = g^T x
          // After dx, which read the weights: an update in the backward pass may take dw in
          // parts, changing the weights as each part is handed over.
          const Tensor x2 = xd.reshape({rows, in});
          const FactorProduct product = [p, dt = n.input_dtype(1)](const Tensor& gr,
                                                                   const Tensor& xr) {
            return kernels::matmul(gr.transpose(0, 1), xr, dt, p, MemoryCategory::gradients);
          };
          // Data parallelism may gather the factors of every rank instead of reducing dw. Or the
          // optimizer keeps the gradient as its producer (g and x, small at such a batch; with
          // the factors gathered, every rank's) and computes the parts at its step.
          const auto gather = autograd::grad_factor_gatherer(n, 1);
          GradPartConsumer parts;
          GradPartDeferral defer;
          if (p == Partials::kF32 && kernels::linear_weight_grad_parts_fit(rows)) {
            if (!gather) parts = autograd::take_grad_part_consumer(n, 1);
            if (!parts) defer = autograd::take_grad_part_deferral(n, 1);
          }
          if (gather)
            out[1] = gather({g2, x2, product, n.input_dtype(1), std::move(defer)});
          else if (parts)
            kernels::linear_weight_grad_parts(g2, x2, n.input_dtype(1), parts);
          else if (defer)
            defer(
                [g2, x2, dt = n.input_dtype(1)](const GradPartConsumer& consume) {
                  kernels::linear_weight_grad_parts(g2, x2, dt, consume);
                },
                kernels::linear_weight_grad_bound(g2, x2, n.input_dtype(1)));
          else
            out[1] = product(g2, x2);
        }
        if (n.needs_input_grad(2))
          out[2] = kernels::sum(g2, {0}, false, n.input_dtype(2), MemoryCategory::gradients);
        return out;
      });
}

Tensor matmul(const Tensor& a, const Tensor& b, const OpOptions& opt) {
  detail::OpCall call(OpId::matmul, opt, {&a, &b});
  if (call.active()) return call.finish(matmul(call.in(0), call.in(1), call.options()));
  const Tensor ad = a.detach(), bd = b.detach();
  Tensor y =
      kernels::matmul(ad, bd, out_or(opt, promote_types(a.dtype(), b.dtype())), partials_of(opt));
  count_macs(y.numel() * ad.size(-1));
  const Partials p = partials_of(opt);
  return recorded(
      y, OpId::matmul, {&a, &b},
      [ad, bd, p](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        std::vector<Tensor> out(2);
        if (n.needs_input_grad(0))  // da = g b^T
          out[0] = kernels::matmul(g, bd.transpose(-1, -2), n.input_dtype(0), p,
                                   MemoryCategory::gradients);
        if (n.needs_input_grad(1)) {  // db = a^T g (summed over the batch when b is 2-D)
          if (bd.dim() == 2 && ad.dim() > 2) {
            const int64_t K = ad.size(-1), N = g.size(-1);
            out[1] = kernels::matmul(ad.reshape({-1, K}).transpose(0, 1), g.reshape({-1, N}),
                                     n.input_dtype(1), p, MemoryCategory::gradients);
          } else {
            out[1] = kernels::matmul(ad.transpose(-1, -2), g, n.input_dtype(1), p,
                                     MemoryCategory::gradients);
          }
        }
        return out;
      });
}

Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dParams& prm,
              const OpOptions& opt) {
  if (const auto fp8 = detail::fp8_scaling()) return fp8_conv2d(x, w, b, prm, *fp8, opt);
  detail::OpCall call(OpId::conv2d, opt, {&x, &w, &b});
  if (call.active())
    return call.finish(conv2d(call.in(0), call.in(1), call.in(2), prm, call.options()));
  const Tensor xd = x.detach(), wd = w.detach(), bd = b.defined() ? b.detach() : Tensor();
  const DType w_as = read_type("conv2d", "weight_as", opt.weight_as, w, "weight");
  const DType x_as = read_type("conv2d", "input_as", opt.input_as, x, "input");
  const DType read_x = x_as == x.dtype() ? DType::f32 : x_as;  // kernels::conv2d's read_x
  // With weight_as the kernels read the FP32 weight as its 16-bit copy (kernels::conv2d's read_w:
  // rounded as Winograd transforms it, or a copy made for the call), in the forward and again in
  // the backward: the graph keeps only the FP32 weight, which the model holds anyway.
  const DType read_w = w_as == w.dtype() ? DType::f32 : w_as;
  Tensor y = kernels::conv2d(xd, wd, bd, prm, out_or(opt, promote_types(x_as, w_as)),
                             partials_of(opt), read_x, read_w);
  count_macs(y.numel() * wd.size(1) * wd.size(2) * wd.size(3));  // per output: C/groups x KH x KW
  const Partials p = partials_of(opt);
  return recorded(
      y, OpId::conv2d, {&x, &w, &b},
      [xd, wd, prm, p, read_w, x_as, read_x](const Tensor& g,
                                             const FnNode& n) -> std::vector<Tensor> {
        std::vector<Tensor> out(3);
        if (n.needs_input_grad(0)) {
          // Read as x_as: the gradient of x's 16-bit copy, widened as the cast's backward would.
          out[0] = kernels::conv2d_backward_input(
              g, wd, xd.shape(), prm, read_x == DType::f32 ? n.input_dtype(0) : x_as, p, read_w);
          if (out[0].dtype() != n.input_dtype(0))
            out[0] = kernels::cast(out[0], n.input_dtype(0), {}, MemoryCategory::gradients);
        }
        if (n.needs_input_grad(1)) {
          // The optimizer may keep the weight gradient as what computes it, until its step (loss
          // scaling: every gradient is checked before any update). dy and x are kept then: where
          // they hold at most half the gradient's bytes (ResNet's 512-channel 3x3 layers at batch
          // 64: 3 MiB against 9 MiB of FP32 gradient), the step computes it.
          const DType dt = n.input_dtype(1);
          GradPartDeferral defer;
          if (p == Partials::kF32 && 2 * (g.nbytes() + xd.nbytes()) <= wd.numel() * dtype_size(dt))
            defer = autograd::take_grad_part_deferral(n, 1);
          if (defer)
            defer(
                [g, xd, shape = wd.shape(), prm, dt, read_x](const GradPartConsumer& consume) {
                  const Tensor dw = kernels::conv2d_backward_weight(g, xd, shape, prm, dt,
                                                                    Partials::kF32, read_x);
                  consume(0, dw.numel(), dw.data_ptr(), dw.dtype());
                },
                kernels::conv2d_weight_grad_bound(g, xd, dt, read_x));
          else
            out[1] = kernels::conv2d_backward_weight(g, xd, wd.shape(), prm, dt, p, read_x);
        }
        if (n.needs_input_grad(2))
          out[2] = kernels::sum(g, {0, 2, 3}, false, n.input_dtype(2), MemoryCategory::gradients);
        return out;
      });
}

// ---- Pooling ----

Tensor max_pool2d(const Tensor& x, const Pool2dParams& p, const OpOptions& opt) {
  detail::OpCall call(OpId::max_pool2d, opt, {&x});
  if (call.active()) return call.finish(max_pool2d(call.in(0), p, call.options()));
  auto [y, idx] = kernels::max_pool2d(x.detach(), p, out_or(opt, x.dtype()));
  const Shape xs = x.shape();
  return recorded(y, OpId::max_pool2d, {&x},
                  [idx, xs, p](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
                    return {kernels::max_pool2d_backward(g, idx, xs, p, n.input_dtype(0))};
                  });
}

Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p, const OpOptions& opt) {
  detail::OpCall call(OpId::avg_pool2d, opt, {&x});
  if (call.active()) return call.finish(avg_pool2d(call.in(0), p, call.options()));
  Tensor y = kernels::avg_pool2d(x.detach(), p, out_or(opt, x.dtype()));
  const Shape xs = x.shape();
  return recorded(y, OpId::avg_pool2d, {&x},
                  [xs, p](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
                    return {kernels::avg_pool2d_backward(g, xs, p, n.input_dtype(0))};
                  });
}

Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w, const OpOptions& opt) {
  detail::OpCall call(OpId::adaptive_avg_pool2d, opt, {&x});
  if (call.active())
    return call.finish(adaptive_avg_pool2d(call.in(0), out_h, out_w, call.options()));
  Tensor y = kernels::adaptive_avg_pool2d(x.detach(), out_h, out_w, out_or(opt, x.dtype()));
  const Shape xs = x.shape();
  return recorded(y, OpId::adaptive_avg_pool2d, {&x},
                  [xs](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
                    return {kernels::adaptive_avg_pool2d_backward(g, xs, n.input_dtype(0))};
                  });
}

// ---- Elementwise ----

Tensor relu(const Tensor& x, const OpOptions& opt) {
  detail::OpCall call(OpId::relu, opt, {&x});
  if (call.active()) return call.finish(relu(call.in(0), call.options()));
  return unary_op(OpId::relu, UnaryOp::kRelu, x, opt, true);
}
Tensor gelu(const Tensor& x, const OpOptions& opt) {
  detail::OpCall call(OpId::gelu, opt, {&x});
  if (call.active()) return call.finish(gelu(call.in(0), call.options()));
  return unary_op(OpId::gelu, UnaryOp::kGelu, x, opt, false);
}
Tensor sigmoid(const Tensor& x, const OpOptions& opt) {
  detail::OpCall call(OpId::sigmoid, opt, {&x});
  if (call.active()) return call.finish(sigmoid(call.in(0), call.options()));
  return unary_op(OpId::sigmoid, UnaryOp::kSigmoid, x, opt, true);
}
Tensor tanh(const Tensor& x, const OpOptions& opt) {
  detail::OpCall call(OpId::tanh, opt, {&x});
  if (call.active()) return call.finish(tanh(call.in(0), call.options()));
  return unary_op(OpId::tanh, UnaryOp::kTanh, x, opt, true);
}
Tensor add(const Tensor& a, const Tensor& b, const OpOptions& opt) {
  detail::OpCall call(OpId::add, opt, {&a, &b});
  if (call.active()) return call.finish(add(call.in(0), call.in(1), call.options()));
  return binary_op(OpId::add, BinaryOp::kAdd, a, b, opt);
}
Tensor sub(const Tensor& a, const Tensor& b, const OpOptions& opt) {
  detail::OpCall call(OpId::sub, opt, {&a, &b});
  if (call.active()) return call.finish(sub(call.in(0), call.in(1), call.options()));
  return binary_op(OpId::sub, BinaryOp::kSub, a, b, opt);
}
Tensor mul(const Tensor& a, const Tensor& b, const OpOptions& opt) {
  detail::OpCall call(OpId::mul, opt, {&a, &b});
  if (call.active()) return call.finish(mul(call.in(0), call.in(1), call.options()));
  return binary_op(OpId::mul, BinaryOp::kMul, a, b, opt);
}
Tensor div(const Tensor& a, const Tensor& b, const OpOptions& opt) {
  detail::OpCall call(OpId::div, opt, {&a, &b});
  if (call.active()) return call.finish(div(call.in(0), call.in(1), call.options()));
  return binary_op(OpId::div, BinaryOp::kDiv, a, b, opt);
}

Tensor add_scalar(const Tensor& a, double s, const OpOptions& opt) {
  detail::OpCall call(OpId::add_scalar, opt, {&a});
  if (call.active()) return call.finish(add_scalar(call.in(0), s, call.options()));
  Tensor y = kernels::binary_scalar(BinaryOp::kAdd, a.detach(), s, false, out_or(opt, a.dtype()));
  return recorded(
      y, OpId::add_scalar, {&a}, [](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        return {g.dtype() == n.input_dtype(0)
                    ? g
                    : kernels::cast(g, n.input_dtype(0), {}, MemoryCategory::gradients)};
      });
}

Tensor mul_scalar(const Tensor& a, double s, const OpOptions& opt) {
  detail::OpCall call(OpId::mul_scalar, opt, {&a});
  if (call.active()) return call.finish(mul_scalar(call.in(0), s, call.options()));
  Tensor y = kernels::binary_scalar(BinaryOp::kMul, a.detach(), s, false, out_or(opt, a.dtype()));
  return recorded(y, OpId::mul_scalar, {&a},
                  [s](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
                    return {kernels::binary_scalar(BinaryOp::kMul, g, s, false, n.input_dtype(0),
                                                   MemoryCategory::gradients)};
                  });
}

// ---- Normalization ----

namespace {

// batch_norm and sync_batch_norm: `sync` (or null) goes to the kernels, forward and backward.
Tensor batch_norm_op(const Tensor& x, const Tensor& weight, const Tensor& bias,
                     const Tensor& running_mean, const Tensor& running_var, bool training,
                     const std::shared_ptr<const kernels::ChannelSums>& sync, double momentum,
                     double eps, const OpOptions& opt) {
  detail::OpCall call(OpId::batch_norm, opt, {&x, &weight, &bias});
  if (call.active())
    return call.finish(batch_norm_op(call.in(0), call.in(1), call.in(2), running_mean, running_var,
                                     training, sync, momentum, eps, call.options()));
  const Tensor xd = x.detach(), wd = weight.defined() ? weight.detach() : Tensor();
  auto [y, mean, rstd] =
      kernels::batch_norm(xd, wd, bias.defined() ? bias.detach() : Tensor(),
                          running_mean.defined() ? running_mean.detach() : Tensor(),
                          running_var.defined() ? running_var.detach() : Tensor(), training,
                          momentum, eps, out_or(opt, x.dtype()), sync.get());
  return recorded(y, OpId::batch_norm, {&x, &weight, &bias},
                  [xd, wd, mean = mean, rstd = rstd, training, sync](
                      const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
                    auto [dx, dw, db] = kernels::batch_norm_backward(
                        g, xd, wd, mean, rstd, training, n.input_dtype(0), sync.get());
                    return {n.needs_input_grad(0) ? dx : Tensor(),
                            n.needs_input_grad(1) ? dw : Tensor(),
                            n.needs_input_grad(2) ? db : Tensor()};
                  });
}

}  // namespace

Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                  const Tensor& running_mean, const Tensor& running_var, bool training,
                  double momentum, double eps, const OpOptions& opt) {
  return batch_norm_op(x, weight, bias, running_mean, running_var, training, nullptr, momentum, eps,
                       opt);
}

Tensor sync_batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const Tensor& running_mean, const Tensor& running_var, bool training,
                       const kernels::ChannelSums& sync, double momentum, double eps,
                       const OpOptions& opt) {
  return batch_norm_op(x, weight, bias, running_mean, running_var, training,
                       training ? std::make_shared<const kernels::ChannelSums>(sync) : nullptr,
                       momentum, eps, opt);
}

Tensor group_norm(const Tensor& x, int64_t groups, const Tensor& weight, const Tensor& bias,
                  double eps, const OpOptions& opt) {
  detail::OpCall call(OpId::group_norm, opt, {&x, &weight, &bias});
  if (call.active())
    return call.finish(group_norm(call.in(0), groups, call.in(1), call.in(2), eps, call.options()));
  const Tensor xd = x.detach(), wd = weight.defined() ? weight.detach() : Tensor();
  auto [y, mean, rstd] = kernels::group_norm(
      xd, groups, wd, bias.defined() ? bias.detach() : Tensor(), eps, out_or(opt, x.dtype()));
  return recorded(
      y, OpId::group_norm, {&x, &weight, &bias},
      [xd, wd, mean = mean, rstd = rstd, groups](const Tensor& g,
                                                 const FnNode& n) -> std::vector<Tensor> {
        auto [dx, dw, db] =
            kernels::group_norm_backward(g, xd, groups, wd, mean, rstd, n.input_dtype(0));
        return {n.needs_input_grad(0) ? dx : Tensor(), n.needs_input_grad(1) ? dw : Tensor(),
                n.needs_input_grad(2) ? db : Tensor()};
      });
}

Tensor layer_norm(const Tensor& x, int64_t normalized_dims, const Tensor& weight,
                  const Tensor& bias, double eps, const OpOptions& opt) {
  detail::OpCall call(OpId::layer_norm, opt, {&x, &weight, &bias});
  if (call.active())
    return call.finish(
        layer_norm(call.in(0), normalized_dims, call.in(1), call.in(2), eps, call.options()));
  const Tensor xd = x.detach(), wd = weight.defined() ? weight.detach() : Tensor();
  auto [y, mean, rstd] =
      kernels::layer_norm(xd, normalized_dims, wd, bias.defined() ? bias.detach() : Tensor(), eps,
                          out_or(opt, x.dtype()));
  return recorded(
      y, OpId::layer_norm, {&x, &weight, &bias},
      [xd, wd, mean = mean, rstd = rstd, normalized_dims](const Tensor& g,
                                                          const FnNode& n) -> std::vector<Tensor> {
        auto [dx, dw, db] =
            kernels::layer_norm_backward(g, xd, normalized_dims, wd, mean, rstd, n.input_dtype(0));
        return {n.needs_input_grad(0) ? dx : Tensor(), n.needs_input_grad(1) ? dw : Tensor(),
                n.needs_input_grad(2) ? db : Tensor()};
      });
}

Tensor dropout(const Tensor& x, double p, bool training, uint64_t seed, uint64_t stream,
               const OpOptions& opt) {
  detail::OpCall call(OpId::dropout, opt, {&x});
  if (call.active())
    return call.finish(dropout(call.in(0), p, training, seed, stream, call.options()));
  if (!training || p == 0.0) return opt.out && *opt.out != x.dtype() ? cast(x, *opt.out) : x;
  Tensor y = kernels::dropout(x.detach(), p, seed, stream, out_or(opt, x.dtype()));
  // The mask is recomputed from (seed, stream): nothing saved.
  return recorded(
      y, OpId::dropout, {&x},
      [p, seed, stream](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        return {kernels::dropout(g, p, seed, stream, n.input_dtype(0), MemoryCategory::gradients)};
      });
}

// ---- Layout ----

Tensor reshape(const Tensor& x, const Shape& shape, const OpOptions& opt) {
  detail::OpCall call(OpId::reshape, opt, {&x});
  if (call.active()) return call.finish(reshape(call.in(0), shape, call.options()));
  const Shape xs = x.shape();
  return layout_op(OpId::reshape, x, x.detach().reshape(shape), opt,
                   [xs](const Tensor& g) { return g.reshape(xs); });
}

Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim, const OpOptions& opt) {
  detail::OpCall call(OpId::flatten, opt, {&x});
  if (call.active()) return call.finish(flatten(call.in(0), start_dim, end_dim, call.options()));
  const Shape xs = x.shape();
  return layout_op(OpId::flatten, x, x.detach().flatten(start_dim, end_dim), opt,
                   [xs](const Tensor& g) { return g.reshape(xs); });
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1, const OpOptions& opt) {
  detail::OpCall call(OpId::transpose, opt, {&x});
  if (call.active()) return call.finish(transpose(call.in(0), d0, d1, call.options()));
  return layout_op(OpId::transpose, x, x.detach().transpose(d0, d1), opt,
                   [d0, d1](const Tensor& g) { return g.transpose(d0, d1); });
}

Tensor cat(const std::vector<Tensor>& xs, int64_t dim, const OpOptions& opt) {
  MANTISSA_CHECK(!xs.empty(), "cat: no tensors given", "pass at least one tensor");
  std::vector<const Tensor*> ptrs;
  for (const Tensor& x : xs) ptrs.push_back(&x);
  detail::OpCall call(OpId::cat, opt, ptrs);
  if (call.active()) return call.finish(cat(call.inputs(), dim, call.options()));
  DType t = xs[0].dtype();
  std::vector<Tensor> raw;
  for (const Tensor& x : xs) {
    t = promote_types(t, x.dtype());
    raw.push_back(x.detach());
  }
  Tensor y = kernels::cat(raw, dim, out_or(opt, t));
  bool needs = false;
  for (const Tensor& x : xs) needs = needs || autograd::needs_grad({&x});
  if (!needs) return y;
  // Record with every input: the engine takes inputs as a list of pointers.
  std::vector<int64_t> sizes;
  for (const Tensor& x : xs) sizes.push_back(x.size(dim));
  auto node = std::make_shared<FnNode>(
      OpId::cat, [sizes, dim](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        std::vector<Tensor> out(sizes.size());
        int64_t at = 0;
        for (size_t i = 0; i < sizes.size(); ++i) {
          if (n.needs_input_grad(i))
            out[i] = kernels::cast(g.narrow(dim, at, sizes[i]), n.input_dtype(i), {},
                                   MemoryCategory::gradients);
          at += sizes[i];
        }
        return out;
      });
  autograd::record_many(y, node, ptrs);
  return y;
}

// ---- Reductions and probabilities ----

Tensor sum(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, const OpOptions& opt) {
  detail::OpCall call(OpId::sum, opt, {&x});
  if (call.active()) return call.finish(sum(call.in(0), dims, keepdim, call.options()));
  Tensor y = kernels::sum(x.detach(), dims, keepdim, out_or(opt, x.dtype()));
  const Shape xs = x.shape();
  return recorded(y, OpId::sum, {&x},
                  [xs, dims, keepdim](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
                    return {expand_grad(g, xs, dims, keepdim, 1.0, n.input_dtype(0))};
                  });
}

Tensor mean(const Tensor& x, const std::vector<int64_t>& dims, bool keepdim, const OpOptions& opt) {
  detail::OpCall call(OpId::mean, opt, {&x});
  if (call.active()) return call.finish(mean(call.in(0), dims, keepdim, call.options()));
  int64_t count = 1;
  if (dims.empty()) {
    count = x.numel();
  } else {
    for (int64_t d : dims) count *= x.size(d);
  }
  const double scale = 1.0 / static_cast<double>(std::max<int64_t>(count, 1));
  const Tensor s = kernels::sum(x.detach(), dims, keepdim, DType::f32, MemoryCategory::workspace);
  Tensor y = kernels::binary_scalar(BinaryOp::kMul, s, scale, false, out_or(opt, x.dtype()));
  const Shape xs = x.shape();
  return recorded(
      y, OpId::mean, {&x},
      [xs, dims, keepdim, scale](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
        return {expand_grad(g, xs, dims, keepdim, scale, n.input_dtype(0))};
      });
}

Tensor softmax(const Tensor& x, int64_t dim, const OpOptions& opt) {
  detail::OpCall call(OpId::softmax, opt, {&x});
  if (call.active()) return call.finish(softmax(call.in(0), dim, call.options()));
  Tensor y = kernels::softmax(x.detach(), dim, false, out_or(opt, x.dtype()));
  const Tensor yd = y.detach();
  return recorded(y, OpId::softmax, {&x},
                  [yd, dim](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
                    return {kernels::softmax_backward(g, yd, dim, false, n.input_dtype(0))};
                  });
}

Tensor log_softmax(const Tensor& x, int64_t dim, const OpOptions& opt) {
  detail::OpCall call(OpId::log_softmax, opt, {&x});
  if (call.active()) return call.finish(log_softmax(call.in(0), dim, call.options()));
  Tensor y = kernels::softmax(x.detach(), dim, true, out_or(opt, x.dtype()));
  const Tensor yd = y.detach();
  return recorded(y, OpId::log_softmax, {&x},
                  [yd, dim](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
                    return {kernels::softmax_backward(g, yd, dim, true, n.input_dtype(0))};
                  });
}

// ---- Losses ----

Tensor nll_loss(const Tensor& log_probs, const Tensor& target, int64_t ignore_index,
                const OpOptions& opt) {
  detail::OpCall call(OpId::nll_loss, opt, {&log_probs, &target});
  if (call.active())
    return call.finish(nll_loss(call.in(0), call.in(1), ignore_index, call.options()));
  const Tensor lp = log_probs.detach(), t = target.detach();
  Tensor y = loss_output(kernels::nll_loss(lp, t, ignore_index), opt);
  return recorded(y, OpId::nll_loss, {&log_probs},
                  [lp, t, ignore_index](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
                    return {kernels::nll_loss_backward(g, lp, t, ignore_index, n.input_dtype(0))};
                  });
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing,
                     int64_t ignore_index, const OpOptions& opt) {
  detail::OpCall call(OpId::cross_entropy, opt, {&logits, &target});
  if (call.active())
    return call.finish(
        cross_entropy(call.in(0), call.in(1), label_smoothing, ignore_index, call.options()));
  const Tensor x = logits.detach(), t = target.detach();
  Tensor y = loss_output(kernels::cross_entropy(x, t, label_smoothing, ignore_index), opt);
  return recorded(y, OpId::cross_entropy, {&logits},
                  [x, t, label_smoothing, ignore_index](const Tensor& g,
                                                        const FnNode& n) -> std::vector<Tensor> {
                    return {kernels::cross_entropy_backward(g, x, t, label_smoothing, ignore_index,
                                                            n.input_dtype(0))};
                  });
}

// ---- Cast ----

Tensor cast(const Tensor& x, DType dtype, const CastOptions& rounding) {
  detail::OpCall call(OpId::cast, {}, {&x});  // active only to check the output for anomalies
  if (call.active()) return call.finish(cast(call.in(0), dtype, rounding));
  Tensor y = kernels::cast(x.detach(), dtype, rounding);
  return recorded(y, OpId::cast, {&x}, [](const Tensor& g, const FnNode& n) -> std::vector<Tensor> {
    return {kernels::cast(g, n.input_dtype(0), {}, MemoryCategory::gradients)};
  });
}

Tensor normalize_input(const Tensor& x, const std::vector<float>& mean,
                       const std::vector<float>& std, DType out) {
  detail::OpCall call(OpId::normalize_input, {}, {&x});  // as cast's
  if (call.active()) return call.finish(normalize_input(call.in(0), mean, std, out));
  MANTISSA_CHECK(x.dtype() == DType::u8 && x.dim() == 4,
                 "normalize_input takes u8 images (N, C, H, W), not " +
                     std::string(dtype_name(x.dtype())) + " " + shape_str(x.shape()),
                 "hand it the loader's 8-bit batches");
  MANTISSA_CHECK(
      is_compute_float(out),
      "normalize_input: output type " + std::string(dtype_name(out)) + " is not a compute type",
      "use f32, f16 or bf16");
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  MANTISSA_CHECK(!mean.empty() && mean.size() == std.size() &&
                     (mean.size() == 1 || static_cast<int64_t>(mean.size()) == C),
                 "normalize_input: " + std::to_string(mean.size()) + " means and " +
                     std::to_string(std.size()) + " std values for " + std::to_string(C) +
                     " channels",
                 "give one mean and std per channel, or one for all");
  for (float s : std)
    MANTISSA_CHECK(s > 0 && std::isfinite(s), "normalize_input: std values must be positive", "");
  const Tensor src = x.contiguous();
  Tensor y = Tensor::empty(x.shape(), out, charged_to(MemoryCategory::activations));
  const uint8_t* p = static_cast<const uint8_t*>(src.data_ptr());
  char* dst = static_cast<char*>(y.data_ptr());
  const size_t esize = dtype_size(out);
  parallel_for(static_cast<size_t>(N * C), 1, default_num_threads(), [&](size_t begin, size_t end) {
    std::vector<float> row(static_cast<size_t>(HW));
    for (size_t nc = begin; nc < end; ++nc) {
      const size_t k = mean.size() == 1 ? 0 : nc % static_cast<size_t>(C);
      const float m = mean[k], sd = std[k];
      const uint8_t* r = p + nc * static_cast<size_t>(HW);
      for (int64_t i = 0; i < HW; ++i) row[static_cast<size_t>(i)] = (r[i] / 255.0f - m) / sd;
      kernels::store_f32(row.data(), HW, dst + nc * static_cast<size_t>(HW) * esize, out, 1);
    }
  });
  return y;
}

}  // namespace mantissa::ops
