"""Checksum throughput for the stored artefacts: sha256 (what the store and checkpoints use) against crc32c
(google-crc32c, the library behind zarr's crc32c codec), zlib's crc32 and blake2b, one core, streamed in 1 MiB
blocks as files are hashed.

    .venv/bin/python bench/hashes.py [--mib 512] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import zlib
from pathlib import Path

import google_crc32c


def _sha256(blocks):
    h = hashlib.sha256()
    for b in blocks:
        h.update(b)
    return h.hexdigest()


def _blake2b(blocks):
    h = hashlib.blake2b()
    for b in blocks:
        h.update(b)
    return h.hexdigest()


def _crc32c(blocks):
    c = 0
    for b in blocks:
        c = google_crc32c.extend(c, b)
    return c


def _crc32(blocks):
    c = 0
    for b in blocks:
        c = zlib.crc32(b, c)
    return c


HASHES = {"sha256": _sha256, "blake2b": _blake2b, "crc32c": _crc32c, "zlib crc32": _crc32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench/out/hashes.json")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 MiB, once (tests/bench/test_smokes.py)")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.repeat = 4, 1
    data = os.urandom(args.mib << 20)
    blocks = [data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)]  # bytes: what file reads give
    rows = {}
    for name, fn in HASHES.items():
        best = min(_timed(fn, blocks) for _ in range(args.repeat))
        rows[name] = {"seconds": best, "gb_per_s": len(data) / best / 1e9}
    base = rows["sha256"]["gb_per_s"]
    print(f"{args.mib} MiB in 1 MiB blocks, best of {args.repeat}, one core (crc32c accelerated: "
          f"{google_crc32c.implementation})")
    print(f"{'hash':<12} {'GB/s':>7} {'vs sha256':>10} {'54 GB checkpoint (s)':>21} {'138 GB state (s)':>17}")
    for name, r in rows.items():
        print(f"{name:<12} {r['gb_per_s']:>7.2f} {r['gb_per_s'] / base:>10.1f} {54 / r['gb_per_s']:>21.1f} "
              f"{137.8 / r['gb_per_s']:>17.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def _timed(fn, blocks) -> float:
    t0 = time.perf_counter()
    fn(blocks)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
