"""The library stays usable without the pipeline: importing it (and its CLI) loads neither Prefect nor MLflow."""

import subprocess
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "longstraw"


def test_library_imports_neither_prefect_nor_mlflow():
    code = ("import sys, longstraw, longstraw.cli, longstraw.train.inputs, longstraw.train.checkpoint, longstraw.store;"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'mlflow'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for path in LIBRARY.rglob("*.py"):
        text = path.read_text()
        assert "import prefect" not in text and "from prefect" not in text, path
        assert "import mlflow" not in text and "from mlflow" not in text, path
