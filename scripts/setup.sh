#!/usr/bin/env bash
# Installs the Debian packages Mantissa needs to build, test and train on Fashion-MNIST (the data
# comes from Debian's dataset-fashion-mnist), only those that are missing.
# Safe to run repeatedly; needs root (or sudo) only when something is missing.
#
#   bash scripts/setup.sh            # build + test dependencies
#   bash scripts/setup.sh --bench    # also the libraries benchmarks compare with (OpenBLAS, BLIS)
#                                    # and Debian's PyTorch (regenerates tests/golden)
#   bash scripts/setup.sh --browser  # also Chromium, which the tests render the HTML reports in
#                                    # (with DejaVu fonts, whose metrics the label checks assume)
#   bash scripts/setup.sh --fuzz     # also clang 16 and its libFuzzer runtime (scripts/fuzz.sh)
set -euo pipefail

# Open MPI (libopenmpi-dev, openmpi-bin: mpirun) carries data-parallel training between processes.
packages=(cmake g++ make libgtest-dev libbenchmark-dev nlohmann-json3-dev zlib1g-dev
          libopenmpi-dev openmpi-bin dataset-fashion-mnist)
for arg in "$@"; do
  case "$arg" in
    --bench) packages+=(libopenblas0-pthread libblis4-pthread python3-torch) ;;
    --browser) packages+=(chromium fonts-dejavu-core) ;;
    --fuzz) packages+=(clang-16 libclang-rt-16-dev) ;;
    *) echo "setup: unknown option '$arg' (use --bench, --browser, --fuzz or nothing)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all dependencies present (${packages[*]})"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root or sudo to install ${missing[*]}" >&2; exit 1; }
  sudo=sudo
fi
$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
