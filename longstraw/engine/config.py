"""`EngineConfig`: how the engine runs a GRPO group (time and memory), apart from the loss (`GRPOConfig`). None of
its settings changes the gradient."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_CHUNK = 2048


PromptOrder = Literal["auto", "chunks", "layers"]


class EngineConfig(BaseModel):
    """Integers are strict: `boundary_every: true` is an error, not 1."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    prompt_chunk: int = Field(DEFAULT_CHUNK, ge=1, strict=True, description="tokens per prompt chunk in capture and the exact "
                              "prompt backward")
    branch_batch: int = Field(1, ge=1, strict=True, description="branches replayed together (right-padded)")
    prompt_graph_budget: int | None = Field(
        None, ge=0, strict=True, description="bytes of prompt-chunk autograd graphs exact mode keeps from capture instead of "
        "recomputing those chunks in the prompt backward; default: a quarter of free memory")
    boundary_every: int | None = Field(
        None, ge=1, strict=True, description="exact mode with recurrent layers: keep their state at every k-th prompt-chunk "
        "start and regenerate the others during the prompt backward; default: every one if they fit an eighth of "
        "free memory, else k = ceil(sqrt(chunks)) (sharded: of the chunks one rank owns); engine/policy.py")
    prompt_order: PromptOrder = Field(
        "auto", description="how capture and the exact prompt backward walk the prompt: 'chunks' (every layer per "
        "chunk), 'layers' (every chunk per layer: each ZeRO-3 layer gathered once per pass, for two more prompt "
        "forwards and about 2 sqrt(layers) hidden states of the rank's tokens kept); auto: 'layers' under ZeRO-3")
    checkpoint_layers: bool | None = Field(
        None, strict=True, description="per-layer activation checkpointing of the prompt chunks and branches run "
        "with autograd: each layer keeps its input and runs again in the backward, so a chunk or branch holds one "
        "layer's activations at a time (one more forward of it); default: on when a whole chunk's (or branch "
        "batch's) activations would take more than a quarter of free memory")
    head_chunk: int | None = Field(
        None, ge=1, strict=True, description="tokens (all rows' positions together) per chunk of the LM head and "
        "log-softmax in branch replay and naive mode; a chunk's logits are recomputed in the backward, so those of "
        "all tokens never exist at once; default: 2**26 // vocab (256 MiB of fp32 logits a chunk)")


def check_engine(engine: object, op: str) -> EngineConfig:
    """`engine` if it is an EngineConfig; a clear TypeError otherwise (an int used to stand for a prompt chunk)."""
    if isinstance(engine, EngineConfig):
        return engine
    hint = f"EngineConfig(prompt_chunk={engine})" if isinstance(engine, int) else "EngineConfig(...)"
    raise TypeError(f"{op}'s engine must be an EngineConfig, got {type(engine).__name__} {engine!r}: pass {hint}")
