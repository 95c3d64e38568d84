#!/usr/bin/env bash
# The command of a Prefect process work pool's flow runs on a Slurm login node: the flow run becomes a run on
# several machines (longstraw.sbatch; sbatch options may follow). Every node runs `longstraw resume <flow run id>`,
# which reads the flow run's `config` from the Prefect API (PREFECT_API_URL, exported to the nodes by sbatch).
set -euo pipefail
: "${PREFECT__FLOW_RUN_ID:?is set by the Prefect worker for the flow run it starts}"
exec sbatch --wait "$@" "$(dirname "$0")/longstraw.sbatch" resume "$PREFECT__FLOW_RUN_ID"
