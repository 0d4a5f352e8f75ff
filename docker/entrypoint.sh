#!/bin/sh
# The service image's entry point: migrate the database to head, then hand the process to uvicorn.
#   AUTOTUNE_DATABASE_URL  default sqlite:////data/autotune.db (the image's volume)
#   AUTOTUNE_API_TOKENS    comma-separated write tokens (name=token entries record the uploader)
#   AUTOTUNE_HOST/PORT/WORKERS  where and how many uvicorn workers (default 0.0.0.0:8000, 1)
# Extra arguments go to uvicorn as they are. PYTHON picks the interpreter (tests point it at the venv).
set -eu

PYTHON="${PYTHON:-python}"
: "${AUTOTUNE_DATABASE_URL:=sqlite:////data/autotune.db}"
export AUTOTUNE_DATABASE_URL

"$PYTHON" -m autotune_server upgrade

# exec: uvicorn becomes the container's main process and gets SIGTERM directly for a clean shutdown.
exec "$PYTHON" -m uvicorn autotune_server.app:create_app --factory \
    --host "${AUTOTUNE_HOST:-0.0.0.0}" \
    --port "${AUTOTUNE_PORT:-8000}" \
    --workers "${AUTOTUNE_WORKERS:-1}" \
    --timeout-keep-alive 5 \
    "$@"
