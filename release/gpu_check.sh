#!/usr/bin/env bash
# One device check, within 8 minutes (issues #23, #55), then a table and issue 55's last line:
#   0. the CUDA tests: the packed attention (one variable-length flash call a layer) against the dense reference
#      (fp32, bf16; values and gradients), the fused RMSNorm operator against torch's, pinned non-blocking
#      copies, the trainer's logits packed against dense, the HF engine on CUDA, and (GPU only) a Qwen VL
#      policy's log-probs and a step with images;
#   1. train-phase MFU of the Megatron trainer (`release/bench_train_mfu.py`, bf16, 64 rows of 1,024 tokens in
#      micro-batches filled by a 16,384-token budget, as training fills them): Qwen2.5-0.5B's shape, then Qwen2.5-1.5B's with one more step
#      profiled (the share of its wall time the GPU ran kernels, top ops by GPU and host time);
#   2. a 3-step GRPO `fit()` of the demo with the Hugging Face engine in the trainer's process (no vLLM on the
#      device machine), one training worker: NCCL on a GPU.
# Without CUDA it runs the same on the CPU at the tiny preset (fp32; micro-batches of 4 and 8 rows): what the
# test suite checks. Last line:
#   gpu_check: mfu_0_5b=<x> mfu_1_5b=<y> busy_1_5b=<share> weight_sync_s_1_5b=<s> grpo_step_s_1_5b=<s>
# (on the CPU the two MFU runs are the tiny preset's; the 1.5B GRPO fit with its engine in an engine actor on the
# trainer's GPU, weights by CUDA IPC, is not wired yet: its two fields print nan, the demo fit's figures are in
# the table).
#
#   bash release/gpu_check.sh                          # here, or on the device machine after its pack:
#   source .devicepack/install-pack.sh && export PYTHONPATH=$PWD:$PYTHONPATH && bash release/gpu_check.sh
#
# Env: PY (default python3, or .venv/bin/python when present), OUT (a folder for the logs; default a temp dir).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  MODE=gpu; LEN=1024; SMALL_MB=16; LARGE_MB=16; FIT_S=240  # rows of 1,024 tokens: a 16,384-token budget
  SMALL=(--preset qwen2-0.5b --dtype bf16 --steps 3 --warmup 2); LARGE=(--preset qwen2-1.5b --dtype bf16 --steps 3 --warmup 2)
else
  MODE=cpu; LEN=64; SMALL_MB=4; LARGE_MB=8; FIT_S=300
  SMALL=(--preset tiny --dtype fp32 --steps 2 --warmup 1); LARGE=(--preset tiny --dtype fp32 --steps 2 --warmup 1)
fi
echo "gpu_check: mode $MODE, logs in $OUT"
start=$(date +%s)
TESTS=(tests/train/test_packed_attention.py tests/train/test_fused.py::test_rms_norm_operator_equals_torchs_rmsnorm
  tests/train/test_micro_batches.py
  tests/rollout/test_rollout_hf.py::test_on_cuda_matches_reference_and_sleep_frees_the_device)
# on a GPU also a Qwen2-VL / Qwen2.5-VL policy (log-probs against transformers on the CPU, a step with images);
# on the CPU the suite runs it already
[ "$MODE" = gpu ] && TESTS+=(tests/vision/test_qwen_vl.py::test_policy_log_probs_and_a_step_with_images_once_per_prompt)
timeout 120 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 120 "$PY" release/bench_train_mfu.py "${SMALL[@]}" --max-tokens $((SMALL_MB * LEN)) 2>&1 | tee "$OUT/mfu_small.log"
small_rc=${PIPESTATUS[0]}
timeout 200 "$PY" release/bench_train_mfu.py "${LARGE[@]}" --max-tokens $((LARGE_MB * LEN)) --profile 15 2>&1 | tee "$OUT/mfu_large.log"
large_rc=${PIPESTATUS[0]}
timeout "$FIT_S" "$PY" examples/grpo.py train.steps=3 train.dp_size=1 rollout.engine=hf \
  checkpoint.enable=false checkpoint.max_failures=0 output.dir="$OUT/fit" 2>&1 | tee "$OUT/fit.log"
fit_rc=${PIPESTATUS[0]}
"$PY" - "$OUT" "$MODE" "$(( $(date +%s) - start ))" "$tests_rc" "$small_rc" "$large_rc" "$fit_rc" "$SMALL_MB" "$LARGE_MB" <<'EOF'
import json, re, statistics, sys
from pathlib import Path

out, mode, seconds = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
tests_rc, small_rc, large_rc, fit_rc, small_mb, large_mb = (int(x) for x in sys.argv[4:10])
tests = next((l for l in reversed((out / "tests.log").read_text().splitlines()) if " in " in l), "no summary")


def mfu_fields(log: str) -> dict:
    line = next((l for l in reversed((out / log).read_text().splitlines()) if l.startswith("train_mfu:")), "")
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


small, large = mfu_fields("mfu_small.log"), mfu_fields("mfu_large.log")
profiled = next((l.strip() for l in (out / "mfu_large.log").read_text().splitlines() if l.startswith("profiled step:")), "")
busy = re.search(r"\((\d+)% busy", profiled)
rows = []
for path in sorted((out / "fit").glob("*/metrics.jsonl")):
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
steps = [r for r in rows if "time/step" in r]
sync = [r["time/weight_sync"] for r in steps if "time/weight_sync" in r]
print(f"\n| check ({mode}) | result |\n|---|---|")
print(f"| CUDA tests: packed attention = dense, fused RMSNorm, pinned copies, HF engine, Qwen VL policy (pytest) | {tests.strip('= ')} (exit {tests_rc}) |")
for f, rc, mb in ((small, small_rc, small_mb), (large, large_rc, large_mb)):
    print(f"| bench_train_mfu {f.get('preset', '?')} {f.get('dtype', '?')}, micro-batches of {mb} rows | "
          f"MFU {f.get('mfu', '?')}, {f.get('tokens_per_s', '?')} tokens/s, step {f.get('step_s', '?')} s (exit {rc}) |")
print(f"| one more step of the second run, profiled | {profiled or 'no profile'} |")
print(f"| GRPO fit of the demo, HF engine in process, 3 steps | {len(steps)} steps, step s "
      + " ".join(f"{r['time/step']:.2f}" for r in steps)
      + (f", weight sync s {statistics.median(sync):.3f}" if sync else "")
      + (f", reward {steps[-1].get('reward_mean', float('nan')):.3f}" if steps else "")
      + (f", train MFU {steps[-1]['perf/mfu_train']:.3f}" if steps and "perf/mfu_train" in steps[-1] else "")
      + f" (exit {fit_rc}) |")
print(f"| whole check | {seconds} s |")
ok = tests_rc == 0 and small_rc == 0 and large_rc == 0 and fit_rc == 0 and len(steps) == 3
print(f"gpu_check: mode={mode} ok={str(ok).lower()} fit_steps={len(steps)}")
share = f"{int(busy[1]) / 100:.2f}" if busy else "nan"
print(f"gpu_check: mfu_0_5b={small.get('mfu', 'nan')} mfu_1_5b={large.get('mfu', 'nan')} busy_1_5b={share} "
      "weight_sync_s_1_5b=nan grpo_step_s_1_5b=nan")
sys.exit(0 if ok else 1)
EOF
