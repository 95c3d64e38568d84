"""Run configs (YAML), validated by pydantic before anything runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, TypeVar

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .engine import EngineConfig
from .grpo import GRPOConfig

DType = Literal["float32", "bfloat16", "float16", "float64"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                                  "float64": torch.float64}
SHORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
C = TypeVar("C", bound=BaseModel)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config's dtype name (float32, bfloat16, ... or fp32, bf16, ...)."""
    full = SHORT_DTYPES.get(name, name)
    if full not in DTYPES:
        raise ValueError(f"dtype {name!r} unknown; use one of {sorted([*DTYPES, *SHORT_DTYPES])}")
    return DTYPES[full]


class RopeScaling(BaseModel):
    """RoPE scaling as HF writes `rope_scaling`, merged into the model's config.json (not edited) when it is
    loaded: the model then accepts original_max_position_embeddings x factor positions."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # the type's other keys: beta_fast, mscale, ...

    rope_type: Literal["linear", "llama3", "yarn"]
    factor: float = Field(gt=1, description="how many times the original positions the model accepts")
    original_max_position_embeddings: int | None = Field(
        None, gt=0, description="the positions the checkpoint was trained on; default: the config's own "
        "original_max_position_embeddings, else its max_position_embeddings")

    @model_validator(mode="before")
    @classmethod
    def _type(cls, data):
        if isinstance(data, dict) and "type" in data:  # the older spelling of rope_type
            data = {k: v for k, v in data.items() if k != "type"} | {"rope_type": data.get("rope_type", data["type"])}
        return data


def parse_rope_scaling(text: str) -> dict:
    """`--rope-scaling TYPE:FACTOR` (e.g. yarn:8) as a rope_scaling dict, validated."""
    kind, _, factor = text.partition(":")
    try:
        return RopeScaling(rope_type=kind, factor=factor).model_dump(exclude_none=True)
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"--rope-scaling {text!r}: expected TYPE:FACTOR with TYPE one of linear, llama3, yarn and "
                         f"FACTOR > 1, e.g. yarn:8 ({why})") from None


class ModelSpec(BaseModel):
    """Either an HF checkpoint directory (`path`) or a transformers config dict for a random model (`random`);
    `rope_scaling` extends its positions without editing its config."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    path: str | None = None
    random: dict | None = None
    rope_scaling: RopeScaling | None = Field(None, description="RoPE scaling merged into the model's config, e.g. "
                                             "{rope_type: yarn, factor: 8}")

    @property
    def rope_override(self) -> dict | None:
        """`rope_scaling` as the dict `load_model(..., rope_scaling=)` and `with_rope_scaling` take."""
        return None if self.rope_scaling is None else self.rope_scaling.model_dump(exclude_none=True)

    def hf_config(self) -> dict:
        """The transformers config dict of the model, `rope_scaling` merged in."""
        from .models import read_config, with_rope_scaling

        return with_rope_scaling(read_config(self.path) if self.path else self.random, self.rope_override)

    def load(self, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """The model: the checkpoint's weights, or random ones (the current torch seed)."""
        from .models import build_model, load_model

        if self.path:
            return load_model(self.path, dtype=dtype, device=device, rope_scaling=self.rope_override)
        return build_model(self.hf_config(), dtype, device)

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        if (self.path is None) == (self.random is None):
            raise ValueError("model needs exactly one of `path` (HF checkpoint dir) or `random` (config dict)")
        if self.random is not None and "model_type" not in self.random:
            raise ValueError("model.random needs a model_type (e.g. qwen3)")
        return self


class StepConfig(BaseModel):
    """`longstraw step`: one GRPO step on a synthetic group per mode, to compare the modes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: ModelSpec
    dtype: DType = "float32"
    seed: int = 0
    prompt_tokens: int = Field(8192, ge=2)
    responses: int = Field(8, ge=1)
    response_tokens: tuple[int, int] = Field((16, 64), description="min and max response length")
    modes: list[Literal["naive", "detached", "exact"]] = ["naive", "detached", "exact"]
    threads: int | None = Field(None, ge=1)
    zero_stage: Literal[0, 2, 3] = Field(0, description="in the N-rank run: 2 or 3 shards the parameters and "
                                         "gradients over the ranks (FSDP2, longstraw.parallel.shard_model)")
    grpo: GRPOConfig = GRPOConfig()
    engine: EngineConfig = EngineConfig()

    @model_validator(mode="after")
    def _lengths(self) -> "StepConfig":
        lo, hi = self.response_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"response_tokens must be [min, max] with 1 <= min <= max, got {[lo, hi]}")
        return self


def with_overrides(data: dict, overrides: dict) -> dict:
    """`data` with `overrides` applied: a dict value updates the section of that name, others replace."""
    out = dict(data)
    for key, value in overrides.items():
        out[key] = {**(out.get(key) or {}), **value} if isinstance(value, dict) else value
    return out


class _Loader(yaml.SafeLoader):
    """YAML 1.1's floats need a dot (`1e-6` would be the string '1e-6', e.g. an HF config's rms_norm_eps); as in
    YAML 1.2 and JSON, an exponent alone makes a float here."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def read_yaml(path: str | Path, seen: tuple[Path, ...] = ()) -> dict:
    """A YAML config as a dict. `base: other.yaml` (relative to this file) reads that one first and applies this
    file's keys over it (a section updates the base's section of that name), so a recipe states only what differs."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} not found")
    data = yaml.load(p.read_text(), Loader=_Loader) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} holds a {type(data).__name__}, not a mapping of settings")
    base = data.pop("base", None)
    if base is None:
        return data
    parent = (p.parent / str(base)).resolve()
    if parent in seen or parent == p.resolve():
        raise ValueError(f"config file {p}: base {base!r} includes itself")
    return with_overrides(read_yaml(parent, (*seen, p.resolve())), data)


def load_config(path: str | Path, cls: type[C], overrides: dict | None = None) -> C:
    """Read a YAML file (and its `base:` chain, `read_yaml`) into `cls`, with `overrides` (e.g. from the command
    line; a dict value updates the section of that name) applied before validation; errors name the file and the
    offending field."""
    p = Path(path)
    data = with_overrides(read_yaml(p), overrides or {})
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"invalid config {p}:\n{e}") from None
