#!/usr/bin/env bash
# Training speed, Mantissa against Debian's PyTorch 1.13 on this machine, FP32, same model and batch.
#   [REPEATS=3] [THREADS=2] bash bench/train_vs_pytorch.sh [build-dir]   (needs: bash scripts/setup.sh --bench)
# PyTorch runs twice: as Debian ships it (linked to the reference BLAS through libblas.so.3) and
# with OpenBLAS in its place (LD_LIBRARY_PATH to OpenBLAS's libblas.so.3, OPENBLAS_NUM_THREADS=1).
# Mantissa trains on the synthetic dataset (data preparation is measured and reported separately
# by mantissa train: "waited ... s for data").
set -euo pipefail
BUILD=${1:-build}
THREADS=${THREADS:-2}
REPEATS=${REPEATS:-3}
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
  # REPEATS rounds, each measuring the FMA ceiling, Mantissa, PyTorch (reference BLAS) and PyTorch
  # (OpenBLAS) one after the other: this shared machine drifts by tens of percent within minutes,
  # so each side is sampled across the same stretch of time and the medians are compared. The
  # ratio range is that of the rounds (Mantissa against PyTorch-OpenBLAS run next to it).
  local label=$1 model=$2 batch=$3 steps=$4; shift 4
  local peaks="" m_list="" w_list="" g_list="" r_list="" o_list=""
  for _ in $(seq "$REPEATS"); do
    local peak m_ips m_wait m_gflops pt_ref pt_ob
    peak=$("$BUILD/mantissa" peak --threads "$THREADS" | sed -E 's/^fp32 fma peak: ([0-9.]+) GFLOP.*/\1/')
    read -r m_ips m_wait m_gflops < <(mantissa_ips "$model" "$batch" "$steps" "$@")
    pt_ref=$($PY bench/train_pytorch.py --model "$model" --batch-size "$batch" --steps "$steps" --threads "$THREADS" | sed -E 's/.*: ([0-9.]+) images.*/\1/')
    if [ -e "$OPENBLAS_DIR/libblas.so.3" ]; then
      pt_ob=$(LD_LIBRARY_PATH=$OPENBLAS_DIR OPENBLAS_NUM_THREADS=1 $PY bench/train_pytorch.py --model "$model" --batch-size "$batch" --steps "$steps" --threads "$THREADS" | sed -E 's/.*: ([0-9.]+) images.*/\1/')
    else
      pt_ob=nan
    fi
    peaks+="$peak,"; m_list+="$m_ips,"; w_list+="$m_wait,"; g_list+="$m_gflops,"
    r_list+="$pt_ref,"; o_list+="$pt_ob,"
  done
  $PY - <<PYEOF
from statistics import median
nan = float('nan')
peak, m, w, g, r, o = [$peaks], [$m_list], [$w_list], [$g_list], [$r_list], [$o_list]
ratios = [a / b for a, b in zip(m, o)]
pm, gm = median(peak), median(g)
print(f'{"$label":<28} {median(m):>10.1f} {median(r):>12.1f} {median(o):>14.1f} '
      f'{median(m) / median(r):>8.2f}x {median(m) / median(o):>8.2f}x '
      f'({min(ratios):.2f}-{max(ratios):.2f}) {gm:>8.1f} {100 * gm / pm:>5.1f}% of {pm:.1f}   '
      f'({max(w)} s waiting for data, at most)')
PYEOF
}

echo "training images/s, FP32, $THREADS threads ($(date -u +%F))"
echo "(medians of $REPEATS interleaved rounds; GFLOP/s: mantissa's, at 6x a forward's multiply-adds an image;"
echo " ceiling: 'mantissa peak', measured before each round)"
printf '%-28s %10s %12s %14s %9s %9s %11s %8s %s\n' "model (batch)" mantissa "pytorch(ref)" "pytorch(oblas)" "vs ref" "vs oblas" "(rounds)" "GFLOP/s" "of the FMA ceiling"
row "tutorial-cnn 128x128 (12)" tutorial-cnn 12 200
row "tutorial-cnn 128x128 (64)" tutorial-cnn 64 40
row "resnet18 cifar 32x32 (64)" resnet18 64 6
