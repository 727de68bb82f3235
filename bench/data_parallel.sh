#!/usr/bin/env bash
# Data-parallel training speed (docs/distributed.md), in two parts:
#   1. one host: 2 ranks x 1 thread (mpirun) against 1 process x 2 threads, the same global batch,
#      for each wire type (--allreduce-dtype fp32, fp16, bf16), with every gradient all-reduced
#      (--no-sufficient-factors: by default the FP32 wire sends the tutorial CNN's fc1 as its
#      factors), with --zero 1, and with Open MPI's default all-reduce algorithm: images/s, the
#      ratio to the one process (the target is at least 0.9), the time a step waited for
#      communication, the time collectives ran, and the payload per step;
#   2. two simulated hosts: two network namespaces joined by a veth pair whose egress is limited
#      by tc (token bucket, --rate), one rank in each, mpirun across them over TCP: the FP16 wire
#      and fc1's factors (the default) against its gradient (--no-sufficient-factors), and the
#      overlap of communication with the backward pass (4 MiB buckets, which start while
#      the backward pass runs, against one bucket holding every gradient but the first MiB, which
#      starts when it ends; and PyTorch's default of 25 MiB, which for the tutorial CNN holds its
#      16 MiB fc1 with the convolutions, so it too waits for the end) when the network is the
#      bottleneck; tc's byte counters give the bytes each rank sent.
# The ranks run with Open MPI's ring algorithm for the non-blocking all-reduce
# (--mca coll_libnbc_iallreduce_algorithm 1, docs/distributed.md): its default for fewer than 4
# ranks, or in place, is a binomial tree, in which one rank receives and adds the whole buffer and
# sends the sum back, while the ring's reduce-scatter and all-gather share the work between the
# ranks and use both directions of each link at once. "$MCA_DEFAULT" rows run without it.
# Each configuration runs --rounds times, interleaved (round 1 of every configuration, then round
# 2, ...), and the table shows the median with the range of the rounds. Rates are global images
# per second over the steps after the first --warmup, from rank 0's step times.
#
#   bash bench/data_parallel.sh [--rounds 3] [--steps 20] [--warmup 5] [--models "tutorial-cnn resnet18"]
#                               [--batch B] [--rate 1gbit] [--no-hosts] [--build build]
# --batch: the per-rank batch of every model (default: 12 for the tutorial CNN, its tutorial's
# batch; 32 for ResNet-18, a global batch of 64 as in the other ResNet-18 benchmarks; the one
# process takes twice it).
# Part 2 needs root, ip and tc (iproute2); it makes namespaces mtsa-h1/mtsa-h2 and veth mtsa-v1/2
# on 10.9.0.0/24 and removes them at exit. Open MPI refuses root unless
# OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (set here).
set -euo pipefail

ROUNDS=3 STEPS=20 WARMUP=5 MODELS="tutorial-cnn resnet18" RATE=1gbit HOSTS=1 BUILD=build BATCH=""
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) ROUNDS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --no-hosts) HOSTS=0; shift ;;
    --build) BUILD=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -z "$BATCH" || "$BATCH" =~ ^[1-9][0-9]*$ ]] ||
  { echo "--batch takes a positive integer (got $BATCH)" >&2; exit 2; }
MANTISSA=$(realpath "$BUILD/mantissa")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=python3
TMP=$(mktemp -d)
NS1=mtsa-h1 NS2=mtsa-h2 V1=mtsa-v1 V2=mtsa-v2 IP1=10.9.0.1 IP2=10.9.0.2

cleanup() {
  if [ -n "${HOSTS_UP:-}" ]; then
    ip netns del "$NS1" 2>/dev/null || true
    ip netns del "$NS2" 2>/dev/null || true
  fi
  rm -rf "$TMP"
}
trap cleanup EXIT

# The per-rank batch of each model (the global batch is twice it).
batch_of() {
  if [ -n "$BATCH" ]; then echo "$BATCH"; return; fi
  case $1 in resnet18) echo 32 ;; *) echo 12 ;; esac
}

