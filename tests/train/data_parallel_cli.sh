#!/bin/bash
# `mantissa train` under mpirun as a user runs it: faults end the job in bounded time with the
# failing rank's message, Ctrl-C on mpirun stops every rank at one step and writes the checkpoint
# once, checkpoints move between job sizes, and what cannot run over several processes says so.
#   data_parallel_cli.sh MANTISSA MPIEXEC WORKDIR CASE
# CASE: mismatch | bad_data | oom | killed | interrupt | resume | refused. Each case prints what it
# checked; a failure prints the job's output and exits 1.
set -u
MANTISSA=$1 MPIEXEC=$2 WORK=$3 CASE=$4
mkdir -p "$WORK"
cd "$WORK" || exit 1
MPIRUN=("$MPIEXEC" --oversubscribe --bind-to none)
# A small run: lenet5 on synthetic images, one thread a rank.
RUN=(train --model lenet5 --dataset synthetic --synthetic-size 512 --image-size 16 --threads 1
     --no-progress --no-eval)

fail() {
  echo "FAILED ($CASE): $*"
  [ -f out.txt ] && cat out.txt
  exit 1
}

# Runs a job with a time limit; sets STATUS, SECONDS_TAKEN and leaves its output in out.txt.
# (A job whose rank was killed by SIGKILL also ends with 137, as timeout's SIGKILL does: the time
# tells them apart.)
job() {
  local limit=$1
  shift
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >out.txt 2>&1
  STATUS=$?
  SECONDS_TAKEN=$((SECONDS - start))
  [ "$SECONDS_TAKEN" -lt "$limit" ] || fail "the job did not end within $limit s"
}

expect_output() {
  grep -Eq -- "$1" out.txt || fail "no line matches '$1'"
}

case $CASE in
mismatch)
  # The ranks are started with different flags (MPMD): refused at start, naming the flag.
  job 30 "${MPIRUN[@]}" -n 1 "$MANTISSA" "${RUN[@]}" --lr 0.001 : -n 1 "$MANTISSA" "${RUN[@]}" --lr 0.01
  [ "$STATUS" -ne 0 ] || fail "exit status 0"
  expect_output "ranks disagree on the configuration: 'lr' is '0.001' on rank 0 but '0.01' on rank 1"
  ;;
bad_data)
  # Rank 1 cannot read its data: its error, and the job ends (rank 0 waits in a collective).
  job 30 "${MPIRUN[@]}" -n 1 "$MANTISSA" train --model lenet5 --max-steps 2 --no-progress \
    --threads 1 : -n 1 "$MANTISSA" train --model lenet5 --max-steps 2 --no-progress --threads 1 \
    --data-dir /no/such/dataset
  [ "$STATUS" -ne 0 ] || fail "exit status 0"
  expect_output "mantissa \(rank 1 of 2\): error: data directory /no/such/dataset of fashion-mnist does not exist"
  ;;
oom)
  # Past --memory-budget on the ranks: the out-of-memory report and the job ends.
  job 30 "${MPIRUN[@]}" -n 2 "$MANTISSA" "${RUN[@]}" --max-steps 2 --memory-budget 300KiB
  [ "$STATUS" -ne 0 ] || fail "exit status 0"
  expect_output "mantissa \(rank [01] of 2\): out of memory on cpu: cannot allocate"
  ;;
killed)
  # Rank 1 is killed (SIGKILL) while the job trains: the job ends within seconds.
  rm -f pid.*
  cat >rank.sh <<EOF
#!/bin/sh
echo \$\$ > pid.\${OMPI_COMM_WORLD_RANK:-0}
exec "$MANTISSA" ${RUN[*]} --synthetic-size 20000 --epochs 200 --batch-size 8
EOF
  chmod +x rank.sh
  timeout --kill-after=5 120 "${MPIRUN[@]}" -n 2 ./rank.sh >out.txt 2>&1 &
  job_pid=$!
  for _ in $(seq 1 100); do [ -f pid.1 ] && break; sleep 0.1; done
  [ -f pid.1 ] || fail "rank 1 did not start"
  sleep 2
  start=$SECONDS
  kill -KILL "$(cat pid.1)"
  wait "$job_pid"
  STATUS=$?
  SECONDS_TAKEN=$((SECONDS - start))
  [ "$STATUS" -ne 0 ] || fail "exit status 0"
  [ "$SECONDS_TAKEN" -le 20 ] || fail "the job took $SECONDS_TAKEN s to end after the kill"
  ;;
