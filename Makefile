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
	$(PY) -m pip install -q -e ".[pipeline,dev]"
	touch $(STAMP)

install: $(STAMP)

# The tiny model is warm-started once (runs/sft-tiny, a few minutes); each `make run` then trains it with GRPO in
# a fresh run directory. PREFECT_HOME stays inside the project: the embedded Prefect needs no server.
SFT_CKPT := runs/sft-tiny/model.safetensors
export PREFECT_HOME ?= $(CURDIR)/runs/prefect-home
export PREFECT_SERVER_ANALYTICS_ENABLED = false

$(SFT_CKPT): configs/sft-tiny.yaml | $(STAMP)
	$(VENV)/bin/longstraw sft --config configs/sft-tiny.yaml

run: $(STAMP) $(SFT_CKPT)
	$(VENV)/bin/longstraw train --config configs/train-tiny.yaml --run-dir runs/grpo-tiny-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/grpo_step.py

clean:
	rm -rf $(VENV) *.egg-info
