#!/usr/bin/env bash
# Walks the Graphcore hands-on guide's steps (shared seed 003) with Mantissa and prints its own
# figures at each: the memory of one step against a budget, then images/s, time waiting for data,
# host time per step and bytes per batch as each lever is added. docs/ipu_guide.md reports a run.
#
#   bash bench/ipu_guide.sh [--model M] [--batch-size B] [--steps N] [--budget SIZE]
#                           [--dataset D] [--mantissa PATH] [--out DIR]
#
# Defaults: resnet18 (the guide: resnet101), batch 16 (the guide: 64, on two IPUs), real
# Fashion-MNIST resized to 32x32 with random flips and crops (the guide: CIFAR-10 resized to 64x64
# with flips), a 200MiB budget, and 4 optimizer steps per configuration (ResNet-18 trains at about
# 20 images/s on two cores: the whole walk takes about five minutes). The memory page (HTML) and JSON files go to --out.
set -euo pipefail
model=resnet18 batch=16 steps=4 budget=200MiB dataset=fashion-mnist bin=build/mantissa out=/tmp/ipu_guide
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --batch-size) batch=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --dataset) dataset=$2; shift 2 ;;
    --mantissa) bin=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "ipu_guide.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[[ -x "$bin" ]] || { echo "ipu_guide.sh: $bin not found (build first)" >&2; exit 2; }
mkdir -p "$out"

echo "== 1. The base configuration, 32.32 with gradient accumulation 3, against a $budget budget"
echo "   and 2. half precision (16.16), measured without training:"
"$bin" memory --model "$model" --batch-size "$batch" --gradient-accumulation 3 \
  --precision 32.32 --precision 16.16 --memory-budget "$budget" \
  --json "$out/memory.json" --html "$out/memory.html" | sed -n '2,13p' || true
echo "   (the page: $out/memory.html)"
echo "   training 32.32 under the budget (the second step holds the optimizer's state too):"
"$bin" train --model "$model" --dataset "$dataset" --image-size 32 --augment \
  --batch-size "$batch" --gradient-accumulation 3 --precision 32.32 --memory-budget "$budget" \
  --max-steps 2 --no-progress --no-eval 2>&1 | grep -m1 -E "out of memory|^training" || true

n=0
run() {  # name, then flags
  local name=$1
  shift
  local line
  n=$((n + 1))
  line=$("$bin" train --model "$model" --dataset "$dataset" --image-size 32 --augment \
    --batch-size "$batch" --max-steps "$steps" --memory-budget "$budget" --no-progress --no-eval \
    --metrics-json "$out/step$n.json" "$@" | grep '^training:')
  printf '%-34s %s\n' "$name" "${line#training: }"
}
echo
echo "== Each lever added in turn (the guide's order): images/s, time waiting for data, bytes of one"
echo "   batch handed over, host time per optimizer step, peak memory"
run "16.16, accumulation 3" --precision 16.16 --gradient-accumulation 3
run "16.16, accumulation 8" --precision 16.16 --gradient-accumulation 8
run "  + device iterations 4" --precision 16.16 --gradient-accumulation 8 --device-iterations 4
run "  + 8-bit I/O" --precision 16.16 --gradient-accumulation 8 --device-iterations 4 --eight-bit-io
run "  + asynchronous loader (2 workers)" --precision 16.16 --gradient-accumulation 8 \
  --device-iterations 4 --eight-bit-io --async-dataloader --workers 2
run "  + recomputation" --precision 16.16 --gradient-accumulation 8 --device-iterations 4 \
  --eight-bit-io --async-dataloader --workers 2 --recompute
