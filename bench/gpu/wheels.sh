#!/usr/bin/env bash
# Run HERE, where pip reaches PyPI, before a call of the lent GPU machine (which has no network): downloads the
# cp312 manylinux x86_64 wheels of bench/gpu/wheels.txt (what `import longstraw`, flash-linear-attention's kernels
# and the store need beyond that machine's image) into bench/gpu/wheels/ (git-ignored), without dependencies, so
# torch, triton and nvidia-* are never fetched. bench/gpu/run.sh installs them there with --no-index. Carry the
# folder: run(command="bench/gpu/run.sh", carry=["bench/gpu/wheels"]).
#
#   bench/gpu/wheels.sh                 # PYTHON=python3.12 to use another pip; DEST=dir for another folder
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
DEST=${DEST:-bench/gpu/wheels}
LIMIT_MIB=32  # the device call carries 64 MiB in all, the working tree included

rm -rf "$DEST"
mkdir -p "$DEST"
# pip matches a --platform tag exactly, so name every manylinux level a wheel may carry (the image's glibc is newer)
platforms=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    platforms+=(--platform "$p")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$DEST" -r bench/gpu/wheels.txt

# what the wheels need that the folder does not hold: it must come from the image (numpy, packaging, pyyaml:
# transformers and torch bring them); run.sh's install (with dependencies, --no-index) fails loudly where one is missing
"$PYTHON" - "$DEST" <<'EOF'
import re, sys, zipfile
from pathlib import Path

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
held = {norm(w.name.split("-")[0]) for w in wheels}
needed = set()
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                needed.add(norm(re.match(r"[A-Za-z0-9_.\-]+", line.split(":", 1)[1].strip()).group(0)))
bad = sorted(n for n in held if n in {"torch", "triton"} or n.startswith("nvidia-"))
if bad:
    sys.exit(f"wheels.sh: {bad} must not be carried: the image's torch/triton/CUDA are used")
print("wheels:", ", ".join(w.name for w in wheels))
print("needed from the image:", ", ".join(sorted(needed - held)) or "nothing")
EOF
mib=$(du -sm "$DEST" | cut -f1)
echo "$DEST: $(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1)"
if (( mib > LIMIT_MIB )); then
    echo "wheels.sh: $DEST is ${mib} MiB, over ${LIMIT_MIB} MiB: the device call carries 64 MiB in all" >&2
    exit 1
fi
