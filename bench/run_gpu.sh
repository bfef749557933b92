#!/usr/bin/env bash
# One device call: the GPU tests (`pytest -m gpu`), optionally tuning, then the kernel benchmarks; the short
# table comes last. Logs and JSON go to $OUT (the device tool's return folder) or /tmp/deepinfer-gpu.
#   bash bench/run_gpu.sh            tests + benchmarks
#   TUNE=1 bash bench/run_gpu.sh     also tune the V4.1 decode kernels (writes $OUT/sm90.json)
#   SLICE=1 bash bench/run_gpu.sh    the end-to-end full-width slice (bench/bench_slice.py) instead of the kernel
#                                    benchmarks (BENCH_KERNELS=1: both); SLICE_PATHS, SLICE_CASES, SLICE_BUDGET (seconds)
#                                    pass through. Carry artifacts/slice-sm90 (`python bench/bench_slice.py
#                                    --build-artifact artifacts/slice-sm90`, no GPU needed) so the device compiles nothing.
#   GPU_TESTS="tests/test_gpu_cuda_graphs.py ..." bash bench/run_gpu.sh   only those test files
#   DSPARK=1 bash bench/run_gpu.sh   DSpark drafting on the trained checkpoint (bench/dspark_bench.py) on the sm90 target
#                                    (DSPARK_TARGET, DSPARK_BATCHES, DSPARK_TOKENS, DSPARK_PASSES, DSPARK_MODES,
#                                    DSPARK_BUDGETS; DSPARK_INTERLEAVE=1: every mode's engine built once, the passes
#                                    timed side by side) instead of the kernel benchmarks
#   SIDE=1 bash bench/run_gpu.sh     the slice's decode steps of two trees side by side (bench/step_profile.py, each tree
#                                    over its own artifact, alternating base and new, SIDE_ROUNDS times at each of
#                                    SIDE_CONTEXTS, SIDE_BATCHES) instead of the kernel benchmarks; carry .base,
#                                    artifacts/slice-sm90-base and artifacts/slice-sm90 (`python bench/prepare_gpu.py
#                                    --base COMMIT`)
#   PDL=1 bash bench/run_gpu.sh      programmatic dependent launch off and on (DEEPINFER_PDL=0/1), alternating, over the
#                                    same cubins: the slice's decode steps (bench/step_profile.py at SIDE_CONTEXTS,
#                                    SIDE_BATCHES, SIDE_ROUNDS times; carry artifacts/slice-sm90; PDL_VARIANTS lists
#                                    "pdl:artifact" pairs to run instead of "0:artifacts/slice-sm90 1:artifacts/slice-sm90")
#                                    and, with .cubin-cache carried, end to end (bench/dspark_bench.py, drafting off,
#                                    PDL_BATCHES, PDL_TOKENS) instead of the kernel benchmarks; every log in $OUT/pdl.log
#   PROFILE=1 bash bench/run_gpu.sh  where the slice's steps go (bench/step_profile.py): decode at PROFILE_BATCHES, and
#                                    prefill at PROFILE_PREFILL tokens, with artifacts/slice-sm90-fp8 too when carried,
#                                    instead of the kernel benchmarks (BENCH_KERNELS=1: both)
# `python bench/prepare_gpu.py` (no GPU) builds what to carry: .cubin-cache and the slice's artifacts.
# Prebuilt artifacts (.prebuilt/smooth-{bf16,fp32}, compiled on a GPU-less machine and carried to the device: an
# ignored folder, so name it in the device call's `carry`) are what the artifact test loads when present; make them
# with deepinfer.compile(DeepseekV41Flash.from_pretrained("tests/fixtures/v41-smooth"), target="sm90"[, dot_fp32=True])
# .save(".prebuilt/smooth-bf16" | ".prebuilt/smooth-fp32"). Without them the test compiles on the device.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/deepinfer-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
[ -d .prebuilt ] && export DEEPINFER_ARTIFACTS=$PWD/.prebuilt
[ -d .cubin-cache ] && export DEEPINFER_CACHE=$PWD/.cubin-cache  # cubins built here ahead of time (carried): no compile
export DEEPINFER_RESULTS_DIR=$OUT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
SECONDS=0
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest -m gpu -q -p no:cacheprovider -n "${JOBS:-4}" -rs ${GPU_TESTS:-tests/kernels tests/test_gpu_*.py \
    tests/test_paged_batched.py tests/test_autotune.py tests/test_fp8_activations.py} > "$OUT/pytest.log" 2>&1
