// The training report (`mantissa train --report FILE.html`, TrainConfig::report): a self-contained
// HTML page of a run, drawn from the text of its metrics JSON (metrics_json()), so that the page
// and the metrics file cannot disagree. It shows
//   - the run in one table (model, data, steps, accuracy, speed, peak memory, loss scale) and the
//     precision settings' printed line;
//   - charts over the run: every step's loss, the training accuracy of what the calls returned
//     (and the test accuracy), the loss scale and the skipped steps (under loss scaling), and
//     every step's wall time;
//   - memory by category, at the peak and each category's own peak;
//   - the epochs and the configuration.
// The page holds the data it is drawn from as JSON in <script type="application/json"
// id="metrics">: the metrics JSON itself, except that each array of more than kReportMaxPoints
// numbers (a long run's per-step series) is replaced by the means of consecutive groups of k
// values, with the smallest k that leaves at most kReportMaxPoints, and listed under "thinned" by
// its JSON pointer with k ("group") and its length ("count"). Everything else is kept exactly, so
// a run of 50,000 steps still gives a page of a few hundred kilobytes with an exact summary.
#pragma once

#include <cstddef>
#include <string>

namespace mantissa::train {

inline constexpr size_t kReportMaxPoints = 1000;

// The page for the metrics JSON text `metrics_json` (what metrics_json() returns).
std::string training_report_html(const std::string& metrics_json);

}  // namespace mantissa::train
