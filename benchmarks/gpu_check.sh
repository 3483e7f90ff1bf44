#!/usr/bin/env bash
# The GPU check of --quantization (issue 28 item 7): on a CUDA machine, within 10 minutes, random-weight FLUX.1-dev
# and Wan2.1-1.3B DiTs built on the device (no download): bf16 vs fp8 vs int8 (vs int8-dynamic) step time and peak
# memory, native vs diffusers pipeline time, and with two GPUs CFG parallel vs one. On a machine without CUDA it
# prints one line and exits 0. Extra arguments go to benchmarks/gpu_check.py (see its --help).
#   bash benchmarks/gpu_check.sh                 # from the repository root, the project's virtualenv active
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --only dit
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 600 "${PYTHON:-python3}" "$root/benchmarks/gpu_check.py" "$@"
