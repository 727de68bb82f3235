#!/usr/bin/env bash
# Training speed, Mantissa against Debian's PyTorch 1.13 on this machine, FP32, same model and batch.
#   bash bench/train_vs_pytorch.sh [build-dir]       (needs: bash scripts/setup.sh --bench)
# PyTorch runs twice: as Debian ships it (linked to the reference BLAS through libblas.so.3) and
# with OpenBLAS in its place (LD_LIBRARY_PATH to OpenBLAS's libblas.so.3, OPENBLAS_NUM_THREADS=1,
# as the issue measured). Mantissa trains on the synthetic dataset (data preparation is measured
# and reported separately by mantissa train: "waited ... s for data").
set -euo pipefail
BUILD=${1:-build}
THREADS=${THREADS:-2}
PY=/usr/bin/python3
OPENBLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-pthread

mantissa_ips() {  # model batch steps extra-flags...
  local model=$1 batch=$2 steps=$3; shift 3
  local json; json=$(mktemp)
  "$BUILD/mantissa" train --model "$model" --dataset synthetic --synthetic-size $((batch * (steps + 5))) \
    --batch-size "$batch" --max-steps $((steps + 5)) --no-eval --no-progress --threads "$THREADS" \
    --metrics-json "$json" "$@" >/dev/null
  # images/s over the steps after the first 5, as train_pytorch.py times PyTorch (its 5 warm-up
  # steps allocate the optimizer state and warm the caches); each step's time includes its data
  $PY - "$json" "$batch" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))
timed = m['step_seconds'][5:]
ips = int(sys.argv[2]) * len(timed) / sum(timed)
print(f"{ips:.1f} {m['data_wait_seconds']:.2f} {m['flops_per_image'] * ips * 1e-9:.2f}")
PYEOF
  rm -f "$json"
}

row() {  # label model batch steps [flags]
  local label=$1 model=$2 batch=$3 steps=$4; shift 4
  # The FMA ceiling is measured next to the run it judges: this shared machine drifts.
  local peak
  peak=$("$BUILD/mantissa" peak --threads "$THREADS" | sed -E 's/^fp32 fma peak: ([0-9.]+) GFLOP.*/\1/')
  read -r m_ips m_wait m_gflops < <(mantissa_ips "$model" "$batch" "$steps" "$@")
  local pt_ref pt_ob
  pt_ref=$($PY bench/train_pytorch.py --model "$model" --batch-size "$batch" --steps "$steps" --threads "$THREADS" | sed -E 's/.*: ([0-9.]+) images.*/\1/')
  if [ -e "$OPENBLAS_DIR/libblas.so.3" ]; then
    pt_ob=$(LD_LIBRARY_PATH=$OPENBLAS_DIR OPENBLAS_NUM_THREADS=1 $PY bench/train_pytorch.py --model "$model" --batch-size "$batch" --steps "$steps" --threads "$THREADS" | sed -E 's/.*: ([0-9.]+) images.*/\1/')
  else
    pt_ob=nan
  fi
  $PY -c "
m, r, o = $m_ips, $pt_ref, float('$pt_ob')
print(f'{\"$label\":<28} {m:>10.1f} {r:>12.1f} {o:>14.1f} {m / r:>8.2f}x {m / o:>8.2f}x {$m_gflops:>8.1f} {100 * $m_gflops / $peak:>5.1f}% of $peak   ({$m_wait} s waiting for data)')"
}

echo "training images/s, FP32, $THREADS threads ($(date -u +%F))"
echo "(GFLOP/s: mantissa's, at 6x a forward's multiply-adds an image; ceiling: 'mantissa peak', measured before each row)"
printf '%-28s %10s %12s %14s %9s %9s %8s %s\n' "model (batch)" mantissa "pytorch(ref)" "pytorch(oblas)" "vs ref" "vs oblas" "GFLOP/s" "of the FMA ceiling"
row "tutorial-cnn 128x128 (12)" tutorial-cnn 12 200
row "tutorial-cnn 128x128 (64)" tutorial-cnn 64 40
row "resnet18 cifar 32x32 (64)" resnet18 64 6
