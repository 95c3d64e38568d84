"""What identifies the code that computed a result: the package version and a digest of its sources.

The pipeline's cache keys include `code_digest()`, so a resume after any change to the library recomputes what
the old code computed instead of mixing the two. Hashing the sources (~0.5 MB) takes milliseconds, once per
process.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def package_version() -> str:
    try:
        return version("longstraw")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


def source_digest(root: Path) -> str:
    """sha256 over the relative paths and contents of every .py file under `root`, in sorted order."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1)
def code_digest() -> str:
    """`<version>+<first 16 hex digits of the sources' digest>` of the installed library."""
    return f"{package_version()}+{source_digest(PACKAGE)[:16]}"
