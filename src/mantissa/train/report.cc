#include "mantissa/train/report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "mantissa/core/parallel.h"
#include "mantissa/io/output_file.h"

namespace mantissa::train {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string clock_str(double s) {
  const long t = std::lround(std::max(0.0, s));
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%02ld:%02ld", t / 60, t % 60);
  return buf;
}

}  // namespace

ProgressBar::ProgressBar(std::ostream* os, bool enabled)
    : os_(os), enabled_(enabled && os != nullptr) {
  tty_ = enabled_ && isatty(STDERR_FILENO);
}

void ProgressBar::update(int64_t epoch, int64_t epochs, int64_t done, int64_t total, double elapsed,
                         double images, double loss, double acc, bool final,
                         const amp::LossScaler* scaler) {
  if (!enabled_) return;
  const auto now = Clock::now();
  const double since = std::chrono::duration<double>(now - last_).count();
  if (!final && since < (tty_ ? 0.1 : 10.0)) return;
  last_ = now;
  const double frac = total > 0 ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  const int width = 20;
  const int filled = static_cast<int>(frac * width);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(width, ' ');
  const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
  const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0;
  char scale[64] = "";
  if (scaler)
    std::snprintf(scale, sizeof scale, ", scale=%g, skipped=%lld", scaler->scale(),
                  static_cast<long long>(scaler->skipped_steps()));
  char line[320];
  std::snprintf(line, sizeof line,
                "epoch %lld/%lld %3d%%|%s| %lld/%lld [%s<%s, %.2f it/s, %.0f img/s, loss=%.4f, "
                "acc=%.2f%%%s]",
                static_cast<long long>(epoch), static_cast<long long>(epochs),
                static_cast<int>(frac * 100), bar.c_str(), static_cast<long long>(done),
                static_cast<long long>(total), clock_str(elapsed).c_str(), clock_str(eta).c_str(),
                rate, elapsed > 0 ? images / elapsed : 0, loss, acc * 100, scale);
  *os_ << (tty_ ? "\r" : "") << line << (tty_ && !final ? "" : "\n") << std::flush;
}

void EpochTally::add(const CallOutput& co) {
  images_ += co.images;
  for (const StepOutput& o : co.outputs) {
    loss_sum_ += o.loss_sum;
    loss_steps_ += o.steps;
    correct_ += o.correct;
    counted_ += o.examples;
  }
}

double EpochTally::loss() const {
  return loss_steps_ > 0 ? loss_sum_ / static_cast<double>(loss_steps_) : 0;
}

double EpochTally::accuracy() const {
  return counted_ > 0 ? static_cast<double>(correct_) / static_cast<double>(counted_) : 0;
}

std::string epoch_line(const EpochStats& e) {
  return "epoch " + std::to_string(e.epoch) + ": loss " + fmt("%.4f", e.loss) +
         ", train accuracy " + fmt("%.2f", e.train_accuracy * 100) + "%, " +
         fmt("%.1f", e.seconds) + " s, " + fmt("%.1f", e.images_per_second) + " images/s";
}

std::string test_line(double accuracy, int64_t examples) {
  return "test accuracy: " + fmt("%.2f", accuracy * 100) + "% (" + std::to_string(examples) +
         " images)";
}

std::string interrupted_line(int64_t step, const std::string& save) {
  return "interrupted at step " + std::to_string(step) +
         (save.empty()
              ? std::string()
              : ", checkpoint saved to " + save + " (continue with --resume " + save + ")");
}

std::string summary_line(const TrainResult& r, int64_t batch_bytes) {
  std::string line = "training: " + fmt("%.1f", r.images_per_second) + " images/s (" +
                     fmt("%.1f", r.gflops_per_second) + " GFLOP/s at " +
                     fmt("%.4g", r.flops_per_image * 1e-6) + " MFLOP an image), waited " +
                     fmt("%.2f", r.data_wait_seconds) + " s for data (" +
                     format_bytes(static_cast<size_t>(batch_bytes)) + " a batch), host " +
                     fmt("%.0f", r.host_seconds_per_step * 1e6) + " us a step, peak memory " +
                     format_bytes(r.memory.peak_total) +
                     (r.loss_scale ? ", loss scale " + fmt("%g", *r.loss_scale) + ", " +
                                         std::to_string(r.skipped_steps) + " steps skipped"
                                   : std::string());
  if (r.communication) line += '\n' + communication_line(*r.communication);
  return line;
}

