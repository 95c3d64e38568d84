#!/usr/bin/env bash
# The prepared GPU check (issue 14), for one GPU machine, in under 8 minutes: the GPU tests that CPU CI skips,
# then bench/gpu/bench.py (parity, capture tokens/s and MFU to 2.1M tokens, one exact and one naive GRPO step,
# rollout tokens/s) within a 6.5-minute budget. Writes into $OUT (default bench/out/gpu): gpu-tests.txt,
# bench.json, table.txt, nvidia-smi.txt. Record the table in bench/RESULTS.md with the date and the GPU.
#
#   bench/gpu/run.sh                 # a torch with CUDA: .venv/bin/python if there is one, else python3
#   PY=/path/to/python bench/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/nvidia-smi.txt"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'this torch sees no CUDA GPU'; print(torch.__version__, torch.cuda.get_device_name())"
# the GPU parity tests (skipped on CPU machines): attention kernels and the Gated DeltaNet kernel vs the references
timeout 60 "$PY" -m pytest -q -p no:cacheprovider -k cuda tests/ops/test_attention.py tests/ops/test_gated_delta.py \
    2>&1 | tee "$OUT/gpu-tests.txt" || true
timeout 420 "$PY" bench/gpu/bench.py --budget-s 390 --out "$OUT/bench.json" 2>&1 | tee "$OUT/table.txt"
