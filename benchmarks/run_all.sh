#!/usr/bin/env bash
set -u
# Every benchmark of benchmarks/, one after another (run it on an otherwise idle machine), writing
# benchmarks/results/. About 10 minutes on 2 CPU cores.
cd "$(dirname "$0")/.."
R=benchmarks/results
# Every temporary file (checkpoint, server logs, the model cache unless one is given) lives in one folder
# that is removed on exit, however the script ends.
WORK=$(mktemp -d -t diffuserve-bench-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
export DIFFUSERVE_CACHE="${DIFFUSERVE_CACHE:-$WORK/cache}"
.venv/bin/diffuserve make-tiny --family flux --output $WORK/bench_tiny --preset tiny > /dev/null 2>&1
# 1. issue 2: diffusers vs native vs HTTP (server with the default thread policy: 1 thread on 2 cores)
.venv/bin/diffuserve serve --model-path $WORK/bench_tiny --port 30401 > $WORK/bp_server.log 2>&1 &
SP=$!
for i in $(seq 1 60); do curl -sf localhost:30401/health > /dev/null && break; sleep 1; done
.venv/bin/python benchmarks/bench_pipeline.py --model-path $WORK/bench_tiny --threads 1 --runs 40 --base-url http://127.0.0.1:30401 > $R/bench_pipeline.txt 2>&1
kill -TERM $SP; wait $SP
# 2. issue 3
.venv/bin/python benchmarks/bench_batching.py --output-json $R/bench_batching.json > $R/bench_batching.txt 2>&1
# 3. issue 5 serving sweep
.venv/bin/diffuserve serve --model-path $WORK/bench_tiny --port 30402 > $WORK/s1.log 2>&1 &
S1=$!
.venv/bin/diffuserve serve --model-path $WORK/bench_tiny --port 30403 --batching-mode dynamic --batching-max-size 8 --batching-delay-ms 10 > $WORK/s2.log 2>&1 &
S2=$!
for i in $(seq 1 60); do curl -sf localhost:30402/health > /dev/null && curl -sf localhost:30403/health > /dev/null && break; sleep 1; done
.venv/bin/diffuserve bench --base-url http://127.0.0.1:30402 --concurrency 1,4,8,16 --num-requests 64 --size 64x64 --steps 4 --warmup-requests 8 --label singleton --output-json $R/serving_singleton.json --no-progress > $R/serving_singleton.txt 2>&1
.venv/bin/diffuserve bench --base-url http://127.0.0.1:30403 --concurrency 1,4,8,16 --num-requests 64 --size 64x64 --steps 4 --warmup-requests 8 --label "dynamic (max 8, 10 ms)" --output-json $R/serving_dynamic.json --no-progress > $R/serving_dynamic.txt 2>&1
.venv/bin/diffuserve bench --compare $R/serving_singleton.json $R/serving_dynamic.json --plot $R/serving.png > $R/serving_compare.txt 2>&1
kill -TERM $S1 $S2; wait $S1 $S2
# 4. issue 4
OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_residency.py --presets tiny,36m --rounds 5 > $R/bench_residency.txt 2>&1
echo ALLDONE