interrupt)
  # Ctrl-C on mpirun: it passes SIGTERM to the ranks after odls_base_sigkill_timeout seconds
  # (then SIGKILL after as many again); the ranks stop at one step, rank 0 saves, once.
  # (mpirun itself gets the signal: no `timeout` in between, which would pass on its own.)
  rm -f stopped.safetensors
  "${MPIRUN[@]}" -n 2 --mca odls_base_sigkill_timeout 3 "$MANTISSA" "${RUN[@]}" \
    --synthetic-size 20000 --epochs 200 --batch-size 8 --save stopped.safetensors >out.txt 2>&1 &
  job_pid=$!
  for _ in $(seq 1 300); do grep -q "data parallel" out.txt 2>/dev/null && break; sleep 0.1; done
  sleep 2
  start=$SECONDS
  kill -INT "$job_pid"
  for _ in $(seq 1 300); do kill -0 "$job_pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$job_pid" 2>/dev/null; then
    kill -KILL "$job_pid"
    fail "the job did not end within 30 s of Ctrl-C"
  fi
  wait "$job_pid"
  STATUS=$?
  SECONDS_TAKEN=$((SECONDS - start))
  [ "$STATUS" -ne 0 ] || fail "exit status 0"
  [ "$SECONDS_TAKEN" -le 25 ] || fail "the job took $SECONDS_TAKEN s to end after Ctrl-C"
  [ "$(grep -c "interrupted at step" out.txt)" -eq 1 ] || fail "not one 'interrupted' line"
  expect_output "interrupted at step [1-9][0-9]*, checkpoint saved to stopped.safetensors"
  step=$(sed -n 's/.*interrupted at step \([0-9]*\),.*/\1/p' out.txt)
  # The checkpoint resumes in one process with the same global batch, from that step.
  job 60 "$MANTISSA" "${RUN[@]}" --synthetic-size 20000 --epochs 200 --batch-size 8 \
    --gradient-accumulation 2 --resume stopped.safetensors --max-steps $((step + 2)) \
    --metrics-json resumed.json
  [ "$STATUS" -eq 0 ] || fail "the resume ended with $STATUS"
  grep -q "\"steps\": $((step + 2))" resumed.json || fail "the resumed run did not end at step $((step + 2))"
  echo "stopped at step $step in $SECONDS_TAKEN s after Ctrl-C; resumed to step $((step + 2))"
  ;;
resume)
  # 2 ranks x batch 6 save; 3 ranks x batch 4 and one process x batch 12 resume (global 12);
  # 3 ranks x batch 6 is another global batch, refused naming the numbers.
  rm -f two.safetensors
  job 60 "${MPIRUN[@]}" -n 2 "$MANTISSA" "${RUN[@]}" --batch-size 6 --max-steps 4 --zero 1 \
    --save two.safetensors
  [ "$STATUS" -eq 0 ] || fail "2 ranks ended with $STATUS"
  job 60 "${MPIRUN[@]}" -n 3 "$MANTISSA" "${RUN[@]}" --batch-size 4 --max-steps 8 \
    --resume two.safetensors --metrics-json three.json
  [ "$STATUS" -eq 0 ] || fail "3 ranks ended with $STATUS"
  grep -q '"world_size": 3' three.json || fail "no world_size 3 in the metrics"
  grep -q '"steps": 8' three.json || fail "3 ranks did not end at step 8"
  job 60 "$MANTISSA" "${RUN[@]}" --batch-size 12 --max-steps 8 --resume two.safetensors
  [ "$STATUS" -eq 0 ] || fail "one process ended with $STATUS"
  job 60 "${MPIRUN[@]}" -n 3 "$MANTISSA" "${RUN[@]}" --batch-size 6 --max-steps 8 \
    --resume two.safetensors
  [ "$STATUS" -ne 0 ] || fail "another global batch was not refused"
  expect_output "trained with a global batch of 12 \(2 ranks x --batch-size 6 x --gradient-accumulation 1\), not 18"
  ;;
refused)
  # What runs in one process says so under mpirun.
  job 30 "${MPIRUN[@]}" -n 2 "$MANTISSA" memory --model lenet5
  [ "$STATUS" -ne 0 ] || fail "mantissa memory ran over 2 processes"
  expect_output "'mantissa memory' does not run over 2 processes: run it in one process, with --ranks N"
  job 30 "${MPIRUN[@]}" -n 2 "$MANTISSA" train "${RUN[@]:1}" --zero 1 --numerics-report n.json
  [ "$STATUS" -ne 0 ] || fail "--numerics-report with --zero 1 ran"
  expect_output "--numerics-report cannot run with --zero 1"
  ;;
*)
  echo "unknown case $CASE"
  exit 2
  ;;
esac
echo "$CASE: exit status $STATUS after ${SECONDS_TAKEN} s"
