#!/usr/bin/env bash
# Trains the same model in every precision mode and prints images/s and peak memory, each as a
# ratio to 32-true (the mixed-precision issue's bars: speed >= 0.9x, 16-true's peak <= 55%).
#
#   bash bench/precision_modes.sh [--model M] [--steps N] [--batch-size B] [--rounds R]
#                                 [--dataset D] [--image-size S] [--mantissa PATH]
#
# Rounds alternate the modes (mode A, mode B, ..., then again) so that a machine whose speed drifts
# affects them alike; the best and the median round of each mode are reported. Defaults: tutorial-cnn, 60 steps,
# batch 12, 2 rounds, synthetic data at the model's default size (the same images/s as real data:
# the loader prefetches on another thread).
set -euo pipefail
model=tutorial-cnn steps=60 batch=12 rounds=2 dataset=synthetic size="" bin=build/mantissa
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --batch-size) batch=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --dataset) dataset=$2; shift 2 ;;
    --image-size) size=$2; shift 2 ;;
    --mantissa) bin=$2; shift 2 ;;
    *) echo "precision_modes.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[[ -x "$bin" ]] || { echo "precision_modes.sh: $bin not found (build first)" >&2; exit 2; }
modes=(32-true 16-mixed bf16-mixed O2 16-true bf16-true 16.32)
declare -A best_rate best_mem all_rates
extra=()
[[ -n "$size" ]] && extra+=(--image-size "$size")
synthetic_size=$(( (steps + 2) * batch ))
for ((r = 0; r < rounds; ++r)); do
  for m in "${modes[@]}"; do
    line=$("$bin" train --model "$model" --dataset "$dataset" --synthetic-size "$synthetic_size" \
      --batch-size "$batch" --max-steps "$steps" --precision "$m" --no-progress --no-eval \
      "${extra[@]}" | grep '^training:')
    rate=$(sed -E 's/^training: ([0-9.]+) images.*/\1/' <<<"$line")
    mem=$(sed -E 's/.*peak memory ([0-9.]+) MiB.*/\1/' <<<"$line")
    if [[ -z "${best_rate[$m]:-}" ]] || awk "BEGIN{exit !($rate > ${best_rate[$m]})}"; then
      best_rate[$m]=$rate
    fi
    all_rates[$m]="${all_rates[$m]:-} $rate"
    best_mem[$m]=$mem
  done
done
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }
printf '%s, batch %s, %s steps, %s rounds (best and median of the rounds)\n' "$model" "$batch" \
  "$steps" "$rounds"
printf '%-11s %10s %7s %10s %7s %12s %8s\n' mode best ratio median ratio "peak MiB" ratio
med0=$(median "${all_rates[32-true]}")
for m in "${modes[@]}"; do
  awk -v m="$m" -v r="${best_rate[$m]}" -v r0="${best_rate[32-true]}" -v md="$(median "${all_rates[$m]}")" \
    -v md0="$med0" -v mem="${best_mem[$m]}" -v mem0="${best_mem[32-true]}" \
    'BEGIN { printf "%-11s %10.1f %6.2fx %10.1f %6.2fx %12.2f %7.1f%%\n", m, r, r / r0, md, md / md0, mem, 100 * mem / mem0 }'
done