# One training run of --warmup + --steps steps, one epoch of synthetic data; prints "images/s
# step_ms waited_ms busy_ms payload_bytes" from its metrics.
#   run_one GLOBAL_BATCH [launcher...] -- [mantissa train flags...]
run_one() {
  local global=$1; shift
  local launcher=()
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
  shift
  local json="$TMP/m.json"
  rm -f "$json"
  "${launcher[@]}" "$MANTISSA" train --dataset synthetic --no-eval --no-progress \
    --max-steps $((STEPS + WARMUP)) --metrics-json "$json" "$@" >"$TMP/out.txt" 2>&1 ||
    { cat "$TMP/out.txt" >&2; echo "nan nan nan nan nan"; return; }
  $PY - "$json" "$global" "$WARMUP" "$((STEPS + WARMUP))" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))
if len(m['step_seconds']) != int(sys.argv[4]):  # the data must last every step
    print(f"ran {len(m['step_seconds'])} steps, not {sys.argv[4]}", file=sys.stderr)
    print("nan nan nan nan nan")
    sys.exit(0)
timed = m['step_seconds'][int(sys.argv[3]):]
c = m.get('communication') or {}
print(f"{int(sys.argv[2]) * len(timed) / sum(timed):.2f} {1e3 * sum(timed) / len(timed):.2f} "
      f"{1e3 * c.get('exposed_seconds_per_step', 0):.2f} {1e3 * c.get('seconds_per_step', 0):.2f} "
      f"{c.get('bytes_per_step', 0):.0f}")
PYEOF
}

# Median [min-max] tables from the rounds' rows: "label value..." lines in $TMP/rows.
report() {  # title baseline-label
  $PY - "$TMP/rows" "$1" "$2" <<'PYEOF'
import sys, collections
from statistics import median
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    label, *vals = line.rstrip('\n').split('\t')
    rows.setdefault(label, []).append([float(v) for v in vals[0].split()] + [float(v) for v in vals[1:]])
def cell(xs, fmt):
    xs = [x for x in xs if x == x]
    if not xs: return 'n/a'
    return f"{fmt.format(median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"
print(sys.argv[2])
base = rows.get(sys.argv[3])
print(f"{'configuration':<64} {'images/s':>22} {'vs base':>7} {'step ms':>18} {'waited ms':>18} "
      f"{'collectives ms':>18} {'payload/step':>13} {'sent/step':>10}")
base_ips = median(list(zip(*base))[0]) if base else float('nan')
for label, rs in rows.items():
    cols = list(zip(*rs))
    ratio = median(cols[0]) / base_ips
    payload = median(cols[4]) / 2**20
    sent_mib = f"{median(cols[5]) / 2**20:.2f} MiB" if len(cols) > 5 else '-'
    print(f"{label:<64} {cell(cols[0], '{:.1f}'):>22} {ratio:>6.2f}x {cell(cols[1], '{:.1f}'):>18} "
          f"{cell(cols[2], '{:.1f}'):>18} {cell(cols[3], '{:.1f}'):>18} {payload:>9.2f} MiB {sent_mib:>10}")
print()
PYEOF
}

echo "mantissa data-parallel benchmark: $(nproc) cores, $("$MANTISSA" peak --threads 2 | head -1)"
echo "rounds $ROUNDS, $STEPS timed steps after $WARMUP, $(date -u +%Y-%m-%d)"
echo

# ---- 1. one host -------------------------------------------------------------------------------
RING=(--mca coll_libnbc_iallreduce_algorithm 1)
MCA_DEFAULT="Open MPI's default all-reduce"
MPI1=(mpirun -np 2 --oversubscribe --bind-to none)
for model in $MODELS; do
  b=$(batch_of "$model")
  g=$((2 * b))
  : >"$TMP/rows"
  for _ in $(seq "$ROUNDS"); do
    printf '%s\t%s\n' "1 process x 2 threads, batch $g" \
      "$(run_one $g -- --model "$model" --batch-size $g --threads 2 --synthetic-size $((g * (STEPS + WARMUP))))" >>"$TMP/rows"
    for cfg in "fp32" "fp32 gradients" "fp16" "bf16" "fp32 zero" "fp32 default"; do
      read -r wire extra <<<"$cfg"
      label="2 ranks x 1 thread x batch $b, $wire wire" flags=() mca=("${RING[@]}")
      case $extra in
        gradients) label="$label, --no-sufficient-factors" flags=(--no-sufficient-factors) ;;
        zero) label="$label, --zero 1" flags=(--zero 1) ;;
        default) label="$label, $MCA_DEFAULT" mca=() ;;
      esac
      printf '%s\t%s\n' "$label" \
        "$(run_one $g "${MPI1[@]}" "${mca[@]}" -- --model "$model" --batch-size $b --threads 1 \
           --synthetic-size $((g * (STEPS + WARMUP))) --allreduce-dtype $wire "${flags[@]}")" >>"$TMP/rows"
    done
  done
  report "== $model, one host (global batch $g): median [min-max] of $ROUNDS rounds" \
    "1 process x 2 threads, batch $g"
