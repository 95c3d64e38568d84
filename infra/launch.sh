#!/usr/bin/env bash
# Launch a LongStraw command on a GPU machine under torchrun.
#
#   infra/launch.sh [--nproc N] [--nnodes M --node-rank I --rdzv-endpoint HOST:PORT] [--deepspeed ds_config.json]
#                   [--module M] [--dry-run] -- <longstraw args...>
#
#   infra/launch.sh --nproc 1 -- train --config configs/train-tiny.yaml
#   infra/launch.sh --nproc 2 --deepspeed infra/deepspeed/zero2.json -- train --config configs/train-tiny.yaml
#   infra/launch.sh --nproc 8 --nnodes 4 --node-rank 1 --rdzv-endpoint node0:29500 -- train --config X.yaml
#
# runs   torchrun --standalone --nproc-per-node N -m flows.cli <args...>
#        with --nnodes M > 1 (on every node, each with its own --node-rank):
#        torchrun --nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID --nproc-per-node N
#                 -m flows.cli <args...> --nnodes M --node-rank I --rdzv-endpoint HOST:PORT
#        (the placement is also given to train / resume, whose ranks name their node in errors; torchrun's c10d
#        rendezvous numbers the nodes itself; ID is $LONGSTRAW_RDZV_ID, else $SLURM_JOB_ID, else "longstraw")
#        with --deepspeed: the same, with LONGSTRAW_DEEPSPEED_CONFIG=<absolute path of ds_config.json> exported
#
# N is per node here (this machine's GPUs); `longstraw train --nproc` counts the ranks of all nodes.
#
# N defaults to the number of visible GPUs: the entries of CUDA_VISIBLE_DEVICES when it is set, else the lines of
# `nvidia-smi -L`; 1 when there is no GPU. `flows.cli` is the module behind the installed `longstraw` command
# (library commands step/state-size/sft plus the pipeline's train/resume/serve/ui); --module longstraw.cli runs
# the library commands only.
#
# STATUS: under N > 1 ranks, `step` runs sharded: the prefix state split over the ranks as sequence-parallel
# groups (longstraw/parallel/), the one-process gradient on every rank; e.g.
#   infra/launch.sh --nproc 8 -- step --config configs/tiny.yaml
# `train` and `resume` under N > 1 become the ranks of one run (rank 0 drives; the world size is pipeline.nproc);
# `sft` runs on one process. --deepspeed ds.json (train, resume, serve only) is read by those commands
# (longstraw/train/ds_config.py): zero_optimization.stage, .offload_optimizer.device / .nvme_path, bf16.enabled,
# the AdamW optimizer's params and gradient_clipping override the run config (the command line's options override
# both); DeepSpeed's engine-tuning fields are ignored with a warning, and any other field is refused with the
# LongStraw option to use instead. DeepSpeed's engine does not run: ZeRO-1 is torch's ZeroRedundancyOptimizer (or
# LongStraw's partition with mixed precision / offload), ZeRO-2/3 FSDP2, and optimizer offload DeepSpeed's CPU Adam
# (docs/precision.md).
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

die() {
    echo "error: $*" >&2
    echo "usage: infra/launch.sh [--nproc N] [--nnodes M --node-rank I --rdzv-endpoint HOST:PORT] [--deepspeed ds_config.json] [--module M] [--dry-run] -- <longstraw args...>" >&2
    echo "       (infra/launch.sh --help for details)" >&2
    exit 2
}

