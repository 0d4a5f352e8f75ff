#!/usr/bin/env bash
# `make run`: probe the examples on this machine's device, print their datasheets, then serve them:
# a server on a SQLite file, the profiles uploaded through the API, the dashboard's URL printed.
set -euo pipefail
cd "$(dirname "$0")/.."
AUTOTUNE=.venv/bin/autotune
RUN_DIR=${RUN_DIR:-var/run}
PORT=${PORT:-8765}
TARGET_BATCH=${TARGET_BATCH:-256}
mkdir -p "$RUN_DIR"

if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  device_args=(--device cuda)   # budget: what this process can get on the card
  echo "CUDA device found: probing on cuda:0"
else
  device_args=(--device cpu)
  echo "no CUDA device: probing on the CPU meter (live tensor bytes under a budget)"
fi

# CPU budgets sized so each example lands at a few dozen samples per micro-batch.
declare -A cpu_budget=([mlp]=2MiB [gpt]=24MiB [cnn]=16MiB)
for name in mlp gpt cnn; do
  args=("${device_args[@]}")
  [[ ${device_args[1]} == cpu ]] && args+=(--budget "${cpu_budget[$name]}")
  echo
  "$AUTOTUNE" probe "examples/$name.py:task" "${args[@]}" --target-batch "$TARGET_BATCH" \
    --output "$RUN_DIR/$name.json"
done

# A sequence-aware task at three lengths in one run: one profile per length, the memory surface over
# (m, L) and the longest length that fits at m = 1 (its datasheet page charts them).
seq_args=("${device_args[@]}")
[[ ${device_args[1]} == cpu ]] && seq_args+=(--budget 64MiB)
echo
"$AUTOTUNE" probe examples/gpt.py:task_seq "${seq_args[@]}" --seq-len 128,256,512 --max-seq-len 2048 \
  --target-tokens 65536 --output "$RUN_DIR/gpt_seq.json"

# var/run is this script's own scratch store: each run serves what it has just measured.
rm -f "$RUN_DIR"/autotune.db "$RUN_DIR"/autotune.db-wal "$RUN_DIR"/autotune.db-shm
export AUTOTUNE_DATABASE_URL="sqlite:///$PWD/$RUN_DIR/autotune.db"
export AUTOTUNE_API_TOKENS="make-run=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export AUTOTUNE_TOKEN="${AUTOTUNE_API_TOKENS#make-run=}"
URL="http://127.0.0.1:$PORT"
"$AUTOTUNE" serve --host 127.0.0.1 --port "$PORT" > "$RUN_DIR/server.log" 2>&1 &
server_pid=$!
trap 'kill $server_pid 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 1 60); do
  .venv/bin/python -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=1)" "$URL/healthz" 2>/dev/null && break
  kill -0 $server_pid 2>/dev/null || { echo "the server did not start: see $RUN_DIR/server.log"; exit 1; }
  sleep 0.5
done
.venv/bin/python - "$URL" "$RUN_DIR" <<'PY'
import json
import sys
from pathlib import Path

from autotune.core.schemas import Profile
from autotune_client import TunerClient

url, run_dir = sys.argv[1], Path(sys.argv[2])
with TunerClient(base_url=url) as client:
    for name in ("mlp", "gpt", "cnn", "gpt_seq"):
        parsed = json.loads((run_dir / f"{name}.json").read_text())
        for item in parsed if isinstance(parsed, list) else [parsed]:  # a run over lengths: an array
            profile = Profile.model_validate(item)
            where = f" at L={profile.seq_len}" if profile.seq_len else ""
            print(f"uploaded {profile.task}{where} as profile {client.upload(profile)}")
PY
echo
echo "autotune is serving the examples' profiles at $URL (dashboard); the API schema is $URL/openapi.json."
echo "Press Ctrl-C to stop."
wait $server_pid
