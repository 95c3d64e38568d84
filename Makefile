# Two commands: `make run` and `make test`. Both create .venv and install what is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel of this torch lies on the dev/CI machines; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# DeepSpeed (optim.offload: its CPU Adam) from its sdist, built against the torch above (no build isolation, which
# would fetch another torch); its ops compile at first use (JIT, g++ and ninja), cached in .venv/torch_extensions.
DEEPSPEED_PIN ?= deepspeed>=0.19,<0.20

.PHONY: run test install browser bench clean fla-interp docs

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e ".[pipeline,dev,offload,docs]"
	$(PY) -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation "$(DEEPSPEED_PIN)"
	$(PY) -c "from longstraw.train.offload import build_cpu_adam; print('DeepSpeed CPU Adam op in', build_cpu_adam())" \
		|| echo "note: DeepSpeed's CPU Adam did not build now; optim.offload builds it at first use"
	touch $(STAMP)

install: $(STAMP)

# The lowest torch we support (pyproject: torch>=2.11), in a second environment: `make test` runs the distributed,
# ops and engine suites there too, where newer torch APIs meet fallbacks: every test, and of a parametrized one the
# cases that hold each parameter value once (--each-value-once, tests/conftest.py; the full products run above).
# PyPI's torch 2.11 is its CUDA build (no CPU wheel there; it runs on the CPU); its triton goes, since with triton
# importable transformers' Qwen3.5 reference crashes on CPU. torch and the project resolve in one pip call, so
# nothing lifts torch past the pin.
OLDEST_TORCH ?= torch==2.11.0
OLDEST_VENV := .venv-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed

$(OLDEST_STAMP): pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q "$(OLDEST_TORCH)" -e ".[dev]"
	$(OLDEST_PY) -m pip uninstall -q -y triton
	touch $(OLDEST_STAMP)

# triton and flash-linear-attention for tests/ops/test_fla_interpreter.py, which runs FLA's gated delta rule kernels on
# CPU under Triton's interpreter in a subprocess with this folder on PYTHONPATH; never in .venv itself (with triton
# importable, transformers' Qwen3.5 reference breaks on CPU). triton as on the GPU machines; ~660 MB.
FLA_INTERP := $(VENV)/fla-interp
FLA_INTERP_PINS ?= triton==3.6.0 fla-core==0.6.0 einops==0.8.2

$(FLA_INTERP)/.installed: | $(STAMP)
	rm -rf $(FLA_INTERP)
	$(PY) -m pip install -q --no-deps --target $(FLA_INTERP) $(FLA_INTERP_PINS)
	touch $@

fla-interp: $(FLA_INTERP)/.installed

# The tiny model is warm-started once (runs/sft-tiny, a few minutes); each `make run` then trains it with GRPO in
# a fresh run directory. PREFECT_HOME stays inside the project: the embedded Prefect needs no server.
SFT_CKPT := runs/sft-tiny/model.safetensors
export PREFECT_HOME ?= $(CURDIR)/runs/prefect-home
export PREFECT_SERVER_ANALYTICS_ENABLED = false

$(SFT_CKPT): configs/sft-tiny.yaml | $(STAMP)
	$(VENV)/bin/longstraw sft --config configs/sft-tiny.yaml

run: $(STAMP) $(SFT_CKPT)
	$(VENV)/bin/longstraw train --config configs/train-tiny.yaml --run-dir runs/grpo-tiny-$$(date +%Y%m%d-%H%M%S)

# tests/flows/test_ui_browser.py drives Debian's Chromium: installed here when missing and apt-get is usable (root,
# or sudo without a password); if that fails the test skips and says why.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=no; fi; \
	  if [ "$$SUDO" = no ] || ! command -v apt-get >/dev/null; then \
	    echo "note: no chromium/chromedriver and no usable apt-get: the browser test will skip"; \
	  else \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver \
	    || { $$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } \
	    || echo "note: installing chromium chromium-driver failed: the browser test will skip"; \
	  fi; }

test: $(STAMP) $(OLDEST_STAMP) $(FLA_INTERP)/.installed browser
	$(PY) -m pytest -q --durations=25
	$(OLDEST_PY) -m pytest -q --durations=15 --each-value-once tests/parallel tests/ops tests/engine

bench: $(STAMP)
	$(PY) bench/grpo_step.py

# docs/ as a site in site/ (mkdocs, material theme; the nav in mkdocs.yml); --strict: a broken link is an error.
docs: $(STAMP)
	$(PY) -c "import mkdocs, material" 2>/dev/null || $(PY) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) $(OLDEST_VENV) *.egg-info site