visible_gpus() {
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        # "" or "-1" hide every GPU; otherwise a comma-separated list
        if [[ -z "$CUDA_VISIBLE_DEVICES" || "$CUDA_VISIBLE_DEVICES" == "-1" ]]; then
            echo 0
        else
            awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES"
        fi
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

NPROC=""
NNODES=1
NODE_RANK=""
RDZV_ENDPOINT=""
DS_CONFIG=""
MODULE="${LONGSTRAW_MODULE:-flows.cli}"
DRY_RUN=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --nproc) [[ $# -ge 2 ]] || die "--nproc needs a number"; NPROC="$2"; shift 2 ;;
        --nproc=*) NPROC="${1#*=}"; shift ;;
        --nnodes) [[ $# -ge 2 ]] || die "--nnodes needs a number"; NNODES="$2"; shift 2 ;;
        --nnodes=*) NNODES="${1#*=}"; shift ;;
        --node-rank) [[ $# -ge 2 ]] || die "--node-rank needs a number"; NODE_RANK="$2"; shift 2 ;;
        --node-rank=*) NODE_RANK="${1#*=}"; shift ;;
        --rdzv-endpoint) [[ $# -ge 2 ]] || die "--rdzv-endpoint needs HOST:PORT"; RDZV_ENDPOINT="$2"; shift 2 ;;
        --rdzv-endpoint=*) RDZV_ENDPOINT="${1#*=}"; shift ;;
        --deepspeed) [[ $# -ge 2 ]] || die "--deepspeed needs a config file"; DS_CONFIG="$2"; shift 2 ;;
        --deepspeed=*) DS_CONFIG="${1#*=}"; shift ;;
        --module) [[ $# -ge 2 ]] || die "--module needs a module name"; MODULE="$2"; shift 2 ;;
        --module=*) MODULE="${1#*=}"; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --) shift; break ;;
        *) die "unknown option '$1' (put the longstraw command after --)" ;;
    esac
done
[[ $# -gt 0 ]] || die "no longstraw command given after --"

if [[ -z "$NPROC" ]]; then
    NPROC="$(visible_gpus)"
    if [[ "$NPROC" -lt 1 ]]; then
        echo "note: no visible GPU; running 1 process" >&2
        NPROC=1
    fi
fi
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "--nproc must be a positive integer, got '$NPROC'"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "--nnodes must be a positive integer, got '$NNODES'"
WHERE=(--standalone)
PLACEMENT=()
if [[ "$NNODES" -gt 1 ]]; then
    [[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] \
        || die "--nnodes $NNODES needs --node-rank 0..$((NNODES - 1)) (this node's), got '$NODE_RANK'"
    [[ "$RDZV_ENDPOINT" =~ ^[^:]+:[0-9]+$ ]] \
        || die "--nnodes $NNODES needs --rdzv-endpoint HOST:PORT, the same on every node (e.g. node 0's host:29500)"
    WHERE=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT"
           --rdzv-id "${LONGSTRAW_RDZV_ID:-${SLURM_JOB_ID:-longstraw}}")
    case "$1" in
        train|resume) PLACEMENT=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-endpoint "$RDZV_ENDPOINT") ;;
    esac
elif [[ -n "$NODE_RANK$RDZV_ENDPOINT" ]]; then
    die "--node-rank and --rdzv-endpoint are for several nodes; give --nnodes too"
fi


# prefer the repository's venv when run from its root
BIN=""
if [[ -x .venv/bin/python ]]; then
    BIN=".venv/bin/"
fi

if [[ -n "$DS_CONFIG" ]]; then
    [[ -f "$DS_CONFIG" ]] || die "DeepSpeed config '$DS_CONFIG' not found"
    case "$1" in
        train|resume|serve) ;;
        *) die "--deepspeed configures the optimizer of train, resume and serve; '$1' has none" ;;
    esac
    LONGSTRAW_DEEPSPEED_CONFIG="$(cd "$(dirname "$DS_CONFIG")" && pwd)/$(basename "$DS_CONFIG")"
    export LONGSTRAW_DEEPSPEED_CONFIG
fi
CMD=("${BIN}torchrun" "${WHERE[@]}" --nproc-per-node "$NPROC" -m "$MODULE" "$@" ${PLACEMENT[@]+"${PLACEMENT[@]}"})
if [[ -n "$BIN" && ! -x "${BIN}torchrun" ]]; then CMD[0]="torchrun"; fi

if [[ "$DRY_RUN" -eq 1 ]]; then
    if [[ -n "$DS_CONFIG" ]]; then printf 'LONGSTRAW_DEEPSPEED_CONFIG=%q ' "$LONGSTRAW_DEEPSPEED_CONFIG"; fi
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
command -v "${CMD[0]}" >/dev/null 2>&1 || die "'${CMD[0]}' not found (make install)"
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
exec "${CMD[@]}"
