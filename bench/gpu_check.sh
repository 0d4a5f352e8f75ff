#!/usr/bin/env bash
# On a machine with one NVIDIA GPU, in under 5 minutes: the GPU tests, the examples probed on the
# card, 50 real training steps at each chosen m, and the CLI's datasheet. Prints everything it measures.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
status=0
echo "== device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
echo "== GPU tests"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -rs || status=1
echo "== examples: probe, 50 training steps at the chosen m, m+1"
timeout 120 "$PY" bench/gpu_train_check.py || status=1
echo "== CLI datasheet on cuda"
timeout 60 "$PY" -m autotune.cli probe examples/gpt.py:task --device cuda --budget 2GiB --target-batch 512 || status=1
echo "== --device all (one spawned process per GPU)"
timeout 60 "$PY" -m autotune.cli probe examples/cnn.py:task --device all --budget 2GiB --target-batch 256 || status=1
echo "== gpu_check exit status: $status"
exit $status