namespace {
// ", fc1.weight as factors" (the weights whose gradients travel as their factors).
std::string factored_note(const Communication& c) {
  std::string s;
  for (const std::string& w : c.factored) s += (s.empty() ? ", " : " and ") + w;
  return s.empty() ? s : s + " as factors";
}
}  // namespace

std::string communication_line(const Communication& c) {
  return "communication: " + std::to_string(c.world_size) + " ranks, " +
         format_bytes(static_cast<size_t>(c.bytes_per_step)) + " a step (gradients as " + c.wire +
         "), collectives running " + fmt("%.1f", c.seconds_per_step * 1e3) +
         " ms a step, the step waiting for them " + fmt("%.1f", c.exposed_seconds_per_step * 1e3) +
         " ms" + factored_note(c);
}

std::string profile_table(const TrainResult& r) {
  if (r.profiled_steps <= 0) return "profile: no training step ran\n";
  const double steps = static_cast<double>(r.profiled_steps);
  const double total = r.train_seconds / steps;
  std::ostringstream o;
  char line[256];
  auto row = [&](const std::string& phase, const std::string& where, const std::string& op,
                 double seconds, double calls) {
    const double ms = seconds / steps * 1e3;
    const std::string c = calls > 0 ? fmt("%.0f", calls / steps) : std::string();
    std::snprintf(line, sizeof line, "  %-11s %-24s %-18s %9.3f %6.1f%% %6s", phase.c_str(),
                  where.c_str(), op.c_str(), ms, total > 0 ? ms / (total * 1e3) * 100 : 0,
                  c.c_str());
    std::string l = line;
    l.erase(l.find_last_not_of(' ') + 1);
    o << l << '\n';
  };
  o << "profile: " << r.profiled_steps << " steps, " << fmt("%.3f", total * 1e3)
    << " ms a step (wall clock; a multithreaded op's time includes its workers')\n";
  std::snprintf(line, sizeof line, "  %-11s %-24s %-18s %9s %7s %6s\n", "phase", "module", "op",
                "ms/step", "share", "calls");
  o << line;
  auto step_seconds = [&](const char* op) {
    for (const ProfileRow& p : r.profile)
      if (p.phase == "step" && p.where.empty() && p.op == op) return p.seconds;
    return 0.0;
  };
  double accounted = 0;
  for (const char* phase : {"data", "forward", "backward", "recompute", "in-backward",
                            "communication", "optimizer", "zero_grad"}) {
    const std::string ph = phase;
    const bool inclusive_only = ph == "data" || ph == "zero_grad" || ph == "communication";
    // Recomputed forwards and updates in the backward pass run inside the backward rows of
    // their modules: listed, not added again.
    const bool nested = ph == "recompute" || ph == "in-backward";
    const double inclusive = step_seconds(phase);
    if (!nested) accounted += inclusive;
    if (inclusive_only) {
      if (inclusive > 0) row(phase, "", "", inclusive, 0);
      continue;
    }
    double inside = 0;
    for (const ProfileRow& p : r.profile) {
      if (p.phase != phase) continue;
      row(phase, p.where.empty() ? "-" : p.where, p.op, p.seconds, static_cast<double>(p.calls));
      inside += p.seconds;
    }
    if (nested) continue;
    if (inclusive > 0) row(phase, "(rest)", "", std::max(0.0, inclusive - inside), 0);
  }
  row("(loop)", "(rest)", "", std::max(0.0, r.train_seconds - accounted), 0);
  return o.str();
}