echo "pytest -m gpu: rc=$? in ${SECONDS}s"; grep -sE "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -sE "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
for f in "$OUT"/e2e_*.json; do [ -f "$f" ] && echo "$(basename "$f" .json): $(cat "$f")"; done
if [ "${TUNE:-0}" = 1 ]; then
    SECONDS=0
    [ -f autotune/tuned/sm90.json ] && cp autotune/tuned/sm90.json "$OUT/sm90.json"  # extend the committed file
    timeout "${TUNE_TIMEOUT:-300}" python3 -m autotune.run --target sm90 --buckets "${TUNE_BUCKETS:-16,64}" --templates "${TUNE_TEMPLATES:-linear}" \
        --only "${TUNE_ONLY:-}" --out "$OUT/sm90.json" > "$OUT/tune.log" 2>&1
    echo "tuning: rc=$? in ${SECONDS}s"; grep -A 40 "^template" "$OUT/tune.log"
fi
if [ "${SLICE:-0}" = 1 ]; then
    SECONDS=0
    timeout "${SLICE_TIMEOUT:-480}" python3 bench/bench_slice.py --out "$OUT/slice.json" --budget "${SLICE_BUDGET:-300}" \
        --artifact "${SLICE_ARTIFACT:-artifacts/slice-sm90}" ${SLICE_PATHS:+--paths "$SLICE_PATHS"} \
        ${SLICE_CASES:+--cases "$SLICE_CASES"} > "$OUT/slice.log" 2>&1
    echo "slice: rc=$? in ${SECONDS}s"; grep -E "^(device|sm90|eager|compile|artifact|Traceback)" "$OUT/slice.log"
    sed -n '/^case /,$p' "$OUT/slice.log"
    [ "${BENCH_KERNELS:-0}" = 1 ] || exit 0
fi
if [ "${DSPARK:-0}" = 1 ]; then
    SECONDS=0
    timeout "${DSPARK_TIMEOUT:-300}" python3 bench/dspark_bench.py --target "${DSPARK_TARGET:-sm90}" \
        --batches "${DSPARK_BATCHES:-1,16,64}" --max-tokens "${DSPARK_TOKENS:-32}" --passes "${DSPARK_PASSES:-1}" \
        ${DSPARK_MODES:+--modes "$DSPARK_MODES"} ${DSPARK_BUDGETS:+--budgets "$DSPARK_BUDGETS"} \
        $([ "${DSPARK_INTERLEAVE:-0}" = 1 ] && echo --interleave) --out "$OUT/dspark.json" > "$OUT/dspark.log" 2>&1
    echo "dspark: rc=$? in ${SECONDS}s"; grep -E "^(batch|median|paired|Traceback|[A-Za-z]*Error)" "$OUT/dspark.log"
    [ "${BENCH_KERNELS:-0}" = 1 ] || exit 0
fi
if [ "${SIDE:-0}" = 1 ]; then
    SECONDS=0
    for need in .base artifacts/slice-sm90-base artifacts/slice-sm90; do
        [ -d "$need" ] || { echo "SIDE=1: no $need here (python bench/prepare_gpu.py --base COMMIT, then carry it)"; exit 1; }
    done
    for ctx in ${SIDE_CONTEXTS:-1024 16384}; do
        for round in $(seq "${SIDE_ROUNDS:-2}"); do
            for tree in base new; do
                if [ "$tree" = base ]; then dir=.base artifact=$PWD/artifacts/slice-sm90-base
                else dir=. artifact=$PWD/artifacts/slice-sm90; fi
                log="$OUT/side-$tree-$ctx-$round.log"
                (cd "$dir" && PYTHONPATH=$PWD timeout 150 python3 bench/step_profile.py --artifact "$artifact" \
                    --batches "${SIDE_BATCHES:-1,16,64}" --context "$ctx" --kernels 6 > "$log" 2>&1)
                echo "$tree, ctx $ctx, round $round:"; grep -E "^decode|traced|Error" "$log" | cut -c1-110
            done
        done
    done
    echo "side by side: ${SECONDS}s"
    [ "${BENCH_KERNELS:-0}" = 1 ] || exit 0
