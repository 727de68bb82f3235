#include "mantissa/train/memory_report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "mantissa/core/error.h"
#include "mantissa/dist/reducer.h"
#include "mantissa/io/html.h"
#include "mantissa/kernels/gemm.h"
#include "mantissa/train/data_parallel.h"
#include "mantissa/train/trainer.h"

namespace mantissa::train {
namespace {

using json = nlohmann::json;
namespace html = io::html;

constexpr size_t kMaxPoints = 1000;

json category_json(const CategoryBytes& b) {
  json j = json::object();
  for (MemoryCategory c : kAllMemoryCategories)
    j[std::string(memory_category_name(c))] = b[static_cast<size_t>(c)];
  return j;
}

}  // namespace

namespace {

// One measured run of the training step of `c` (already made synthetic and short): the events
// recorded, with the mode's name and settings in `m`. An allocation that fails (past the budget or
// refused by the system) throws OutOfMemoryError, the recording stopped.
std::vector<MemoryEvent> record_step(const TrainConfig& c, StepMemory& m, int ranks,
                                     bool defer_factors) {
  MemoryTracker& tracker = default_memory_tracker();
  tracker.set_phase("setup");
  tracker.start_recording();
  // One process, whatever launched this one: the figures are a rank's, computed from it.
  const std::unique_ptr<comm::Communicator> alone = comm::make_single_process();
  try {
    Trainer trainer(c, {}, alone.get());
    m.precision = trainer.precision().name;
    m.description = trainer.precision().describe();
    trainer.run();
    const optim::Optimizer& opt = trainer.optimizer();
    size_t state_per_element = 0;
    for (const auto& [name, dtype] : opt.state_layout()) state_per_element += dtype_size(dtype);
    for (const auto& p : opt.params())
      m.params.push_back({p.tensor->numel(), p.tensor->dtype(), p.tensor->requires_grad(),
                          // Kahan compensation: optimizer state in the parameter's 16-bit type.
                          state_per_element + (opt.kahan() && is_16bit_float(p.tensor->dtype())
                                                   ? dtype_size(p.tensor->dtype())
                                                   : 0),
                          opt.has_master_weights() && p.tensor->dtype() != DType::f32});
    // The weights `ranks` ranks would factor: one rank's factors (batch x (in + out) values, in
    // the op's 16-bit type where the mode computes linear layers in 16 bits).
    const RunSettings settings = resolve(c);
    const amp::PrecisionMode& mode = settings.precision.mode;
    const size_t factor_size = mode.computes_in_16_bits() ? 2 : 4;
    for (const nn::Module::NamedTensor& w : factored_weights(trainer.model(), c, settings, ranks)) {
      for (size_t i = 0; i < opt.params().size(); ++i) {
        if (opt.params()[i].tensor != w.tensor) continue;
        m.params[i].factor_bytes =
            static_cast<size_t>(c.batch_size * (w.tensor->size(0) + w.tensor->size(1))) *
            factor_size;
        m.params[i].factor_deferred = defer_factors;
        m.params[i].rows = w.tensor->size(0);
      }
    }
  } catch (...) {
    tracker.stop_recording();
    tracker.set_phase("");
    throw;
  }
  std::vector<MemoryEvent> events = tracker.stop_recording();
  tracker.set_phase("");
  return events;
}

}  // namespace

StepMemory profile_step(TrainConfig c, int ranks) {
  // A rank updates after the backward pass; where it would update in it, it forms the gradients
  // of the weights that travel as factors in parts at the step instead (the trainer's rule).
  const bool defer_factors = ranks > 1 && updates_as_gradients_complete(c);
  if (ranks > 1) c.update_in_backward = false;
  // Two calls of the training step on synthetic data (nothing read, nothing written): the first
  // allocates the optimizer's state, the second is measured (the steady state). The settings are
  // checked first, which bounds the examples of a call (kMaxCount).
  validate(c);
  const int64_t per_call = c.batch_size * c.gradient_accumulation * c.device_iterations;
  const int64_t side = c.effective_image_size();
  MANTISSA_CHECK(2 * per_call <= kMaxCount / (3 * side * side),
                 "--batch-size " + std::to_string(c.batch_size) + " x --gradient-accumulation " +
                     std::to_string(c.gradient_accumulation) + " x --device-iterations " +
                     std::to_string(c.device_iterations) + " images of " + std::to_string(side) +
                     "x" + std::to_string(side) + " a call are more bytes than a step can hold",
                 "lower --batch-size or --image-size");
  c.dataset = "synthetic";
  c.synthetic_size = std::max<int64_t>(2 * per_call, 4);
  c.train_limit = c.test_limit = 0;
  c.data_dir.clear();
  c.eval_batch_size = TrainConfig{}.eval_batch_size;  // no evaluation
  c.max_steps = 2 * c.device_iterations;
  c.epochs = 1;
  c.evaluate = false;
  c.progress = false;
  c.save.clear();
  c.resume.clear();
  c.metrics_json.clear();
  c.init_from.clear();
  validate(c);

  StepMemory m;
  if (!c.memory_budget.empty()) m.budget = parse_bytes(c.memory_budget);
  const CategoryBytes before = default_memory_tracker().stats().current;
  std::vector<MemoryEvent> events;
  try {
    events = record_step(c, m, ranks, defer_factors);
  } catch (const OutOfMemoryError& e) {
    // Past --memory-budget: the step does not fit; what it needs is the same step measured
    // without the budget (the verdict and the report stay). A refusal by the system, or one
    // past a budget set outside this configuration, is the error itself: exit status 3.
    if (!e.over_budget() || c.memory_budget.empty()) throw;
    TrainConfig unlimited = c;
    unlimited.memory_budget.clear();
    StepMemory need = profile_step(unlimited, ranks);
    need.budget = m.budget;
    need.fits = false;
    need.oom_report = e.what();
    return need;
  }

  // The measured step: from the last optimizer step's first forward event (a forward that
  // follows the set-up or an optimizer update; accumulation's later forwards do not count).
  size_t first = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    if (events[i].phase != "forward") continue;
    size_t j = i;
    while (j > 0 && events[j - 1].phase == "") --j;  // between steps: the loader's batches
    if (j == 0 || events[j - 1].phase == "optimizer" || events[j - 1].phase == "setup") first = i;
  }
  // ... to its optimizer update's last event (then the trainer is taken down).
  size_t end = events.size();
  while (end > first && events[end - 1].phase != "optimizer") --end;
  if (end == first) end = events.size();
  // The peak of the step and what it was made of.
  size_t peak = first;
  for (size_t i = first; i < end; ++i)
    if (events[i].total > events[peak].total) peak = i;
  m.at_peak = events.empty() ? before : events[peak].current;
  m.peak_total = 0;
  for (size_t b : m.at_peak) m.peak_total += b;
  m.category_peaks = events.empty() ? before : events[first].current;
  for (size_t i = first; i < end; ++i)
    for (size_t k = 0; k < m.category_peaks.size(); ++k)
      m.category_peaks[k] = std::max(m.category_peaks[k], events[i].current[k]);

