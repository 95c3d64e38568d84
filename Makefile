# Two commands: `make run` and `make test`. Both create .venv and install what is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel of this torch lies on the dev/CI machines; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: run test install bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/longstraw step --config configs/tiny.yaml

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/grpo_step.py

clean:
	rm -rf $(VENV) *.egg-info
