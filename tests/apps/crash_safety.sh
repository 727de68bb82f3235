#!/usr/bin/env bash
# Crash safety of checkpoints: `mantissa train --save` is killed with SIGKILL at random moments,
# many times, while it saves a small checkpoint every epoch (each run resumes from the last one).
# After every kill the checkpoint must be absent (none written yet), the one from before the run,
# or a newer complete one: `mantissa eval` reads it, and its step is later. Once a run has written,
# no temporary file of an earlier run may be left. A last run that ends normally leaves only the
# checkpoint (no temporary, no lock file).
#
#   crash_safety.sh MANTISSA WORK_DIR [KILLS]     (CTest runs it with 40 kills)
set -euo pipefail
mantissa=$1
work=$2
kills=${3:-40}

rm -rf "$work"
mkdir -p "$work"
cd "$work"
ck=ck.safetensors
train=(train --model lenet5 --dataset synthetic --synthetic-size 24 --batch-size 12
       --image-size 32 --threads 1 --no-progress --no-eval --save "$ck")

fail() {
  echo "crash_safety: FAILED: $*" >&2
  ls -la >&2
  exit 1
}
step_of() { LC_ALL=C grep -ao '"step":"[0-9]*"' "$1" | head -1 | tr -dc '0-9'; }
temporaries() { find . -maxdepth 1 -name "$ck.tmp.*" -printf '%f\n' | sort; }

mid_write=0
written_runs=0
for ((k = 1; k <= kills; k++)); do
  old_sum=""
  old_step=0
  if [ -f "$ck" ]; then
    old_sum=$(cksum <"$ck")
    old_step=$(step_of "$ck")
  fi
  resume=()
  [ -f "$ck" ] && resume=(--resume "$ck")
  "$mantissa" "${train[@]}" "${resume[@]}" --epochs 1000000 >run.out 2>&1 &
  pid=$!
  sleep "$(printf '0.%03d' $((RANDOM % 500 + 100)))"
  kill -0 "$pid" 2>/dev/null || { cat run.out >&2; fail "run $k ended before it was killed"; }
  kill -9 "$pid"
  status=0
  { wait "$pid"; } 2>/dev/null || status=$?  # without the shell's "Killed" line
  [ "$status" -eq 137 ] || fail "run $k: exit status $status, not 137 (SIGKILL)"
  # The kill landed during a write if this run's temporary file is there.
  [ -e "$ck.tmp.$pid" ] && mid_write=$((mid_write + 1))

  if [ ! -f "$ck" ]; then
    [ -z "$old_sum" ] || fail "run $k: the checkpoint disappeared"
    continue
  fi
  new_sum=$(cksum <"$ck")
  "$mantissa" eval --checkpoint "$ck" --test-limit 4 >eval.out 2>&1 ||
    { cat eval.out >&2; fail "run $k: the checkpoint does not load"; }
  if [ "$new_sum" != "$old_sum" ]; then
    written_runs=$((written_runs + 1))
    new_step=$(step_of "$ck")
    [ "$new_step" -gt "$old_step" ] ||
      fail "run $k: the checkpoint changed but its step went from $old_step to $new_step"
    # This run has written: only its own temporary (if it was killed mid-write) may remain.
    left=$(temporaries | grep -v "^$ck.tmp.$pid\$" || true)
    [ -z "$left" ] || fail "run $k wrote the checkpoint but left earlier temporaries: $left"
  fi
done

# A run that ends normally removes what killed runs left and leaves only its outputs.
"$mantissa" "${train[@]}" --resume "$ck" --epochs "$(($(step_of "$ck") / 2 + 2))" >run.out 2>&1 ||
  { cat run.out >&2; fail "the final run failed"; }
[ -z "$(temporaries)" ] || fail "temporaries left after a normal run: $(temporaries)"
[ ! -e "$ck.lock" ] || fail "lock file left after a normal run"
"$mantissa" eval --checkpoint "$ck" --test-limit 4 >eval.out 2>&1 || fail "final checkpoint"
echo "crash_safety: $kills kills, $mid_write during a checkpoint write, $written_runs runs wrote" \
  "a new checkpoint, every checkpoint valid (last at step $(step_of "$ck")), no temporary left"