fi
if [ "${PDL:-0}" = 1 ]; then
    SECONDS=0
    for ctx in ${SIDE_CONTEXTS:-1024 16384}; do
        for round in $(seq "${SIDE_ROUNDS:-2}"); do
            for variant in ${PDL_VARIANTS:-0:artifacts/slice-sm90 1:artifacts/slice-sm90}; do
                pdl=${variant%%:*} artifact=${variant#*:}
                echo "== slice PDL $pdl $artifact, ctx $ctx, round $round" >> "$OUT/pdl.log"
                DEEPINFER_PDL=$pdl timeout 150 python3 bench/step_profile.py --artifact "$artifact" \
                    --batches "${SIDE_BATCHES:-1,16,64}" --context "$ctx" --kernels 6 > "$OUT/pdl-step.log" 2>&1
                cat "$OUT/pdl-step.log" >> "$OUT/pdl.log"
                echo "PDL $pdl $artifact, ctx $ctx, round $round:"
                grep -E "^decode|traced|Error" "$OUT/pdl-step.log" | cut -c1-110
            done
        done
    done
    if [ -d .cubin-cache ]; then
        for round in $(seq "${SIDE_ROUNDS:-2}"); do
            for pdl in 0 1; do
                echo "== end to end PDL $pdl, round $round" >> "$OUT/pdl.log"
                DEEPINFER_PDL=$pdl timeout 200 python3 bench/dspark_bench.py --target sm90 --batches "${PDL_BATCHES:-1,64}" \
                    --max-tokens "${PDL_TOKENS:-128}" --modes off > "$OUT/pdl-e2e.log" 2>&1
                cat "$OUT/pdl-e2e.log" >> "$OUT/pdl.log"
                echo "end to end PDL $pdl, round $round:"; grep -E "^batch|Traceback|[A-Za-z]*Error" "$OUT/pdl-e2e.log"
            done
        done
    fi
    rm -f "$OUT/pdl-step.log" "$OUT/pdl-e2e.log"
    echo "PDL off and on: ${SECONDS}s"
    [ "${BENCH_KERNELS:-0}" = 1 ] || exit 0
fi
if [ "${PROFILE:-0}" = 1 ]; then
    SECONDS=0
    timeout 120 python3 bench/step_profile.py --batches "${PROFILE_BATCHES:-1,64}" --kernels 8 > "$OUT/decode.log" 2>&1
    grep -E "step |traced" "$OUT/decode.log"
    for artifact in artifacts/slice-sm90 artifacts/slice-sm90-fp8; do
        [ -d "$artifact" ] || continue
        timeout 120 python3 bench/step_profile.py --artifact "$artifact" --prefill "${PROFILE_PREFILL:-1024,8192}" \
            --top 10 > "$OUT/prefill-$(basename "$artifact").log" 2>&1
        echo "$artifact:"; grep -E "^prefill|moe_experts |linear |swiglu |sparse_attention " \
            "$OUT/prefill-$(basename "$artifact").log"
    done
    echo "profile: ${SECONDS}s"
    [ "${BENCH_KERNELS:-0}" = 1 ] || exit 0
fi
SECONDS=0
TUNING=${TUNING:-autotune/tuned/sm90.json}
[ -f "$OUT/sm90.json" ] && TUNING=$OUT/sm90.json
python3 bench/bench_kernels.py --out "$OUT/bench.json" --tuning "$TUNING" > "$OUT/bench.log" 2>&1
echo "bench: rc=$? in ${SECONDS}s"; grep FAILED "$OUT/bench.log"; sed -n '/^kernel /,$p' "$OUT/bench.log"
