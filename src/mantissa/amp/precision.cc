#include "mantissa/amp/precision.h"

#include <sstream>

#include "mantissa/core/error.h"

namespace mantissa::amp {
namespace {

enum class Kind { kFp32, kMixed, kO2, kTrue, kHalfInput, kFp8Hybrid, kFp8E4m3 };

struct Entry {
  const char* name;
  Kind kind;
  std::optional<DType> fixed_half;  // the type the name fixes (16-mixed: f16, bf16-true: bf16)
};

const Entry kModes[] = {
    {"32-true", Kind::kFp32, std::nullopt},
    {"O0", Kind::kFp32, std::nullopt},
    {"32.32", Kind::kFp32, std::nullopt},
    {"16-mixed", Kind::kMixed, DType::f16},
    {"bf16-mixed", Kind::kMixed, DType::bf16},
    {"O1", Kind::kMixed, std::nullopt},
    {"O2", Kind::kO2, std::nullopt},
    {"16-true", Kind::kTrue, DType::f16},
    {"bf16-true", Kind::kTrue, DType::bf16},
    {"O3", Kind::kTrue, std::nullopt},
    {"16.16", Kind::kTrue, std::nullopt},
    {"16.32", Kind::kHalfInput, std::nullopt},
    {"fp8-hybrid", Kind::kFp8Hybrid, DType::bf16},
    {"fp8-e4m3", Kind::kFp8E4m3, DType::bf16},
};

std::string scaling_str(const std::optional<LossScalerOptions>& s) {
  if (!s) return "none";
  std::ostringstream os;
  if (!s->dynamic) {
    os << "static " << s->init_scale;
    return os.str();
  }
  os << "dynamic (initial " << s->init_scale << ", x" << s->growth_factor << " after "
     << s->growth_interval << " clean steps, x" << s->backoff_factor << " on overflow";
  if (s->min_scale) os << ", min " << *s->min_scale;
  if (s->max_scale) os << ", max " << *s->max_scale;
  if (s->hysteresis > 1) os << ", hysteresis " << s->hysteresis;
  os << ")";
  return os.str();
}

}  // namespace

std::vector<std::string> precision_names() {
  std::vector<std::string> out;
  for (const Entry& e : kModes) out.push_back(e.name);
  return out;
}

PrecisionMode precision_mode(const std::string& name, std::optional<DType> half) {
  const Entry* entry = nullptr;
  for (const Entry& e : kModes)
    if (name == e.name) entry = &e;
  if (!entry) {
    std::string all;
    for (const Entry& e : kModes) all += (all.empty() ? "" : ", ") + std::string(e.name);
    throw Error("unknown precision '" + excerpt(name) + "'", "choose --precision from: " + all);
  }
  MANTISSA_CHECK(!half || *half == DType::f16 || *half == DType::bf16,
                 "--half-type must be fp16 or bf16", "");
  MANTISSA_CHECK(
      !half || !entry->fixed_half || *half == *entry->fixed_half,
      "--precision " + name + " fixes the 16-bit type to " +
          std::string(dtype_name(*entry->fixed_half)),
      entry->kind == Kind::kFp8Hybrid || entry->kind == Kind::kFp8E4m3
          ? "drop --half-type: the FP8 modes need no loss scaling, which FP16 would"
          : "drop --half-type, or use the other name (16-mixed/bf16-mixed, 16-true/bf16-true)");
  MANTISSA_CHECK(!half || entry->kind != Kind::kFp32,
                 "--precision " + name + " uses no 16-bit type", "drop --half-type");
  PrecisionMode m;
  m.name = name;
  m.half = entry->fixed_half.value_or(half.value_or(DType::f16));
  const bool fp16 = m.half == DType::f16;
  switch (entry->kind) {
    case Kind::kFp32:
      break;
    case Kind::kMixed:  // FP32 parameters; ops cast by the lists; dynamic scaling for FP16
      m.autocast = true;
      if (fp16) m.loss_scaling = LossScalerOptions{};
      break;
    case Kind::kO2:  // 16-bit model but normalization, FP32 masters, FP32 loss, dynamic scaling
      // The 16-bit model is the FP32 masters read as 16-bit (no copy of 2 bytes a parameter);
      // its input arrives in 16 bits, as the model's first op would cast it. Masters for the
      // parameters --half-modules stores in 16 bits.
      m.read_as_half = true;
      m.keep_norm_fp32 = true;
      m.input_dtype = m.half;
      m.master_weights = true;
      m.fp32_loss = true;
      if (fp16) m.loss_scaling = LossScalerOptions{};
      break;
    case Kind::kTrue:  // everything 16-bit; optimizer state 16-bit
      m.param_dtype = m.half;
      m.input_dtype = m.half;
      m.first_moment = m.half;
      // FP16 cannot hold squared gradients (1e-3^2 * (1 - 0.999) = 1e-9 flushes to zero, and a
      // zero second moment turns Adam's step into m / eps): the second moment is BF16.
      m.second_moment = DType::bf16;
      break;
    case Kind::kHalfInput:  // the IPU guide's 16.32: 16-bit data, FP32 model
      m.input_dtype = m.half;
      break;
    // FP8 matrix ops in a bf16-mixed model. BF16 (fixed by the name) has FP32's range, so no
    // loss scaling: the FP8 tensors have scales of their own, and a dynamic loss scale's overflow
    // steps would put inf into their amax histories, freezing the scales for a history's length.
    case Kind::kFp8Hybrid:
    case Kind::kFp8E4m3:
      m.autocast = true;
      m.fp8_gradients = entry->kind == Kind::kFp8Hybrid ? DType::e5m2 : DType::e4m3;
      break;
  }
  return m;
}

std::string PrecisionMode::describe() const {
  std::ostringstream os;
  auto t = [](DType d) { return std::string(dtype_name(d)); };
  os << "precision " << name << ": parameters " << t(param_dtype)
     << (read_as_half ? ", read as " + t(half) : std::string())
     << (keep_norm_fp32 ? " (normalization layers f32)" : "") << ", input " << t(input_dtype)
     << ", autocast " << (autocast ? "to " + t(half) + " by op lists" : std::string("off"))
     << ", master weights "
     << (read_as_half     ? "f32 (the parameters)"
         : master_weights ? "f32"
                          : "none")
     << ", loss " << (fp32_loss ? "f32 (output cast)" : "as computed") << ", loss scaling "
     << scaling_str(loss_scaling) << ", optimizer state " << t(first_moment) << "/"
     << t(second_moment);
  return os.str();
}

DType parse_float_type(const std::string& text, const std::string& flag) {
  const std::optional<DType> t = parse_dtype(text);  // the names and aliases of core/dtype.h
  if (t && is_compute_float(*t)) return *t;
  throw Error(flag + " '" + excerpt(text) + "' is not a type", "use fp32, fp16 or bf16");
}

}  // namespace mantissa::amp
