"""`TrainConfig`: one YAML file describes a GRPO training run (model, data, sampling, loss, optimizer, pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config import DType, ModelSpec
from ..grpo import GRPOConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # `lr: .inf` must not validate


class OptimConfig(_Strict):
    """AdamW with global grad-norm clipping and a warm-up + decay schedule, stepped once per update."""

    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; null: no clipping")
    warmup_updates: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr / lr for linear and cosine decay")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="what is sharded over the torch.distributed world: 0 nothing; 1 the AdamW moments (torch's "
        "ZeroRedundancyOptimizer); 2 also the gradients, 3 also the parameters (FSDP2, longstraw.parallel."
        "shard_model; 2 keeps a layer's weights gathered from its forward to its backward)")


class StoreConfig(_Strict):
    url: str | None = Field(None, description="fsspec URL of the zarr store (prefix states under states/, rollouts "
                            "under rollouts/); default: <run_dir>/store")
    storage_options: dict = Field(default_factory=dict, description="fsspec options, e.g. s3 credentials")
    shard_tokens: int = Field(65536, ge=1, description="tokens per zarr shard (one writer per shard)")


class PipelineConfig(_Strict):
    replay_concurrency: int = Field(2, ge=1, description="replay tasks run at once (threads of this process)")
    branches_per_task: int = Field(1, ge=1, description="branches one replay task replays")
    retries: int = Field(2, ge=0, description="retries of a stage on a transient error")
    retry_delay_seconds: float = Field(2.0, ge=0, description="first retry delay; doubles each retry")
    keep_gradients: bool = Field(False, description="keep the per-task gradient files once the checkpoint they "
                                 "went into is committed (they are as large as the model, per task)")


class TrackingConfig(_Strict):
    uri: str | None = Field(None, description="MLflow tracking URI; default: sqlite:///<run_dir>/mlflow.db")
    experiment: str = "longstraw"


class ScheduleConfig(_Strict):
    deployment: str = "nightly"
    cron: str = "0 2 * * *"
    timezone: str = "UTC"


class TrainConfig(_Strict):
    """A GRPO run: `steps` steps of `groups` prompts x `responses` sampled answers each."""

    model: ModelSpec
    dtype: DType = "float32"
    tokenizer: str = Field("byte", description="'byte' (built-in) or a directory with tokenizer.json")
    task: str | None = Field("kv-retrieval", description="built-in task name; or set `dataset`")
    task_options: dict = Field(default_factory=dict, description="extra options of the task generator")
    dataset: str | None = Field(None, description="JSONL of {prompt, answer, meta} (instead of a task)")
    prompt_tokens: int = Field(256, ge=16, description="length of generated task prompts")
    task_pool: int | None = Field(None, ge=1, description="cycle through this many generated prompts (a fixed "
                                  "training set); default: a new prompt for every group of every step")
    steps: int = Field(4, ge=1)
    groups: int = Field(2, ge=1, description="prompts per step (one GRPO group each)")
    responses: int = Field(8, ge=2, description="G: sampled answers per prompt")
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    reward: str | None = Field(None, description="reward name or module:function; default: the task's verifier")
    mode: Literal["naive", "detached", "exact"] = "exact"
    epochs: int = Field(1, ge=1, description="optimizer updates per rollout (>1: off-policy, clipping active)")
    scale_advantages: bool = Field(True, description="divide advantages by the group's std (Dr. GRPO: false)")
    grpo: GRPOConfig = GRPOConfig()
    optim: OptimConfig = OptimConfig()
    seed: int = 0
    threads: int | None = Field(None, ge=1, description="torch CPU threads")
    run_dir: str = "runs/grpo"
    store: StoreConfig = StoreConfig()
    pipeline: PipelineConfig = PipelineConfig()
    tracking: TrackingConfig = TrackingConfig()
    schedule: ScheduleConfig = ScheduleConfig()

    @model_validator(mode="after")
    def _source(self) -> "TrainConfig":
        if (self.task is None) == (self.dataset is None):
            raise ValueError("set exactly one of `task` (a built-in task) or `dataset` (a JSONL file)")
        if self.dataset is not None and self.reward is None:
            raise ValueError("a dataset needs a `reward` (e.g. exact_match, number_match or module:function)")
        return self

    @property
    def updates(self) -> int:
        return self.steps * self.epochs

    def paths(self) -> "RunPaths":
        return RunPaths(Path(self.run_dir), self.store.url)


class RunPaths:
    """Where a run keeps its files: under one directory, the store there too unless `store.url` points elsewhere."""

    def __init__(self, root: Path, store_url: str | None = None):
        self.root = root
        self.store_url = (store_url or str(root / "store")).rstrip("/")

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, update: int) -> Path:
        return self.checkpoints / f"update-{update:06d}"

    def step(self, step: int) -> Path:
        return self.root / "steps" / f"step-{step:06d}"

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.root.resolve() / 'mlflow.db'}"
