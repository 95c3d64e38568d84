"""`longstraw train` checks its inputs, rewards and disk in the launching process (longstraw/train/preflight.py):
a bad one ends the command with exit 2 and one line naming the problem and the fix, before any Prefect server,
run lock, run directory or rank starts."""

from __future__ import annotations

import errno
import json
import os
from collections import namedtuple
from pathlib import Path

import pytest
import yaml

import flows.train
import longstraw.train.preflight as preflight_module
import longstraw.train.spmd as spmd
from flows.cli import main
from longstraw.train.config import TrainConfig
from longstraw.train.preflight import check_before_start, checkpoint_bytes
from longstraw.train.sft import save_model
from tests.conftest import tiny_config, tiny_model

NPROC = pytest.mark.parametrize("nproc", [1, 2])
MODEL = dict(vocab_size=260, max_position_embeddings=1024, num_hidden_layers=2)


def raising_reward(prompt_meta: dict, response_text: str) -> float:
    """A reward with a bug: it fails on every answer."""
    return prompt_meta["no_such_key"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """One tiny HF checkpoint directory (config.json + model.safetensors) for the whole module."""
    return save_model(tiny_model("qwen3", **MODEL), tmp_path_factory.mktemp("ckpt") / "model")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"what is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(4)))
    return path


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if a rank or the flow starts."""
    def started(*a, **kw):
        raise AssertionError("the run started although its check failed")

    monkeypatch.setattr(spmd, "launch", started)
    monkeypatch.setattr(flows.train, "grpo_train", started)


def config(run_dir: Path, **kw) -> dict:
    base = dict(model={"random": tiny_config("qwen3", **MODEL)}, prompt_tokens=256, steps=1, groups=1, responses=2,
                max_new_tokens=4, reward="tests.flows.rewards:digit_share", run_dir=str(run_dir))
    return base | kw


def refused(tmp_path: Path, capsys, cfg: dict, nproc: int) -> str:
    """Run `longstraw train` on `cfg`; assert it returned 2 with one line on stderr and wrote nothing in the run
    directory (created none, or left an existing one as it was); return that line."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir = Path(cfg["run_dir"])
    before = sorted(run_dir.rglob("*")) if run_dir.exists() else None
    code = main(["train", "--config", str(path), "--nproc", str(nproc), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""  # not even the run dir's and MLflow's addresses: nothing started
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("longstraw train: error: ")
    assert (sorted(run_dir.rglob("*")) if run_dir.exists() else None) == before
    return lines[0]


# ---- 1. the model's files -----------------------------------------------------------------------------------------

@NPROC
def test_missing_model_path(tmp_path, capsys, nothing_starts, nproc):
    line = refused(tmp_path, capsys, config(tmp_path / "run", model={"path": str(tmp_path / "nope")}), nproc)
    assert f"model.path {tmp_path / 'nope'} is not a directory" in line and "fix the path" in line


@NPROC
def test_model_without_config_or_weights(tmp_path, capsys, nothing_starts, nproc):
    (model := tmp_path / "model").mkdir()
    line = refused(tmp_path, capsys, config(tmp_path / "run", model={"path": str(model)}), nproc)
    assert "has no config.json" in line and "save_pretrained" in line
    (model / "config.json").write_text(json.dumps(tiny_config("qwen3", **MODEL)))
    line = refused(tmp_path, capsys, config(tmp_path / "run", model={"path": str(model)}), nproc)
    assert "no *.safetensors" in line and "save_pretrained" in line
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-1-of-2.safetensors"}}))
    line = refused(tmp_path, capsys, config(tmp_path / "run", model={"path": str(model)}), nproc)
    assert "names shards that are missing" in line and "copy all of the checkpoint's shards" in line


def test_model_tokenizer_missing(tmp_path, capsys, nothing_starts, checkpoint):
    cfg = config(tmp_path / "run", model={"path": str(checkpoint)}, tokenizer=str(checkpoint))
    line = refused(tmp_path, capsys, cfg, 2)
    assert "has no tokenizer.json" in line and "set `tokenizer`" in line


# ---- 2. the tokenizer against the model (inputs.preflight) --------------------------------------------------------

@NPROC
def test_vocab_too_small(tmp_path, capsys, nothing_starts, nproc):
    cfg = config(tmp_path / "run", model={"random": tiny_config("qwen3", **(MODEL | {"vocab_size": 100}))})
    line = refused(tmp_path, capsys, cfg, nproc)
    assert "outside the vocabulary (0..99)" in line and "use the tokenizer that belongs to the model" in line


def test_stop_token_of_several_tokens(tmp_path, capsys, nothing_starts):
    # the byte tokenizer has no <|im_end|> token: its text is 10 bytes, which would never end an answer
    line = refused(tmp_path, capsys, config(tmp_path / "run", stop_tokens=["<|im_end|>"]), 1)
    assert "stop_tokens: '<|im_end|>' is 10 tokens of ByteTokenizer(), not one" in line and "single tokens" in line


# ---- 3. every dataset line ----------------------------------------------------------------------------------------

@NPROC
def test_malformed_dataset_line(tmp_path, capsys, nothing_starts, nproc):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": 2,}\n')
    line = refused(tmp_path, capsys, config(tmp_path / "run", task=None, dataset=str(data)), nproc)
    assert f"{data}, line 3: bad JSON" in line and "at column 29" in line and "each line must be" in line


@NPROC
def test_dataset_line_past_positions(tmp_path, capsys, nothing_starts, nproc):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "short", "answer": "1"}) + "\n"
                    + json.dumps({"prompt": "x" * 2000, "answer": "2"}) + "\n")
    line = refused(tmp_path, capsys, config(tmp_path / "run", task=None, dataset=str(data)), nproc)
    assert f"{data}, line 2: a prompt of" in line and "exceeds the model's 1,024 positions" in line
    assert "shorten that prompt" in line


