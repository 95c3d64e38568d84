#!/usr/bin/env bash
# Create the `longstraw-gpu` process work pool on the Prefect server at $PREFECT_API_URL, unless it exists.
# Idempotent: safe to run on every deploy.
#
#   PREFECT_API_URL=http://127.0.0.1:4200/api infra/create-work-pool.sh [pool-name]
#
# Uses `prefect` from $PATH, or from .venv/bin when that exists (run from the repository root).
set -euo pipefail

POOL="${1:-longstraw-gpu}"

if [[ -z "${PREFECT_API_URL:-}" ]]; then
    echo "error: PREFECT_API_URL is not set; e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api" >&2
    echo "       (without it prefect would create the pool in a throw-away ephemeral server)" >&2
    exit 2
fi

PREFECT="prefect"
if [[ -x .venv/bin/prefect ]]; then
    PREFECT=".venv/bin/prefect"
elif ! command -v prefect >/dev/null 2>&1; then
    echo "error: prefect not found: activate the LongStraw venv (pip install -e '.[pipeline]')" >&2
    exit 2
fi

export PREFECT_SERVER_ANALYTICS_ENABLED=false

if "$PREFECT" work-pool inspect "$POOL" >/dev/null 2>&1; then
    echo "work pool '$POOL' already exists at $PREFECT_API_URL"
else
    "$PREFECT" work-pool create "$POOL" --type process
    echo "created work pool '$POOL' (type process) at $PREFECT_API_URL"
fi
echo "start a worker with: prefect worker start --pool $POOL"