  // By layer at the peak: replay the step's allocations and frees up to it.
  // Frees of memory allocated before the recording come off what was held before.
  const std::string kBefore = "(held before the step)";
  std::map<std::string, CategoryBytes> layers;
  for (size_t k = 0; k < before.size(); ++k)
    if (before[k] > 0) layers[kBefore][k] = before[k];
  for (size_t i = 0; i < events.size() && i <= peak; ++i) {
    const MemoryEvent& e = events[i];
    const size_t k = static_cast<size_t>(e.category);
    size_t& v = layers[layer_of_owner(e.owner)][k];
    if (e.delta >= 0) {
      v += static_cast<size_t>(e.delta);
      continue;
    }
    const size_t freed = static_cast<size_t>(-e.delta), here = std::min(v, freed);
    v -= here;
    size_t& held = layers[kBefore][k];
    held -= std::min(held, freed - here);
  }
  for (auto& [name, bytes] : layers) {
    LayerMemory l{name, bytes, 0};
    for (size_t b : bytes) l.total += b;
    if (l.total > 0) m.layers.push_back(l);
  }
  std::stable_sort(m.layers.begin(), m.layers.end(),
                   [](const LayerMemory& a, const LayerMemory& b) { return a.total > b.total; });

  // The liveness of the step, thinned to at most ~kMaxPoints points, the peak kept.
  const size_t n = end - std::min(first, end);
  m.events = n;
  const size_t stride = std::max<size_t>(1, (n + kMaxPoints - 1) / kMaxPoints);
  auto point = [&](size_t i) {
    const MemoryEvent& e = events[i];
    return MemoryPoint{i - first, e.phase.empty() ? "loader" : e.phase,
                       e.current, e.total,
                       e.delta,   e.category,
                       e.owner,   e.module};
  };
  for (size_t i = first; i < end; ++i)
    if ((i - first) % stride == 0 || i == peak || i + 1 == end) m.timeline.push_back(point(i));
  if (peak < end) m.peak = point(peak);
  return m;
}

