#!/usr/bin/env bash
# The prepared GPU check (issues 14, 36), for the lent machine (one H100 or H200, no network), in under 8 minutes:
#   1. installs what its image lacks from bench/gpu/wheels/ (pip --no-index; only what is missing, never torch);
#   2. prints the environment (bench/gpu/env.py) and stops with one line if `import longstraw` fails or
#      flash-linear-attention's kernel is missing;
#   3. the GPU tests (`pytest -k cuda tests/ops`, with IEEE fp32 dots in Triton); a skip on a GPU is reported as
#      a failure, not passed over;
#   4. bench/gpu/bench.py in the time left, every row written as soon as it is measured.
# Everything lands under $OUT (the device tool's folder; default bench/out/gpu): run.log (all output), env.json,
# nvidia-smi.txt, gpu-tests.txt, rows.jsonl and table.txt. Record the table in bench/RESULTS.md with the date and
# the card.
#
#   bench/gpu/wheels.sh                 # HERE first, where pip reaches PyPI (downloads bench/gpu/wheels/)
#   device run: command "bench/gpu/run.sh", carry ["bench/gpu/wheels"], timeout_s 540
#   bench/gpu/run.sh --dry-run          # the whole thing on the CPU with a tiny model (wheels not installed)
#
# Settings (environment): PY (the python; default .venv/bin/python if there is one, else python3), RUN_S (the
# whole run's seconds, default 480), GPU_TESTS=0 (skip step 3), INSTALL_WHEELS=1 (step 1 on a dry run too: never
# with the project's .venv, which must not get flash-linear-attention).
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: bench/gpu/run.sh [--dry-run]" >&2; exit 2 ;;
esac
PY=${PY:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-bench/out/gpu}
RUN_S=${RUN_S:-480}
WHEELS=bench/gpu/wheels
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
dry_flag=$( (( DRY )) && echo --dry-run )

install_wheels() {
    if [[ "$("$PY" -c 'import sys; print(sys.prefix)')" -ef .venv ]]; then
        # flash-linear-attention's triton breaks transformers' Qwen3.5 reference on the CPU (the tests' oracle)
        echo "install: skipped, $PY is the project's .venv, which never gets flash-linear-attention"
        return 0
    fi
    if [[ ! -d $WHEELS ]]; then
        echo "install: no $WHEELS here, nothing installed (run bench/gpu/wheels.sh where pip works, carry the folder)"
        return 0
    fi
    # the names alone: a package the image already has stays as it is (torch is never among them)
    local names
    names=$(sed -e 's/#.*//' -e 's/[=<>!~ ].*//' bench/gpu/wheels.txt | grep -v '^$' | tr '\n' ' ')
    echo "install: $names from $WHEELS (--no-index)"
    if ! "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-compile --disable-pip-version-check \
            $names; then
        # an environment pip may not write to: beside it, on PYTHONPATH
        echo "install: pip could not install into $("$PY" -c 'import sys; print(sys.prefix)'); trying --target"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/longstraw-site "$WHEELS"/*.whl \
            || return 1
        export PYTHONPATH=/tmp/longstraw-site${PYTHONPATH:+:$PYTHONPATH}
    fi
}

main() {
    local start=$SECONDS status=0
    echo "== bench/gpu/run.sh${dry_flag:+ $dry_flag}: $(date -u '+%F %T UTC'), python $PY, out $OUT, $RUN_S s"
    if (( ! DRY )) || [[ ${INSTALL_WHEELS:-0} == 1 ]]; then
        install_wheels || { echo "STOP: installing the wheels from $WHEELS failed (see above)"; return 6; }
    else
        echo "install: skipped on a dry run (INSTALL_WHEELS=1 to do it)"
    fi
    if (( ! DRY )); then
        nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/nvidia-smi.txt"
    fi

    echo "== environment"
    timeout 180 "$PY" bench/gpu/env.py --out "$OUT/env.json" $dry_flag
    local rc=$?
    if (( rc )); then
        (( rc == 124 )) && echo "STOP: bench/gpu/env.py ran past 180 s"
        return $rc
    fi

    if [[ ${GPU_TESTS:-1} != 0 ]]; then
        echo "== GPU tests (pytest -k cuda tests/ops; TRITON_F32_DEFAULT=ieee: fp32 dots are IEEE, not TF32)"
        # the first use of flash-linear-attention compiles and autotunes its Triton kernels: a minute or two
        TRITON_F32_DEFAULT=ieee timeout $(( DRY ? 300 : 200 )) "$PY" -m pytest -q -p no:cacheprovider -rs -k cuda \
            tests/ops > "$OUT/gpu-tests.txt" 2>&1
        rc=$?
        cat "$OUT/gpu-tests.txt"
        local skipped
        skipped=$(grep -c '^SKIPPED' "$OUT/gpu-tests.txt")
        if (( rc == 124 )); then
            echo "GPU TESTS: ran past their timeout"; status=1
        elif (( rc )); then
            echo "GPU TESTS: FAILED (pytest exit $rc)"; status=1
        elif (( ! DRY && skipped )); then
            echo "GPU TESTS: $skipped skip reason(s) on a GPU machine: every CUDA test must run here"; status=1
        else
            echo "GPU TESTS: passed"
        fi
    else
        echo "== GPU tests: skipped (GPU_TESTS=0)"
    fi

    # the bench gets what is left of RUN_S, less a margin for its last row and this script's end
    local budget=$(( RUN_S - (SECONDS - start) - 25 ))
    (( budget < 60 )) && budget=60
    (( DRY )) && budget=120
    echo "== bench (budget ${budget} s)"
    timeout $(( budget + 40 )) "$PY" bench/gpu/bench.py --budget-s "$budget" --out "$OUT" $dry_flag
    rc=$?
    if (( rc == 124 )); then
        echo "BENCH: ran past its timeout; its rows so far are in $OUT/rows.jsonl and $OUT/table.txt"; status=1
    elif (( rc )); then
        echo "BENCH: exited $rc; its rows so far are in $OUT/rows.jsonl and $OUT/table.txt"; status=1
    fi
    if grep -q "FAIL\|ERROR" "$OUT/table.txt" 2>/dev/null; then
        echo "BENCH: a row failed (FAIL or ERROR above)"; status=1
    fi
    echo "== done in $(( SECONDS - start )) s: $OUT/table.txt"
    return $status
}

main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