done

# ---- 2. two simulated hosts --------------------------------------------------------------------
if [ "$HOSTS" = 0 ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "two simulated hosts: skipped (needs root, ip and tc)"
  exit 0
fi
HOSTS_UP=1
for h in "$NS1" "$NS2"; do ip netns add "$h"; ip -n "$h" link set lo up; done
ip link add "$V1" type veth peer name "$V2"
ip link set "$V1" netns "$NS1"
ip link set "$V2" netns "$NS2"
ip -n "$NS1" addr add "$IP1/24" dev "$V1"
ip -n "$NS2" addr add "$IP2/24" dev "$V2"
ip -n "$NS1" link set "$V1" up
ip -n "$NS2" link set "$V2" up
ip netns exec "$NS1" tc qdisc add dev "$V1" root tbf rate "$RATE" burst 256kb latency 50ms
ip netns exec "$NS2" tc qdisc add dev "$V2" root tbf rate "$RATE" burst 256kb latency 50ms
# Open MPI's rsh agent: the first argument is the host (a namespace's address), the rest the
# command to run there.
cat >"$TMP/agent.sh" <<EOF
#!/bin/sh
host=\$1; shift
case \$host in $IP1) ns=$NS1;; $IP2) ns=$NS2;; *) echo "unknown host \$host" >&2; exit 1;; esac
exec ip netns exec \$ns sh -c "\$*"
EOF
chmod +x "$TMP/agent.sh"
# mpirun runs in the first namespace; TCP only (the shared-memory transport would bypass the
# veth: the namespaces share the machine's memory).
MPI2=(ip netns exec "$NS1" mpirun -H "$IP1:1,$IP2:1" -np 2 --bind-to none "${RING[@]}"
      --mca plm_rsh_agent "$TMP/agent.sh" --mca btl tcp,self
      --mca btl_tcp_if_include 10.9.0.0/24 --mca oob_tcp_if_include 10.9.0.0/24
      -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM)
sent_bytes() {  # bytes the second namespace's veth has sent (rank 1's traffic)
  ip netns exec "$NS2" tc -s qdisc show dev "$V2" | sed -n 's/.*Sent \([0-9]*\) bytes.*/\1/p' | head -1
}
for model in $MODELS; do
  b=$(batch_of "$model")
  g=$((2 * b))
  : >"$TMP/rows"
  for _ in $(seq "$ROUNDS"); do
    for cfg in "fp32 25" "fp32 25 gradients" "fp32 4 gradients" "fp32 4096 gradients" "fp16 4" \
               "fp16 4096" "bf16 4"; do
      read -r wire bucket extra <<<"$cfg"
      case $bucket in
        25) label="$wire wire, 25 MiB buckets (the default)" ;;
        4096) label="$wire wire, one bucket (no overlap)" ;;
        *) label="$wire wire, $bucket MiB buckets (overlap)" ;;
      esac
      flags=()
      if [ "$extra" = gradients ]; then
        label="$label, --no-sufficient-factors" flags=(--no-sufficient-factors)
      fi
      before=$(sent_bytes)
      result=$(run_one $g "${MPI2[@]}" -- --model "$model" --batch-size $b --threads 1 \
               --synthetic-size $((g * (STEPS + WARMUP))) --allreduce-dtype $wire --bucket-size $bucket \
               "${flags[@]}")
      after=$(sent_bytes)
      # The run's bytes per step (every step, set-up's collectives included).
      sent=$($PY -c "print(($after - $before) / ($STEPS + $WARMUP))")
      printf '%s\t%s\t%s\n' "$label" "$result" "$sent" >>"$TMP/rows"
    done
  done
  report "== $model, two hosts over a $RATE link (global batch $g, one thread a rank): median [min-max] of $ROUNDS rounds; sent/step: bytes rank 1 sent, by tc" \
    "fp32 wire, 25 MiB buckets (the default), --no-sufficient-factors"
done