std::vector<StepMemory> profile_steps(const std::vector<TrainConfig>& configs, int ranks) {
  std::vector<StepMemory> steps;
  for (const TrainConfig& c : configs) {
    kernels::release_gemm_buffers();
    steps.push_back(profile_step(c, ranks));
  }
  return steps;
}

RankMemory rank_memory(const StepMemory& step, int ranks, double bucket_size_mib, DType wire) {
  MANTISSA_CHECK(ranks >= 1, "--ranks must be at least 1", "e.g. --ranks 4");
  RankMemory m;
  m.ranks = ranks;
  // Both bucket the trained parameters but the factored ones, which ZeRO-1 cuts into blocks of
  // whole rows (dist::Zero1).
  std::vector<int64_t> bucketed;
  std::vector<const ParamMemory*> trained, factored;
  size_t gathered = 0, formed = 0;  // factors of every rank; gradients the step forms in parts
  for (const ParamMemory& p : step.params) {
    if (!p.trained) continue;
    if (p.factor_bytes == 0) {
      bucketed.push_back(p.numel);
      trained.push_back(&p);
      continue;
    }
    factored.push_back(&p);
    gathered += static_cast<size_t>(ranks) * p.factor_bytes;
    if (p.factor_deferred)
      formed += static_cast<size_t>(p.numel) * (p.master ? 4 : dtype_size(p.dtype));
  }
  const size_t ws = dtype_size(wire);
  dist::ReducerOptions o;
  o.bucket_cap_mib = bucket_size_mib;
  o.wire = wire;
  const std::vector<dist::Reducer::Bucket> plain = dist::Reducer::plan(bucketed, o, ranks);
  o.scatter = true;
  const std::vector<dist::Reducer::Bucket> scattered = dist::Reducer::plan(bucketed, o, ranks);
  size_t buckets = 0;
  for (const dist::Reducer::Bucket& b : plain) buckets += static_cast<size_t>(b.padded) * ws;
  // ZeRO-1: the buckets padded, this rank's part of each, the gather buffers of buckets whose
  // parameters are wider than the wire type (the others gather in the bucket's buffer), and each
  // rank's share of the state and master weights (its part of every bucket), against the whole.
  size_t zero_buffers = 0, gathers = 0;
  double whole_state = 0, whole_master = 0;
  std::vector<double> state_share(static_cast<size_t>(ranks), 0),
      master_share(static_cast<size_t>(ranks), 0);
  for (const dist::Reducer::Bucket& b : scattered) {
    zero_buffers += static_cast<size_t>(b.padded + b.part) * ws;
    DType gather = trained[b.params.front()]->dtype;
    for (size_t k : b.params)
      if (trained[k]->dtype != gather) gather = DType::f32;
    if (dtype_size(gather) > ws) gathers += static_cast<size_t>(b.padded) * dtype_size(gather);
    for (size_t s = 0; s < b.params.size(); ++s) {
      const ParamMemory& p = *trained[b.params[s]];
      const double per_state = static_cast<double>(p.state_bytes_per_element);
      const double per_master = p.master ? 4.0 : 0.0;
      whole_state += static_cast<double>(p.numel) * per_state;
      whole_master += static_cast<double>(p.numel) * per_master;
      for (int r = 0; r < ranks; ++r) {
        const int64_t lo = std::max<int64_t>(b.offsets[s], r * b.part);
        const int64_t hi = std::min<int64_t>(b.offsets[s] + p.numel, (r + 1) * b.part);
        if (hi <= lo) continue;
        state_share[static_cast<size_t>(r)] += static_cast<double>(hi - lo) * per_state;
        master_share[static_cast<size_t>(r)] += static_cast<double>(hi - lo) * per_master;
      }
    }
  }
  // The factored weights: rank r's block of rows, and a padded gather buffer where the blocks
  // do not fill the rows exactly.
  for (const ParamMemory* p : factored) {
    const int64_t rows = std::max<int64_t>(p->rows, 1), row_size = p->numel / rows;
    const int64_t block = dist::Zero1::block_rows(rows, ranks);
    const double per_state = static_cast<double>(p->state_bytes_per_element);
    const double per_master = p->master ? 4.0 : 0.0;
    whole_state += static_cast<double>(p->numel) * per_state;
    whole_master += static_cast<double>(p->numel) * per_master;
    for (int r = 0; r < ranks; ++r) {
      const auto [lo, hi] = dist::Zero1::row_block(rows, ranks, r);
      state_share[static_cast<size_t>(r)] += static_cast<double>((hi - lo) * row_size) * per_state;
      master_share[static_cast<size_t>(r)] +=
          static_cast<double>((hi - lo) * row_size) * per_master;
    }
    if (block * ranks != rows)
      gathers += static_cast<size_t>(ranks * block * row_size) * dtype_size(p->dtype);
  }
  size_t largest = 0;  // the rank holding the most
  for (size_t r = 1; r < state_share.size(); ++r)
    if (state_share[r] + master_share[r] > state_share[largest] + master_share[largest])
      largest = r;
  const size_t state = static_cast<size_t>(MemoryCategory::optimizer_state);
  const size_t master = static_cast<size_t>(MemoryCategory::master_weights);
  const size_t grads = static_cast<size_t>(MemoryCategory::gradients);
  const size_t work = static_cast<size_t>(MemoryCategory::workspace);
  m.data_parallel = step.at_peak;
  m.data_parallel[grads] += buckets + gathered;
  // A gradient the step forms in parts was stored whole in the measured step, and held at its
  // peak if the peak came after it was formed (the first weights the backward pass reaches).
  m.data_parallel[grads] -= std::min(m.data_parallel[grads], formed);
  m.zero = step.at_peak;
  m.zero[grads] += zero_buffers + gathered;
  m.zero[grads] -= std::min(m.zero[grads], formed);
  m.zero[work] += gathers;
  // The state and masters held at the peak (persistent, made at the first step) scaled to the
  // largest rank's share of them.
  auto scaled = [](size_t held, double part, double whole) {
    return whole > 0 ? static_cast<size_t>(static_cast<double>(held) * part / whole) : held;
  };
  m.zero[state] = scaled(m.zero[state], state_share[largest], whole_state);
  m.zero[master] = scaled(m.zero[master], master_share[largest], whole_master);
  m.optimizer_state = step.at_peak[state] + step.at_peak[master];
  m.optimizer_state_zero = m.zero[state] + m.zero[master];
  for (size_t v : m.data_parallel) m.data_parallel_total += v;
  for (size_t v : m.zero) m.zero_total += v;
  return m;
}

