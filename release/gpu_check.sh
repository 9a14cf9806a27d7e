#!/usr/bin/env bash
# One device check, within 8 minutes (issue #23), then a table:
#   0. the CUDA tests: the packed attention against the dense reference on the device's fused kernels (fp32,
#      bf16; values and gradients), the trainer's logits packed against dense, the HF engine on CUDA, and (GPU
#      only) a Qwen VL policy's log-probs and a step with images;
#   1. train-phase MFU of the Megatron trainer (`release/bench_train_mfu.py`): on a GPU Qwen2.5-0.5B's shape in
#      bf16, with the packed (fused) attention, the trainer's default; 64 rows of 1024 tokens in micro-batches of
#      4 rows (then one step profiled: GPU-busy share, top ops), and again in micro-batches of 16;
#   2. a 3-step GRPO `fit()` of the demo with the Hugging Face engine (no vLLM on the device machine), one
#      training worker: NCCL on a GPU.
# Without CUDA it runs the same on the CPU at the tiny preset (fp32; micro-batches of 4 and 8 rows): what the
# test suite checks.
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
  MODE=gpu; MFU_ARGS=(--preset qwen2-0.5b --dtype bf16 --steps 4 --warmup 2); BIG=16; FIT_S=240
else
  MODE=cpu; MFU_ARGS=(--preset tiny --dtype fp32 --steps 2 --warmup 1); BIG=8; FIT_S=300
fi
echo "gpu_check: mode $MODE, logs in $OUT"
start=$(date +%s)
TESTS=(tests/train/test_packed_attention.py
  tests/rollout/test_rollout_hf.py::test_on_cuda_matches_reference_and_sleep_frees_the_device)
# on a GPU also a Qwen2-VL / Qwen2.5-VL policy (log-probs against transformers on the CPU, a step with images);
# on the CPU the suite runs it already
[ "$MODE" = gpu ] && TESTS+=(tests/vision/test_qwen_vl.py::test_policy_log_probs_and_a_step_with_images_once_per_prompt)
timeout 120 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}
timeout 150 "$PY" release/bench_train_mfu.py "${MFU_ARGS[@]}" --micro-batch-size 4 --profile 15 2>&1 | tee "$OUT/mfu.log"
mfu_rc=${PIPESTATUS[0]}
timeout 120 "$PY" release/bench_train_mfu.py "${MFU_ARGS[@]}" --micro-batch-size "$BIG" 2>&1 | tee "$OUT/mfu_big.log"
big_rc=${PIPESTATUS[0]}
timeout "$FIT_S" "$PY" examples/grpo.py train.steps=3 train.dp_size=1 rollout.engine=hf \
  checkpoint.enable=false checkpoint.max_failures=0 output.dir="$OUT/fit" 2>&1 | tee "$OUT/fit.log"
fit_rc=${PIPESTATUS[0]}
"$PY" - "$OUT" "$mfu_rc" "$fit_rc" "$MODE" "$(( $(date +%s) - start ))" "$tests_rc" "$big_rc" "$BIG" <<'EOF'
import json, sys
from pathlib import Path

out, mfu_rc, fit_rc, mode, seconds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
tests_rc, big_rc, big = int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
tests = next((l for l in reversed((out / "tests.log").read_text().splitlines()) if " in " in l), "no summary")


def mfu_fields(log: str) -> dict:
    line = next((l for l in reversed((out / log).read_text().splitlines()) if l.startswith("train_mfu:")), "")
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


fields, big_fields = mfu_fields("mfu.log"), mfu_fields("mfu_big.log")
busy = next((l.strip() for l in (out / "mfu.log").read_text().splitlines() if l.startswith("profiled step:")), "")
rows = []
for path in sorted((out / "fit").glob("*/metrics.jsonl")):
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
steps = [r for r in rows if "time/step" in r]
print(f"\n| check ({mode}) | result |\n|---|---|")
print(f"| CUDA tests: packed attention = dense, HF engine, Qwen VL policy (pytest) | {tests.strip('= ')} (exit {tests_rc}) |")
for f, rc, mb in ((fields, mfu_rc, "4"), (big_fields, big_rc, big)):
    print(f"| bench_train_mfu {f.get('preset', '?')} {f.get('dtype', '?')}, micro-batches of {mb} rows | "
          f"MFU {f.get('mfu', '?')}, {f.get('tokens_per_s', '?')} tokens/s, step {f.get('step_s', '?')} s (exit {rc}) |")
print(f"| one step profiled (micro-batches of 4) | {busy or 'no profile'} |")
print(f"| GRPO fit, HF engine, 3 steps | {len(steps)} steps, step s "
      + " ".join(f"{r['time/step']:.2f}" for r in steps)
      + (f", reward {steps[-1].get('reward_mean', float('nan')):.3f}" if steps else "")
      + (f", train MFU {steps[-1]['perf/mfu_train']:.3f}" if steps and "perf/mfu_train" in steps[-1] else "")
      + f" (exit {fit_rc}) |")
print(f"| whole check | {seconds} s |")
ok = tests_rc == 0 and mfu_rc == 0 and big_rc == 0 and fit_rc == 0 and len(steps) == 3
print(f"gpu_check: mode={mode} ok={str(ok).lower()} mfu={fields.get('mfu', 'nan')} "
      f"mfu_mb{big}={big_fields.get('mfu', 'nan')} fit_steps={len(steps)}")
sys.exit(0 if ok else 1)
EOF
