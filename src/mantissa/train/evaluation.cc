#include "mantissa/train/evaluation.h"

#include <optional>
#include <vector>

#include "mantissa/autograd/autograd.h"

namespace mantissa::train {

int64_t count_correct(const Tensor& out, const Tensor& labels) {
  const std::vector<float> v = out.to_float_vector();
  const int64_t B = out.size(0), K = out.size(1);
  const int64_t* y = labels.data<int64_t>();
  int64_t correct = 0;
  for (int64_t i = 0; i < B; ++i) {
    int64_t best = 0;
    for (int64_t k = 1; k < K; ++k)
      if (v[static_cast<size_t>(i * K + k)] > v[static_cast<size_t>(i * K + best)]) best = k;
    correct += best == y[i];
  }
  return correct;
}

EvalResult evaluate_model(nn::Classifier& m, data::Loader& loader,
                          const amp::PrecisionSettings* precision, ops::Fp8Provider* fp8) {
  autograd::NoGradScope no_grad;
  const bool was_training = m.is_training();
  m.eval();
  EvalResult r;
  double loss_sum = 0;
  int64_t correct = 0;
  loader.start(0);
  while (auto batch = loader.next()) {
    std::optional<amp::ForwardPrecision> pass;
    if (precision) pass.emplace(amp::ForwardPrecision::kEvaluation, *precision, fp8);
    Tensor out = m(batch->images);
    if (precision) out = precision->loss_input(out);
    loss_sum += m.loss(out, batch->labels).item() * static_cast<double>(batch->labels.size(0));
    correct += count_correct(out, batch->labels);
    r.examples += batch->labels.size(0);
  }
  m.train(was_training);
  r.correct = correct;
  r.accuracy = r.examples > 0 ? static_cast<double>(correct) / static_cast<double>(r.examples) : 0;
  r.loss = r.examples > 0 ? loss_sum / static_cast<double>(r.examples) : 0;
  return r;
}

}  // namespace mantissa::train