namespace {

// Where a step's peak was reached: "reached in the backward of layer4.1.conv2, allocating 2.00 MiB
// of workspace (kernel workspace)" (the text report's line and the HTML chart's caption).
std::string peak_reached(const MemoryPoint& p) {
  return "reached in the " + p.phase + (p.module.empty() ? "" : " of " + p.module) +
         ", allocating " + format_bytes(static_cast<size_t>(p.delta)) + " of " +
         std::string(memory_category_name(p.category)) + " (" + p.owner + ")";
}

}  // namespace

std::string memory_text(const std::vector<StepMemory>& runs, size_t top_layers,
                        const std::vector<RankMemory>& ranks) {
  std::ostringstream out;
  char line[256];
  std::snprintf(line, sizeof line, "%-22s", "category (at the peak)");
  out << line;
  for (const StepMemory& r : runs) {
    std::snprintf(line, sizeof line, " %14s", r.precision.c_str());
    out << line;
  }
  out << "\n";
  for (MemoryCategory c : kAllMemoryCategories) {
    std::snprintf(line, sizeof line, "%-22s", std::string(memory_category_name(c)).c_str());
    out << line;
    for (const StepMemory& r : runs) {
      std::snprintf(line, sizeof line, " %14s",
                    format_bytes(r.at_peak[static_cast<size_t>(c)]).c_str());
      out << line;
    }
    out << "\n";
  }
  std::snprintf(line, sizeof line, "%-22s", "total at the peak");
  out << line;
  for (const StepMemory& r : runs) {
    std::snprintf(line, sizeof line, " %14s", format_bytes(r.peak_total).c_str());
    out << line;
  }
  out << "\n";
  if (runs.size() > 1 && runs[0].peak_total > 0) {
    out << "ratio to " << runs[0].precision << ":";
    for (size_t i = 1; i < runs.size(); ++i) {
      std::snprintf(line, sizeof line, " %s %.1f%%", runs[i].precision.c_str(),
                    100.0 * static_cast<double>(runs[i].peak_total) /
                        static_cast<double>(runs[0].peak_total));
      out << line;
    }
    out << "\n";
  }
  for (const StepMemory& r : runs)
    if (r.budget)
      out << r.precision << ": " << (r.fits ? "fits in" : "does NOT fit in") << " the budget of "
          << format_bytes(*r.budget) << " (needs " << format_bytes(r.peak_total) << ")\n";
  for (size_t i = 0; i < ranks.size() && i < runs.size(); ++i) {
    const RankMemory& rm = ranks[i];
    out << "per rank of " << rm.ranks << " ranks, " << runs[i].precision
        << " (computed: this step at the per-rank batch, plus the gradient buckets; ZeRO-1: the "
           "largest rank's share of the optimizer state and master weights, plus its "
           "reduce-scatter and gather buffers):\n";
    std::snprintf(line, sizeof line, "  %-20s %16s %16s\n", "category (at the peak)",
                  "data parallel", "--zero 1");
    out << line;
    for (MemoryCategory c : kAllMemoryCategories) {
      const size_t k = static_cast<size_t>(c);
      std::snprintf(line, sizeof line, "  %-20s %16s %16s\n",
                    std::string(memory_category_name(c)).c_str(),
                    format_bytes(rm.data_parallel[k]).c_str(), format_bytes(rm.zero[k]).c_str());
      out << line;
    }
    std::snprintf(line, sizeof line, "  %-20s %16s %16s\n", "total at the peak",
                  format_bytes(rm.data_parallel_total).c_str(),
                  format_bytes(rm.zero_total).c_str());
    out << line;
  }
  for (const StepMemory& r : runs) {
    if (r.peak.delta > 0) out << "peak of " << r.precision << " " << peak_reached(r.peak) << "\n";
    out << "largest holders at the peak, " << r.precision << ":\n";
    for (size_t i = 0; i < r.layers.size() && i < top_layers; ++i) {
      const LayerMemory& l = r.layers[i];
      std::string parts;
      for (MemoryCategory c : kAllMemoryCategories) {
        const size_t b = l.bytes[static_cast<size_t>(c)];
        if (b == 0) continue;
        parts += (parts.empty() ? "" : ", ") + std::string(memory_category_name(c)) + " " +
                 format_bytes(b);
      }
      std::snprintf(line, sizeof line, "  %-28s %12s  (%s)\n", l.layer.c_str(),
                    format_bytes(l.total).c_str(), parts.c_str());
      out << line;
    }
  }
  return out.str();
}

