#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/) and runs each for a while, printing its executions and
# result. Needs clang 16 and its libFuzzer runtime: bash scripts/setup.sh --fuzz.
#
#   bash scripts/fuzz.sh [SECONDS] [HARNESS...]   # each harness SECONDS (default 60); all by default
#
#   FUZZ_RUNS=N      stop a harness after N executions instead (SECONDS still bounds it)
#   FUZZ_BUILD=DIR   build directory (default build-fuzz)
#   FUZZ_CXX=PROG    compiler (default clang++-16)
#
# Each harness starts from its committed seeds (fuzz/corpus/NAME/) plus what earlier runs found
# (DIR/corpus/NAME/, where new inputs go: the repository's corpus stays as committed). A crash, a
# sanitizer report, an escaped exception or an allocation over 2 GiB stops that harness and
# leaves the input in DIR/crashes/NAME/; the script then exits with status 1.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift || true
build=${FUZZ_BUILD:-build-fuzz}
cxx=${FUZZ_CXX:-clang++-16}

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DMANTISSA_FUZZ=ON -DMANTISSA_BUILD_TESTS=OFF -DMANTISSA_BUILD_BENCHMARKS=OFF >/dev/null
fi
cmake --build "$build" -j2 --target mantissa_fuzzers

if [ $# -gt 0 ]; then
  harnesses=("$@")
else
  harnesses=()
  for d in fuzz/corpus/*/; do harnesses+=("$(basename "$d")"); done
fi

failed=0
for h in "${harnesses[@]}"; do
  prog="$build/fuzz/fuzz_$h"
  [ -x "$prog" ] || { echo "fuzz: no harness '$h' (fuzz/fuzz_$h.cc)" >&2; exit 2; }
  mkdir -p "$build/corpus/$h" "$build/crashes/$h"
  args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
        -artifact_prefix="$build/crashes/$h/")
  [ -n "${FUZZ_RUNS:-}" ] && args+=(-runs="$FUZZ_RUNS")
  [ -f "fuzz/$h.dict" ] && args+=(-dict="fuzz/$h.dict")
  log="$build/fuzz_$h.log"
  start=$(date +%s)
  if "$prog" "${args[@]}" "$build/corpus/$h" "fuzz/corpus/$h" >"$log" 2>&1; then
    result="no crash"
  else
    result="FAILED (see $log and $build/crashes/$h/)"
    failed=1
    tail -n 40 "$log" >&2
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  corpus=$(find "$build/corpus/$h" -type f | wc -l)
  printf 'fuzz_%-12s %10s executions in %4d s, corpus %5d inputs (+%d seeds): %s\n' \
    "$h" "${runs:-?}" "$(($(date +%s) - start))" "$corpus" \
    "$(find "fuzz/corpus/$h" -type f | wc -l)" "$result"
done
exit $failed