std::string metrics_json(const TrainConfig& c, const RunSettings& s, const TrainResult& r) {
  json j;
  j["config"] = {{"model", s.model},
                 {"dataset", s.dataset},
                 {"data_dir", c.data_dir},
                 {"image_size", s.image_size ? json(*s.image_size) : json(nullptr)},
                 {"batch_size", c.batch_size},
                 {"epochs", c.epochs},
                 {"max_steps", c.max_steps},
                 {"train_limit", c.train_limit},
                 {"test_limit", c.test_limit},
                 {"shuffle", c.shuffle},
                 {"augment", c.augment},
                 {"optimizer", c.optimizer},
                 {"lr", c.lr},
                 {"lr_schedule", c.lr_schedule},
                 {"warmup_steps", c.warmup_steps},
                 {"weight_decay", s.weight_decay},
                 {"momentum", c.momentum},
                 {"max_grad_norm", c.max_grad_norm},
                 {"bias_correction", c.bias_correction},
                 {"seed", c.seed},
                 {"threads", c.threads > 0 ? c.threads : default_num_threads()},
                 {"init_from", c.init_from},
                 {"resume", c.resume},
                 {"precision", c.precision},
                 {"half_type", c.half_type},
                 {"keep_fp32", c.keep_fp32},
                 {"half_modules", c.half_modules},
                 {"loss_scaling", c.loss_scaling},
                 {"stochastic_rounding", c.stochastic_rounding},
                 {"stochastic_outputs", c.stochastic_outputs},
                 {"kahan", c.kahan},
                 {"partials", c.partials},
                 {"accum_type", c.accum_type},
                 {"first_moment_type", c.first_moment_type},
                 {"second_moment_type", c.second_moment_type},
                 {"memory_budget", c.memory_budget},
                 {"gradient_accumulation", c.gradient_accumulation},
                 {"accumulation_reduction", c.accumulation_reduction},
                 {"device_iterations", c.device_iterations},
                 {"output_mode", c.output_mode},
                 {"output_return_period", c.output_return_period},
                 {"eight_bit_io", c.eight_bit_io},
                 {"detect_anomaly", c.detect_anomaly},
                 {"profile", c.profile},
                 {"update_in_backward", c.update_in_backward},
                 {"recompute", c.recompute},
                 {"numerics_report", c.numerics_report},
                 {"report", c.report},
                 {"async_dataloader", c.async_loader},
                 {"workers", c.async_loader ? c.workers : 0},
                 {"bucket_size_mib", c.bucket_size_mib},
                 {"allreduce_dtype", c.allreduce_dtype},
                 {"sync_batchnorm", c.sync_batchnorm},
                 {"zero", c.zero},
                 {"sufficient_factors", c.sufficient_factors}};
  j["precision_settings"] = s.precision.describe();
  j["step_losses"] = r.step_losses;
  // The training accuracy of what this run's calls returned, at the (last) step each covers.
  json acc_steps = json::array(), accuracy = json::array();
  for (const StepOutput& o : r.outputs) {
    acc_steps.push_back(o.step);
    accuracy.push_back(
        o.examples > 0 ? static_cast<double>(o.correct) / static_cast<double>(o.examples) : 0.0);
  }
  j["step_accuracy"] = {{"steps", acc_steps}, {"accuracy", accuracy}};
  j["epochs"] = json::array();
  for (auto& e : r.epochs)
    j["epochs"].push_back({{"epoch", e.epoch},
                           {"loss", e.loss},
                           {"train_accuracy", e.train_accuracy},
                           {"seconds", e.seconds},
                           {"images_per_second", e.images_per_second},
                           {"steps", e.steps}});
  j["test_accuracy"] = r.test_accuracy ? json(*r.test_accuracy) : json(nullptr);
  j["test_examples"] = r.test_examples;
  j["images_per_second"] = r.images_per_second;
  j["train_seconds"] = r.train_seconds;
  j["step_seconds"] = r.step_seconds;
  j["data_wait_seconds"] = r.data_wait_seconds;
  j["flops_per_image"] = r.flops_per_image;
  j["gflops_per_second"] = r.gflops_per_second;
  j["calls"] = r.calls;
  j["input_bytes"] = r.input_bytes;
  j["host_seconds_per_step"] = r.host_seconds_per_step;
  j["interrupted"] = r.interrupted;
  j["steps"] = r.steps;
  if (c.profile) {
    json rows = json::array();
    for (const ProfileRow& p : r.profile)
      rows.push_back({{"phase", p.phase},
                      {"module", p.where},
                      {"op", p.op},
                      {"calls", p.calls},
                      {"seconds", p.seconds}});
    j["profile"] = {{"steps", r.profiled_steps}, {"rows", rows}};
  }
  json peak = {{"total", r.memory.peak_total}};
  for (MemoryCategory cat : kAllMemoryCategories)
    peak[std::string(memory_category_name(cat))] = r.memory.peak_of(cat);
  j["peak_memory_bytes"] = peak;
  // What the total peak was made of (the per-category peaks above may come at other moments).
  json at_peak = json::object();
  for (MemoryCategory cat : kAllMemoryCategories)
    at_peak[std::string(memory_category_name(cat))] =
        r.memory.at_peak_total[static_cast<size_t>(cat)];
  j["memory_at_peak_bytes"] = at_peak;
  // Data parallelism: the job's ranks, each one's peak, and the gradients' traffic per step.
  j["world_size"] = r.communication ? r.communication->world_size : 1;
  j["peak_memory_bytes_per_rank"] = r.rank_peak_memory;
  if (r.communication)
    j["communication"] = {{"bytes_per_step", r.communication->bytes_per_step},
                          {"seconds_per_step", r.communication->seconds_per_step},
                          {"exposed_seconds_per_step", r.communication->exposed_seconds_per_step},
                          {"wire", r.communication->wire},
                          {"factored_weights", r.communication->factored}};
  else
    j["communication"] = nullptr;
  if (r.loss_scale) {
    json h = json::array();
    for (const amp::ScaleChange& ch : r.loss_scale_history)
      h.push_back({{"step", ch.step}, {"scale", ch.scale}, {"overflow", ch.overflow}});
    // "initial": the settings' starting scale (a resumed run's history goes back to it);
    // "skipped": the steps of the whole run that were skipped (a resumed run's included).
    j["loss_scale"] = {{"initial", s.precision.loss_scaling ? s.precision.loss_scaling->init_scale
                                                            : *r.loss_scale},
                       {"final", *r.loss_scale},
                       {"skipped_steps", r.skipped_steps},
                       {"skipped", r.skipped},
                       {"history", h}};
  } else {
    j["loss_scale"] = nullptr;
  }
  if (const std::optional<amp::Fp8Recipe>& fp8 = s.precision.fp8) {
    json tensors = json::array();
    for (const amp::Fp8TensorReport& t : r.fp8)
      tensors.push_back({{"name", t.name},
                         {"format", std::string(dtype_name(t.format))},
                         {"scale", t.scale},
                         {"amax", std::isfinite(t.amax) ? json(t.amax) : json(nullptr)},
                         {"values", t.count},
                         {"saturated_fraction", t.saturated},
                         {"flushed_fraction", t.flushed}});
    j["fp8"] = {{"forward_format", std::string(dtype_name(fp8->forward))},
                {"gradient_format", std::string(dtype_name(fp8->backward))},
                {"scaling", amp::fp8_scaling_name(fp8->scaling)},
                {"amax_history", fp8->amax_history},
                {"amax_algo", amp::fp8_amax_algo_name(fp8->amax_algo)},
                {"margin", fp8->margin},
                {"keep_layers", fp8->keep},
                {"tensors", tensors}};
  } else {
    j["fp8"] = nullptr;
  }
  return j.dump(2) + "\n";
}

std::string write_numerics_report(const std::string& path, const nn::NumericsRecorder& numerics,
                                  const std::string& title) {
  const std::string html = numerics_page_path(path);
  io::write_file_atomic(path, numerics.json());
  io::write_file_atomic(html, numerics.html(title));
  const int64_t steps = numerics.steps();
  return "numerics report: " + path + " and " + html + " (" + std::to_string(steps) +
         (steps == 1 ? " step" : " steps") + "); suggested loss scale " +
         fmt("%g", numerics.suggested_loss_scale().scale);
}

}  // namespace mantissa::train