std::string memory_json(const TrainConfig& c, const std::vector<StepMemory>& runs,
                        const std::vector<RankMemory>& ranks) {
  json j;
  j["model"] = c.model;
  j["batch_size"] = c.batch_size;
  j["image_size"] = c.effective_image_size();
  j["gradient_accumulation"] = c.gradient_accumulation;
  j["device_iterations"] = c.device_iterations;
  j["optimizer"] = c.optimizer;
  j["runs"] = json::array();
  for (const StepMemory& r : runs) {
    json run;
    run["precision"] = r.precision;
    run["settings"] = r.description;
    run["peak_total_bytes"] = r.peak_total;
    run["at_peak_bytes"] = category_json(r.at_peak);
    run["category_peak_bytes"] = category_json(r.category_peaks);
    run["budget_bytes"] = r.budget ? json(*r.budget) : json(nullptr);
    run["fits"] = r.fits;
    run["oom_report"] = r.fits ? json(nullptr) : json(r.oom_report);
    json layers = json::array();
    for (const LayerMemory& l : r.layers)
      layers.push_back({{"layer", l.layer}, {"total", l.total}, {"bytes", category_json(l.bytes)}});
    run["layers_at_peak"] = layers;
    run["events"] = r.events;
    json timeline = json::array();
    for (const MemoryPoint& p : r.timeline)
      timeline.push_back({{"event", p.event},
                          {"phase", p.phase},
                          {"total", p.total},
                          {"bytes", category_json(p.bytes)},
                          {"delta", p.delta},
                          {"category", memory_category_name(p.category)},
                          {"owner", p.owner},
                          {"module", p.module}});
    run["timeline"] = timeline;
    const size_t i = j["runs"].size();
    if (i < ranks.size())
      run["per_rank"] = {
          {"ranks", ranks[i].ranks},
          {"data_parallel",
           {{"total", ranks[i].data_parallel_total},
            {"at_peak_bytes", category_json(ranks[i].data_parallel)}}},
          {"zero1",
           {{"total", ranks[i].zero_total}, {"at_peak_bytes", category_json(ranks[i].zero)}}}};
    j["runs"].push_back(run);
  }
  return j.dump(2) + "\n";
}

