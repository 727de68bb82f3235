// Checkpoint metadata: the bytes edit a valid LeNet-5 checkpoint (held in memory) before it is
// resumed into a model and optimizer and rebuilt as `mantissa eval` does. One edit a line:
// "key=value" sets a metadata field, "key" removes it, "!N" drops the N-th optimizer state tensor.
// A loss-scaler field, when present, is restored into a scaler. Every refusal must be a
// mantissa::Error; nothing may be sized from a field before it is checked.
#include <memory>
#include <string>
#include <string_view>

#include "fuzz_input.h"
#include "mantissa/core/error.h"
#include "mantissa/io/safetensors.h"
#include "mantissa/mantissa.h"
#include "mantissa/train/checkpoint.h"

namespace {

using namespace mantissa;

struct Base {
  nn::ModelConfig mc;
  std::shared_ptr<nn::Classifier> model;
  std::unique_ptr<optim::Adam> optimizer;
  train::CheckpointRun run;
  io::SafetensorsFile file;

  Base() {
    mc.image_size = 16;
    mc.in_channels = 1;
    mc.num_classes = 10;
    model = nn::make_model("lenet5", mc);
    optimizer = std::make_unique<optim::Adam>(model->named_parameters(), optim::AdamOptions{},
                                              /*decoupled=*/true);
    run.model = "lenet5";
    run.dataset = "synthetic";
    run.precision = "32-true";
    run.batch_size = 16;
    run.synthetic_size = 64;
    // Adam's state after some steps: zeros are as good as any values for the checks.
    std::vector<std::pair<std::string, Tensor>> state;
    for (const auto& p : model->named_parameters())
      for (const char* buffer : {"exp_avg", "exp_avg_sq"})
        state.emplace_back(p.name + "." + buffer, Tensor::zeros(p.tensor->shape(), DType::f32));
    const std::string path = (fuzz::scratch_dir() / "base.safetensors").string();
    train::save_checkpoint(path, run, *model, *optimizer, nullptr, 3, {2.3f, 2.2f, 2.1f}, &state);
    file = io::load_safetensors(path);
    file.metadata["optimizer_steps"] = "3";
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Base base;
  io::SafetensorsFile f;
  f.metadata = base.file.metadata;
  std::vector<std::string> drop;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  for (size_t start = 0; start <= text.size();) {
    const size_t end = std::min(text.find('\n', start), text.size());
    const std::string_view line = text.substr(start, end - start);
    start = end + 1;
    if (line.empty()) continue;
    if (line[0] == '!') {
      drop.emplace_back(line.substr(1));
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos)
      f.metadata.erase(std::string(line));
    else
      f.metadata[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
  }
  size_t index = 0;
  for (const auto& [name, t] : base.file.tensors) {
    const bool optimizer = name.rfind("optimizer.", 0) == 0;
    bool dropped = false;
    for (const std::string& d : drop)
      dropped = dropped || (optimizer && d == std::to_string(index));
    if (optimizer) ++index;
    if (!dropped) f.tensors.emplace(name, t);
  }
  try {
    amp::LossScaler scaler{amp::LossScalerOptions{}};
    train::load_checkpoint(f, "fuzz.safetensors", base.run, *base.model, *base.optimizer,
                           f.metadata.count("loss_scaler") ? &scaler : nullptr);
  } catch (const Error&) {
  }
  try {
    train::model_from_checkpoint(f, "fuzz.safetensors");
  } catch (const Error&) {
  }
  return 0;
}
