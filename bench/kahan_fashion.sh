#!/usr/bin/env bash
# Kahan-compensated BF16 weights against plain BF16 and FP32 on the real Fashion-MNIST: one epoch
# of the tutorial CNN in 32-true, bf16-true and bf16-true --kahan from the same seed, each run's
# test accuracy, then each 16-bit run's distance from the FP32 run's weights per layer
# (bench/weight_distance.py: relative L2).
#   bash bench/kahan_fashion.sh [--out DIR] [extra mantissa train flags, e.g. --image-size 28]
set -euo pipefail
out=/tmp/kahan_fashion
if [[ "${1:-}" == "--out" ]]; then
  out=$2
  shift 2
fi
bin=${MANTISSA:-./build/mantissa}
mkdir -p "$out"
for run in 32-true bf16-true bf16-true-kahan; do
  case $run in
    32-true) flags=(--precision 32-true) ;;
    bf16-true) flags=(--precision bf16-true) ;;
    bf16-true-kahan) flags=(--precision bf16-true --kahan) ;;
  esac
  echo "== $run"
  "$bin" train "${flags[@]}" "$@" --save "$out/$run.safetensors" \
    --metrics-json "$out/$run.json" 2>&1 | grep -v '^step' | tail -n 6
done
python3 "$(dirname "$0")/weight_distance.py" "$out/32-true.safetensors" \
  "$out/bf16-true.safetensors" "$out/bf16-true-kahan.safetensors"
