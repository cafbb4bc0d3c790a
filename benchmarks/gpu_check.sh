#!/usr/bin/env bash
# GPU check of long-context training and of the serving engine on CUDA (issue 23; docs/long-context.md).
#
#     bash benchmarks/gpu_check.sh            # from the repository root, retrofit installed; ~6-8 min on one H200
#
# Each case runs in its own process (benchmarks/gpu_check.py) under a time limit, so one failure or
# out-of-memory does not stop the others; results are JSON lines in $OUT/gpu_check.jsonl (OUT defaults to
# the current folder) and a summary with the TaH2 ÷ plain ratios is printed at the end.
#   1. plain Qwen3-1.7B shape vs TaH2 (M = 2, whole stack) with flex attention, one training step
#      (bf16, gradient checkpointing, batch 1) at T = 4,096 and 16,384: seconds, tokens/s, peak memory;
#   2. TaH2 on sdpa (the chunked kernel's matmul blocks on CUDA) at T = 4,096;
#   3. the serving engine decoding on CUDA vs generate() (greedy tokens equal?);
#   4. issue 29's determinism check on the flex path: a left-padded batch, 10 forwards, each against sdpa.
# Written on a machine without a GPU: not run there (see docs/long-context.md).
set -u
OUT="${OUT:-.}"
mkdir -p "$OUT"
RES="$OUT/gpu_check.jsonl"
: > "$RES"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
here="$(cd "$(dirname "$0")" && pwd)"

run() {  # run CASE LIMIT_SECONDS
    local t0=$SECONDS
    if timeout "$2" python "$here/gpu_check.py" "$1" >> "$RES" 2> "$OUT/gpu_check_$(echo "$1" | tr ':' '_').err"; then
        echo "ok   $1 ($((SECONDS - t0)) s)"
    else
        echo "FAIL $1 (exit $?, $((SECONDS - t0)) s; see $OUT/gpu_check_$(echo "$1" | tr ':' '_').err)"
        echo "{\"case\": \"$1\", \"error\": \"failed or timed out\"}" >> "$RES"
    fi
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
run train:plain:flex_attention:4096 75
run train:tah2:flex_attention:4096 110
run train:plain:flex_attention:16384 60
run train:tah2:flex_attention:16384 90
run train:plain:sdpa:4096 40
run train:tah2:sdpa:4096 50
run serve 50
run flex_padded 60

python - "$RES" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
train = {(r["model"], r["attn_implementation"], r["T"]): r for r in rows if r.get("case") == "train" and "sec" in r}
for (model, impl, T), r in sorted(train.items()):
    print(f"{model:5s} {impl:15s} T={T:6d}  {r['sec']:7.2f} s  {r['tokens_per_sec']:9.1f} tok/s  {r['peak_gib']:6.2f} GiB")
for (model, impl, T), r in sorted(train.items()):
    p = train.get(("plain", impl, T))
    if model == "tah2" and p:
        print(f"TaH2 / plain, {impl}, T={T}: time {r['sec'] / p['sec']:.2f}, memory {r['peak_gib'] / p['peak_gib']:.2f}")
for r in rows:
    if r.get("case") in ("serve", "flex_padded"):
        print(r["case"] + ":", json.dumps(r))
PY