std::string memory_html(const TrainConfig& c, const std::vector<StepMemory>& runs) {
  using html::escape;
  std::ostringstream h;
  h << html::page_start("Mantissa memory: " + c.model);
  h << "<h1>Memory of one training step: " << escape(c.model) << ", batch " << c.batch_size << ", "
    << c.effective_image_size() << "x" << c.effective_image_size() << "</h1>\n";
  h << html::category_key();

  // Peak by category: one stacked bar per precision, on the scale of the largest (or the budget).
  std::vector<html::CategoryBar> bars;
  size_t top = 1;
  for (const StepMemory& r : runs) {
    bars.push_back(
        {r.precision, r.at_peak, format_bytes(r.peak_total) + (r.fits ? "" : " (does not fit)")});
    top = std::max(top, r.peak_total);
  }
  if (runs[0].budget) top = std::max(top, *runs[0].budget);
  h << "<h2>At the peak, by category</h2>\n"
    << html::category_bars(bars, runs[0].budget,
                           runs[0].budget ? "budget " + format_bytes(*runs[0].budget) : "");

  // Liveness: stacked areas by category over the step's allocations and frees.
  h << "<h2>Over the step (liveness)</h2>\n";
  for (const StepMemory& r : runs) {
    if (r.timeline.size() < 2) continue;
    const double CW = 760, CH = 220, L = 70, T = 20;
    const double n = static_cast<double>(r.timeline.back().event);
    auto X = [&](size_t e) { return L + CW * static_cast<double>(e) / std::max(1.0, n); };
    auto Y = [&](size_t b) {
      return T + CH - CH * static_cast<double>(b) / static_cast<double>(top);
    };
    // What reached the peak, said under the title and marked on the chart.
    const std::string reached = r.peak.delta > 0 ? "peak " + peak_reached(r.peak) : "";
    h << "<h3>" << escape(r.precision) << " (" << r.events << " allocations and frees)</h3>\n";
    if (!reached.empty()) h << "<p>" << escape(reached) << "</p>\n";
    h << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << L + CW + 20 << "\" height=\""
      << T + CH + 40 << "\">\n";
    // Phase bands, each named on hover; a label that would overlap the previous one or run past
    // the chart (a short phase) is left out; 7 px a character is more than the 11 px font needs.
    size_t start = 0;
    double free_from = 0;
    for (size_t i = 1; i <= r.timeline.size(); ++i) {
      if (i < r.timeline.size() && r.timeline[i].phase == r.timeline[start].phase) continue;
      const double x0 = X(r.timeline[start].event), x1 = X(r.timeline[i - 1].event);
      const std::string phase = escape(r.timeline[start].phase);
      h << "<rect x=\"" << x0 << "\" y=\"" << T << "\" width=\"" << std::max(0.5, x1 - x0)
        << "\" height=\"" << CH << "\" fill=\"" << ((start / 1) % 2 ? "#f4f4f4" : "#fafafa")
        << "\"><title>" << phase << "</title></rect>";
      const double label_end = x0 + 2 + 7.0 * static_cast<double>(r.timeline[start].phase.size());
      if (x0 + 2 >= free_from && label_end <= L + CW + 20) {
        h << "<text x=\"" << x0 + 2 << "\" y=\"" << T + CH + 30 << "\" font-size=\"11\">" << phase
          << "</text>";
        free_from = label_end + 4;
      }
      h << "\n";
      start = i;
    }
    // Areas, bottom category first.
    std::vector<size_t> base(r.timeline.size(), 0);
    for (MemoryCategory cat : kAllMemoryCategories) {
      const size_t k = static_cast<size_t>(cat);
      std::string up, down;
      bool any = false;
      for (size_t i = 0; i < r.timeline.size(); ++i) {
        const size_t lo = base[i], hi = lo + r.timeline[i].bytes[k];
        any = any || r.timeline[i].bytes[k] > 0;
        up += std::to_string(X(r.timeline[i].event)) + "," + std::to_string(Y(hi)) + " ";
        base[i] = hi;
        (void)lo;
      }
      for (size_t i = r.timeline.size(); i-- > 0;)
        down += std::to_string(X(r.timeline[i].event)) + "," +
                std::to_string(Y(base[i] - r.timeline[i].bytes[k])) + " ";
      if (any)
        h << "<polygon points=\"" << up << down << "\" fill=\"" << html::category_colour(cat)
          << "\" fill-opacity=\"0.85\"><title>" << memory_category_name(cat)
          << "</title></polygon>\n";
    }
    h << "<line x1=\"" << L << "\" x2=\"" << L << "\" y1=\"" << T << "\" y2=\"" << T + CH
      << "\" stroke=\"#444\"/><line x1=\"" << L << "\" x2=\"" << L + CW << "\" y1=\"" << T + CH
      << "\" y2=\"" << T + CH << "\" stroke=\"#444\"/>\n";
    h << "<text x=\"0\" y=\"" << T + 4 << "\" font-size=\"11\">" << format_bytes(top)
      << "</text><text x=\"0\" y=\"" << T + CH << "\" font-size=\"11\">0</text>\n";
    h << "<line x1=\"" << L << "\" x2=\"" << L + CW << "\" y1=\"" << Y(r.peak_total) << "\" y2=\""
      << Y(r.peak_total) << "\" stroke=\"#000\" stroke-dasharray=\"2 3\"/><text x=\"" << L + 4
      << "\" y=\"" << Y(r.peak_total) - 3 << "\" font-size=\"11\">peak "
      << format_bytes(r.peak_total) << "</text>\n";
    if (!reached.empty())
      h << "<circle cx=\"" << X(r.peak.event) << "\" cy=\"" << Y(r.peak_total)
        << "\" r=\"4\" fill=\"none\" stroke=\"#c00\" stroke-width=\"2\"><title>" << escape(reached)
        << "</title></circle>\n";
    h << "</svg>\n";
  }

  // By layer.
  h << "<h2>Largest holders at the peak</h2>\n<table><tr><th>layer</th>";
  for (const StepMemory& r : runs) h << "<th>" << escape(r.precision) << "</th>";
  h << "<th>made of (" << escape(runs[0].precision) << ")</th></tr>\n";
  for (size_t i = 0; i < runs[0].layers.size() && i < 40; ++i) {
    const LayerMemory& l = runs[0].layers[i];
    h << "<tr><td>" << escape(l.layer) << "</td>";
    for (const StepMemory& r : runs) {
      size_t b = 0;
      for (const LayerMemory& o : r.layers)
        if (o.layer == l.layer) b = o.total;
      h << "<td>" << format_bytes(b) << "</td>";
    }
    std::string parts;
    for (MemoryCategory cat : kAllMemoryCategories)
      if (l.bytes[static_cast<size_t>(cat)] > 0)
        parts += (parts.empty() ? "" : ", ") + std::string(memory_category_name(cat)) + " " +
                 format_bytes(l.bytes[static_cast<size_t>(cat)]);
    h << "<td>" << parts << "</td></tr>\n";
  }
  h << "</table>\n";
  for (const StepMemory& r : runs)
    h << "<h3>" << escape(r.precision) << "</h3><p>" << escape(r.description) << "</p>"
      << (r.fits ? "" : "<pre>" + escape(r.oom_report) + "</pre>") << "\n";
  h << html::kPageEnd;
  return h.str();
}

}  // namespace mantissa::train
