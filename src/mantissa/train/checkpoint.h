// Checkpoints: safetensors files holding the model's state dict under PyTorch's names
// ("conv1.weight", "layer1.0.bn1.running_mean"), the optimizer's state as
// "optimizer.<parameter>.<buffer>", and in the metadata the run they belong to (model, precision,
// optimizer, gradient accumulation, seed), its position (step, every step's loss) and the loss
// scaler's state. Written atomically (io/safetensors.h). A resume checks the metadata against the
// run first, then restores everything a bit-exact continuation needs: every random choice is a
// function of the seed and the step, so nothing else is saved.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mantissa/amp/fp8.h"
#include "mantissa/amp/loss_scaler.h"
#include "mantissa/io/safetensors.h"
#include "mantissa/nn/models.h"
#include "mantissa/optim/optim.h"
#include "mantissa/train/config.h"
#include "mantissa/train/evaluation.h"

namespace mantissa::train {

// The run a checkpoint belongs to: what its metadata records and what a resume must match.
struct CheckpointRun {
  // A built-in model's name (its ModelConfig is recorded too, to rebuild it), or the
  // Module::type() of a user's model (user_model).
  std::string model;
  bool user_model = false;
  std::string dataset;
  std::string precision;  // the mode's name
  uint64_t seed = 0;
  int64_t batch_size = 0;  // per rank
  int64_t gradient_accumulation = 1;
  // Ranks of the data-parallel job (1: one process). A resume keeps the global batch,
  // world_size x batch_size x gradient_accumulation, whatever the number of ranks.
  int64_t world_size = 1;
  int64_t synthetic_size = 0;  // the synthetic dataset is made from the seed and its size
  // The rest of the data order: a resume that differs here would repeat some examples and skip
  // others.
  int64_t train_limit = 0;
  bool shuffle = true, augment = false;
  // 8-bit input: the images are rounded to u8 after their resize, which changes the pixels.
  bool eight_bit_io = false;
  // The precision settings as printed (amp::PrecisionSettings::describe()): the dtypes of what is
  // saved, the loss scaler's options, stochastic rounding, module overrides, op lists.
  std::string precision_settings;
  // The same line without the op-list files' paths, and the op lists of automatic casting as they
  // were read (JSON: {"lower-precision": [...], "fp32": [...]}; "" when the mode does not cast
  // automatically): a resume compares the lists, not the names of the files they came from.
  std::string precision_settings_without_files;
  std::string autocast_op_lists;
  // Settings a resume may change on purpose (a lower learning rate to fine-tune, ...), each a flag
  // and its value as text: a resume reports those that differ, in one line.
  std::vector<std::pair<std::string, std::string>> changeable;
};

// What a run's checkpoints record, from its configuration (`r` resolved from `c`).
CheckpointRun checkpoint_run(const TrainConfig& c, const RunSettings& r, bool user_model);

// The training state a checkpoint holds. `scaler` is null when the run has no loss scaling, `fp8`
// when it has no FP8 state (the FP8 modes' scales and amax histories, in the metadata);
// `skipped_steps`, under loss scaling, lists the steps (1-based) the scaler skipped so far.
// `optimizer_state`: the optimizer's state tensors as an unsharded optimizer names them, when the
// optimizer holds only a shard (ZeRO: gathered from every rank first); null: its own.
void save_checkpoint(const std::string& path, const CheckpointRun& run, nn::Classifier& model,
                     const optim::Optimizer& optimizer, const amp::LossScaler* scaler, int64_t step,
                     const std::vector<float>& step_losses,
                     const std::vector<std::pair<std::string, Tensor>>* optimizer_state = nullptr,
                     const amp::Fp8State* fp8 = nullptr,
                     const std::vector<int64_t>* skipped_steps = nullptr);

// Restores a checkpoint into the run's model, optimizer, scaler and FP8 state after checking that
// it is one of this run, and returns its step count and losses. A bit-exact continuation needs the
// same model and image size, optimizer, precision settings (with the stochastic-rounding seed the
// optimizer has, and the FP8 recipe), seed, global batch (ranks x batch size x gradient
// accumulation; any number of ranks) and data (dataset, its size and limit, shuffling,
// augmentation, 8-bit input): a difference there throws naming the recorded and the given value and
// the flag that resumes it (for a different model, the first tensor that does not match). The
// changeable settings, and another split of the same global batch, may differ: `note` then says
// which, and that they change the run. Keys that an older checkpoint does not record are not
// compared. The whole metadata is checked before any of it is compared with the run (a value its
// flag would refuse, or counts that contradict each other: step losses, optimizer steps and skipped
// steps against the step, are a damaged file); every number is range-checked before use (a step
// from 0 to kMaxCount, the geometry within the built-in models' bounds), and a file holding fewer
// optimizer state tensors than it was written with is refused rather than resumed with fresh
// state. The op lists of automatic casting are compared as read, not by their files' names.
struct Resumed {
  int64_t step = 0;
  std::vector<float> step_losses;
  std::vector<int64_t> skipped_steps;  // the steps the loss scaler skipped, as recorded
  std::string note;                    // one line naming the settings that change the run, or empty
};
Resumed load_checkpoint(const std::string& path, const CheckpointRun& run, nn::Classifier& model,
                        optim::Optimizer& optimizer, amp::LossScaler* scaler,
                        amp::Fp8State* fp8 = nullptr);

// The same for a checkpoint already read (`path` names it in errors).
Resumed load_checkpoint(const io::SafetensorsFile& f, const std::string& path,
                        const CheckpointRun& run, nn::Classifier& model,
                        optim::Optimizer& optimizer, amp::LossScaler* scaler,
                        amp::Fp8State* fp8 = nullptr);

// The built-in model a checkpoint holds, rebuilt from its metadata (in FP32) with its tensors
// loaded. The geometry is range-checked, and a model larger than the file's tensors could fill is
// refused before it is allocated.
std::shared_ptr<nn::Classifier> model_from_checkpoint(const io::SafetensorsFile& f,
                                                      const std::string& path);

// Copies the model's tensors from a safetensors file with PyTorch names (a checkpoint's optimizer
// entries are ignored); names the file and the first tensor that does not fit.
void load_weights(const std::string& path, nn::Module& model);

// Evaluates a checkpoint of a built-in model (rebuilt from its metadata, in FP32) on a dataset's
// test split: `dataset` empty is the one it was trained on. A run trained with 8-bit input is
// evaluated on 8-bit images, as its trainer evaluated it.
EvalResult evaluate_checkpoint(const std::string& path, const std::string& dataset,
                               const std::string& data_dir, int64_t test_limit, int64_t batch_size);

}  // namespace mantissa::train
