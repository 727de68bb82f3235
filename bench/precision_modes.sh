#!/usr/bin/env bash
# Trains the same model in every 16-bit precision mode and in 32-true, and prints each mode's
# images/s and peak memory as a ratio to 32-true's.
#
#   bash bench/precision_modes.sh [--models "M ..."] [--batch-sizes "B ..."] [--modes "P ..."]
#                                 [--rounds R] [--steps N] [--threads T] [--dataset D]
#                                 [--image-size S] [--mantissa PATH]
#
# Configurations: by default tutorial-cnn at batch 12 and 64 and resnet18 (the CIFAR stem, 32x32)
# at batch 64; --models or --batch-sizes run every model at every batch size given (the other
# list keeps its default: tutorial-cnn resnet18, or 12 64). Modes: 16-mixed bf16-mixed O2 16-true
# bf16-true 16.32 16.16 and 16-true+dynamic (16-true with --loss-scaling dynamic); a mode is any
# --precision name, with "+dynamic" to add dynamic loss scaling.
#
# Each round runs 32-true, then every mode, then 32-true again, one process each; a mode's ratio in
# a round is its images/s over the mean of that round's two 32-true runs (peak memory: over 32-true's
# peak), so a machine whose speed drifts affects both sides of a ratio alike. The table gives the
# median of the per-round ratios and their range (min-max). images/s is the trainer's figure over
# the --steps steps (default 30; ResNet-18 6 for a quick run is --steps 6); the synthetic dataset
# holds the images the steps take. Quick run: --models tutorial-cnn --batch-sizes 12
# --modes 16-mixed --rounds 1 --steps 10.
set -euo pipefail
models="" batches="" rounds=3 steps=30 threads="" dataset=synthetic size="" bin=build/mantissa
modes="16-mixed bf16-mixed O2 16-true bf16-true 16.32 16.16 16-true+dynamic"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --models | --model) models=$2; shift 2 ;;
    --batch-sizes | --batch-size) batches=$2; shift 2 ;;
    --modes) modes=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --dataset) dataset=$2; shift 2 ;;
    --image-size) size=$2; shift 2 ;;
    --mantissa) bin=$2; shift 2 ;;
    -h | --help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "precision_modes.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -x "$bin" ]] || { echo "precision_modes.sh: $bin not found (build first)" >&2; exit 2; }
[[ "$rounds" =~ ^[1-9][0-9]*$ && "$steps" =~ ^[1-9][0-9]*$ ]] ||
  { echo "precision_modes.sh: --rounds and --steps take positive integers" >&2; exit 2; }

configs=()
if [[ -z "$models" && -z "$batches" ]]; then
  configs=(tutorial-cnn:12 tutorial-cnn:64 resnet18:64)
else
  for m in ${models:-tutorial-cnn resnet18}; do
    for b in ${batches:-12 64}; do configs+=("$m:$b"); done
  done
fi

# One run: prints "images/s peak-MiB". $1 model, $2 batch, $3 mode (P or P+dynamic).
run() {
  local model=$1 batch=$2 mode=$3 flags=()
  if [[ "$mode" == *+dynamic ]]; then
    flags+=(--precision "${mode%+dynamic}" --loss-scaling dynamic)
  else
    flags+=(--precision "$mode")
  fi
  [[ -n "$size" ]] && flags+=(--image-size "$size")
  [[ -n "$threads" ]] && flags+=(--threads "$threads")
  # The synthetic dataset's size: enough batches for the steps (other datasets have theirs).
  [[ "$dataset" == synthetic ]] && flags+=(--synthetic-size $(((steps + 2) * batch)))
  local line
  line=$("$bin" train --model "$model" --dataset "$dataset" \
    --batch-size "$batch" --max-steps "$steps" --no-progress --no-eval "${flags[@]}" |
    grep '^training:') || { echo "precision_modes.sh: $model batch $batch $mode failed" >&2; exit 1; }
  sed -E 's/^training: ([0-9.]+) images.*peak memory ([0-9.]+) MiB.*/\1 \2/' <<<"$line"
}

# Median and range of a list of numbers: "median min max".
stats() {
  tr ' ' '\n' <<<"$1" | grep . | sort -g |
    awk '{v[NR] = $1} END {m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
                           printf "%.3f %.3f %.3f\n", m, v[1], v[NR]}'
}

for cfg in "${configs[@]}"; do
  model=${cfg%%:*} batch=${cfg##*:}
  declare -A speed=() mem=() rate=()
  ref_rates=""
  for ((r = 0; r < rounds; ++r)); do
    read -r a_rate a_mem < <(run "$model" "$batch" 32-true)
    declare -A round_rate=() round_mem=()
    for m in $modes; do
      read -r "round_rate[$m]" "round_mem[$m]" < <(run "$model" "$batch" "$m")
    done
    read -r b_rate _ < <(run "$model" "$batch" 32-true)
    ref=$(awk -v a="$a_rate" -v b="$b_rate" 'BEGIN {printf "%.3f", (a + b) / 2}')
    ref_rates+=" $ref"
    for m in $modes; do
      speed[$m]+=" $(awk -v x="${round_rate[$m]}" -v y="$ref" 'BEGIN {printf "%.4f", x / y}')"
      mem[$m]+=" $(awk -v x="${round_mem[$m]}" -v y="$a_mem" 'BEGIN {printf "%.4f", x / y}')"
      rate[$m]+=" ${round_rate[$m]}"
    done
    mem[32-true]+=" $a_mem"
  done
  read -r ref_med ref_min ref_max < <(stats "$ref_rates")
  read -r refmem_med _ _ < <(stats "${mem[32-true]}")
  printf '\n%s, batch %s, %s steps, %s rounds: median of the per-round ratios to 32-true (range)\n' \
    "$model" "$batch" "$steps" "$rounds"
  printf '%-16s %10s %8s %-12s %8s %s\n' mode images/s speed "(range)" peak "(range)"
  awk -v i="$ref_med" -v i0="$ref_min" -v i1="$ref_max" -v p="$refmem_med" 'BEGIN {
    printf "%-16s %10.1f %7.2fx (%.1f-%.1f)  %7.1f MiB\n", "32-true", i, 1, i0, i1, p }'
  for m in $modes; do
    read -r s_med s_min s_max < <(stats "${speed[$m]}")
    read -r p_med p_min p_max < <(stats "${mem[$m]}")
    read -r i_med _ _ < <(stats "${rate[$m]}")
    awk -v m="$m" -v i="$i_med" -v s="$s_med" -v s0="$s_min" -v s1="$s_max" -v p="$p_med" \
      -v p0="$p_min" -v p1="$p_max" 'BEGIN {
        printf "%-16s %10.1f %7.2fx (%.2f-%.2f)   %7.1f%% (%.1f-%.1f%%)\n", m, i, s, s0, s1,
          100 * p, 100 * p0, 100 * p1 }'
  done
  unset speed mem rate round_rate round_mem
done