def test_missing_dataset(tmp_path, capsys, nothing_starts):
    line = refused(tmp_path, capsys, config(tmp_path / "run", task=None, dataset=str(tmp_path / "no.jsonl")), 1)
    assert "is not a file" in line and "fix the path" in line


# ---- 4. the rewards -----------------------------------------------------------------------------------------------

@NPROC
def test_reward_module_not_found(tmp_path, capsys, nothing_starts, nproc):
    line = refused(tmp_path, capsys, config(tmp_path / "run", reward="no_such_rewards:score"), nproc)
    assert "no module named 'no_such_rewards'" in line
    assert "does not search the current directory" in line and "PYTHONPATH" in line


@NPROC
def test_reward_raises_on_an_example(tmp_path, capsys, nothing_starts, dataset, nproc):
    cfg = config(tmp_path / "run", task=None, dataset=str(dataset), reward="tests.flows.test_preflight:raising_reward")
    line = refused(tmp_path, capsys, cfg, nproc)
    assert "raised KeyError on the first example" in line and "fix the function" in line


# ---- 5. a writable run directory ----------------------------------------------------------------------------------

@NPROC
@pytest.mark.parametrize("code, fix", [(errno.EROFS, "read-only file system"), (errno.EACCES, "no permission")])
def test_run_dir_not_writable(tmp_path, capsys, monkeypatch, nothing_starts, nproc, code, fix):
    probed = []

    def probe(directory):  # as root chmod stops no write: the OSError a read-only mount would raise
        probed.append(directory)
        raise OSError(code, os.strerror(code), str(directory))

    monkeypatch.setattr(preflight_module, "_probe", probe)
    line = refused(tmp_path, capsys, config(tmp_path / "runs" / "a" / "run"), nproc)
    assert probed == [tmp_path]  # the nearest directory that exists
    assert f"run_dir {tmp_path / 'runs' / 'a' / 'run'} cannot be written ({tmp_path})" in line and fix in line


# ---- 6. free disk for a checkpoint --------------------------------------------------------------------------------

@NPROC
def test_disk_too_small(tmp_path, capsys, monkeypatch, nothing_starts, nproc):
    (run_dir := tmp_path / "run").mkdir()
    (run_dir / "notes.txt").write_text("an earlier run's")  # an existing run dir is left as it was
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight_module.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    cfg = config(run_dir)
    line = refused(tmp_path, capsys, cfg, nproc)
    need = checkpoint_bytes(TrainConfig.model_validate(cfg))
    assert f"a checkpoint needs about 1.1 MiB ({need:,} bytes)" in line and "has 1000 B (1,000 bytes) free" in line
    assert "free some space" in line


# ---- a valid run passes ----------------------------------------------------------------------------------------------

def test_valid_config_passes(tmp_path, checkpoint, dataset):
    cfg = TrainConfig.model_validate(config(tmp_path / "run", model={"path": str(checkpoint)}, task=None,
                                            dataset=str(dataset), pipeline={"nproc": 2}))
    check_before_start(cfg)
    assert not (tmp_path / "run").exists()
    assert list(tmp_path.iterdir()) == []  # no probe file left behind either
    # weights and two AdamW moments in float32
    assert checkpoint_bytes(cfg) == 3 * 4 * sum(p.numel() for p in tiny_model("qwen3", **MODEL).parameters())
