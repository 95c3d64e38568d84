"""`TrainConfig`: one YAML file describes a GRPO training run (model, data, sampling, loss, optimizer, pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..config import DType, ModelSpec
from ..engine import EngineConfig
from ..grpo import GRPOConfig
from ..sampler import NativeSampler, check_backend
from .device import check_device_setting


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
        "ZeroRedundancyOptimizer; with mixed_precision or offload, LongStraw's own partition of the fp32 master "
        "weights and moments); 2 also the gradients, 3 also the parameters (FSDP2, longstraw.parallel.shard_model; "
        "2 keeps a layer's weights gathered from its forward to its backward)")
    expert_parallel: bool | None = Field(
        None, description="ZeRO-2/3 with MoE (GLM-5): each rank keeps experts / nproc whole experts of every MoE "
        "layer and the tokens go to them (two all-to-alls per MoE layer), instead of FSDP gathering every expert at "
        "each use; null: on when the experts split evenly over the ranks (longstraw/parallel/experts.py)")
    mixed_precision: bool = Field(
        False, description="bf16 weights and compute with fp32 master weights and fp32 AdamW moments, gradients "
        "reduced in fp32 (needs dtype: bfloat16). The model holds bf16 parameters (ZeRO-2/3: FSDP2's bf16 shards, "
        "reduce-scattered with MixedPrecisionPolicy(reduce_dtype=fp32)) and the optimizer an fp32 master copy of "
        "those it updates (ZeRO-1: its partition; ZeRO-2/3: its shards). false: AdamW in the model's dtype")
    offload: Literal["none", "cpu", "nvme"] = Field(
        "none", description="where the fp32 master weights and AdamW moments live and are stepped: none on the "
        "model's device (torch AdamW); cpu in host memory, stepped by DeepSpeed's CPU Adam (DeepSpeedCPUAdam, AdamW "
        "mode) and copied back to the device parameters; nvme like cpu, the master and moments in files under "
        "nvme_path (memory-mapped; see docs/precision.md)")
    nvme_path: str | None = Field(
        None, description="offload nvme: directory (on a fast local disk) for the master weights and moments; each "
        "rank uses its own subdirectory, recreated at every start (a checkpoint holds the state)")

    @model_validator(mode="after")
    def _offload(self) -> "OptimConfig":
        if self.offload == "nvme" and not self.nvme_path:
            raise ValueError("optim.offload nvme needs optim.nvme_path (a directory on a local NVMe disk)")
        if self.nvme_path is not None and self.offload != "nvme":
            raise ValueError(f"optim.nvme_path is set but optim.offload is {self.offload!r}; set offload: nvme or "
                             "remove nvme_path")
        if self.expert_parallel and self.zero_stage < 2:
            raise ValueError(f"optim.expert_parallel shards the experts as ZeRO-2/3 does, but optim.zero_stage is "
                             f"{self.zero_stage}; set zero_stage: 3 (or 2), or remove expert_parallel")
        return self


class LoraSpec(_Strict):
    """LoRA adapters (PEFT) on the named linear modules; the base weights stay frozen (longstraw/lora.py)."""

    r: int = Field(8, gt=0, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scale alpha / r")
    dropout: float = Field(0.0, ge=0, description="must be 0: exact mode recomputes prompt chunks")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                      description="module name suffixes, as PEFT matches them (q_proj, gate_proj, ...)")

    @model_validator(mode="after")
    def _no_dropout(self) -> "LoraSpec":
        if self.dropout:
            raise ValueError(f"lora.dropout {self.dropout} is not supported: exact mode recomputes prompt chunks and "
                             "needs the same forward each time; set it to 0")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty; name the modules to adapt, e.g. [q_proj, v_proj]")
        return self


class StoreConfig(_Strict):
    url: str | None = Field(None, description="fsspec URL of the zarr store (prefix states under states/, rollouts "
                            "under rollouts/); default: <run_dir>/store")
    storage_options: dict = Field(default_factory=dict, description="fsspec options, e.g. s3 credentials")
    shard_tokens: int = Field(65536, ge=1, description="tokens per zarr shard (one writer per shard)")


class PipelineConfig(_Strict):
    """How a run is spread over processes, and what it keeps.

    A run is one SPMD job of `nproc` ranks (torchrun; gloo on CPU, NCCL on GPU) that keep the model and the
    optimizer resident from start to end: ranks form `nproc // sp` data-parallel groups of `sp` sequence-parallel
    ranks; each group holds one copy of the prefix state (rank r of a group owns one contiguous token range) and
    replays its share of the branches. `nproc: 1` is the same program on one process."""

    nproc: int = Field(1, ge=1, description="ranks of the run in all, over every node (the torch.distributed world "
                       "size; each node runs nproc / nnodes of them); `longstraw train --nproc`")
    nnodes: int = Field(1, ge=1, description="machines the ranks run on: each node starts `longstraw train --nnodes M "
                        "--node-rank i --rdzv-endpoint HOST:PORT` (torchrun's c10d rendezvous); 1: one machine "
                        "(torchrun --standalone)")
    node_rank: int = Field(0, ge=0, description="this machine's number, 0..nnodes-1, by which errors and logs name "
                           "it (torchrun's c10d rendezvous orders the nodes itself: rank 0, which runs the flow, is "
                           "on the node whose address sorts first)")
    rdzv_endpoint: str | None = Field(None, description="HOST:PORT of the c10d rendezvous, the same on every node "
                                      "(usually node 0's host); needed when nnodes > 1")
    sp: int | None = Field(None, ge=1, description="sequence-parallel group size C (ranks sharing one prefix state); "
                           "default nproc; nproc // sp data-parallel groups split each group's branches")
    branches_per_task: int = Field(1, ge=1, description="branches one data-parallel group replays per replay task")
    checkpoint_every: int = Field(1, ge=1, description="commit a checkpoint every this many steps (and after the "
                                  "last); a resume restarts from the latest one, recomputing the steps after it")
    retries: int = Field(2, ge=0, description="retries of a stage on a transient I/O error (rank-0 stages; every "
                         "stage at nproc 1: a failed rank ends an SPMD job, and `longstraw resume` continues it)")
    retry_delay_seconds: float = Field(2.0, ge=0, description="first retry delay; doubles each retry")
    collective_timeout_s: float = Field(600.0, gt=0, description="torch.distributed timeout of the ranks' "
                                        "collectives: a rank that stops answering fails the job after this long "
                                        "(rank 0 too: it sends heartbeats while it works alone)")

    @model_validator(mode="before")
    @classmethod
    def _gone(cls, data):
        for key, why in (("replay_concurrency", "replay runs on the run's resident ranks (set nproc / sp)"),
                         ("keep_gradients", "gradients accumulate in memory; no gradient files are written")):
            if isinstance(data, dict) and key in data:
                raise ValueError(f"pipeline.{key} is no longer an option: {why}; remove it from the config")
        return data

    @model_validator(mode="after")
    def _mesh(self) -> "PipelineConfig":
        if self.nproc % self.sequence_parallel:
            raise ValueError(f"pipeline.nproc {self.nproc} is not a multiple of pipeline.sp {self.sp}")
        if self.nproc % self.nnodes:
            per_node = max(1, self.nproc // self.nnodes)
            raise ValueError(f"pipeline.nproc counts the ranks of all nodes together: {self.nproc} ranks do not split "
                             f"evenly over {self.nnodes} nodes; use a multiple of {self.nnodes}, e.g. --nproc "
                             f"{self.nnodes * per_node} for {per_node} per node")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"pipeline.node_rank {self.node_rank} is not below nnodes {self.nnodes}; nodes are "
                             f"numbered 0..{self.nnodes - 1} (--node-rank)")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(f"a run on {self.nnodes} nodes needs the rendezvous address: --rdzv-endpoint HOST:PORT "
                             "(pipeline.rdzv_endpoint), the same on every node, e.g. node 0's hostname and a free port")
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"pipeline.rdzv_endpoint {self.rdzv_endpoint!r} is not HOST:PORT; give e.g. "
                                 "--rdzv-endpoint node0.cluster:29500")
        return self

    @property
    def sequence_parallel(self) -> int:
        return self.sp or self.nproc

    @property
    def data_parallel(self) -> int:
        return self.nproc // self.sequence_parallel


# Where this process's ranks run, not what the run computes: left out of stage cache keys and of the config a
# resume reads back (a resume may run on other machines, another node count, another rendezvous address).
PLACEMENT = ("nnodes", "node_rank", "rdzv_endpoint")


def without_placement(config: dict) -> dict:
    """A TrainConfig dict with its `pipeline` section's placement keys removed (defaults: one node)."""
    pipeline = {k: v for k, v in config.get("pipeline", {}).items() if k not in PLACEMENT}
    return {**config, "pipeline": pipeline}


class RolloutConfig(_Strict):
    backend: str = Field("native", description="the sampler that draws the answers (longstraw/sampler.py, "
                         "`SAMPLERS`, `register_sampler`): native, longstraw's own decode on the shared prefix state; or a "
                         "factory of your own as module:function, called with `options`")
    options: dict[str, Any] = Field(default_factory=dict, description="the sampler's own settings, passed to its "
                                    "factory; native: stop_check_every, compile, static_shapes (`DecodeOptions`)")

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        return check_backend(v)

    @model_validator(mode="after")
    def _native_options(self) -> RolloutConfig:
        # the native sampler's options are checked here; another backend's factory checks its own when the worker
        # builds it (building one here could reach for a server)
        if self.backend == "native":
            NativeSampler(self.options)
        return self


ENV_REWARD = "env"  # the reserved reward: the rewards the agent's environment gave, stored with the rollout


class AgentConfig(_Strict):
    """Multi-turn branches with tools (docs/agents.md): each branch talks to its own environment, made from the
    group's example; the rollout stores every turn, so a resume never calls the tools again."""

    env: str = Field(..., description="a built-in environment (longstraw/agents/builtin.py, e.g. record-lookup) or "
                     "'module:function', a factory make_env(example: dict) -> Environment")
    tools: str | None = Field(None, description="'module:attr' naming a ToolRegistry (or a function returning one); "
                              "null: the built-in environment's tools, or the env module's attribute `tools`")
    max_turns: int = Field(3, ge=1, description="turns the model writes per branch at most")
    tool_timeout: float = Field(10.0, gt=0, description="seconds per tool call; a call past it is an error "
                                "observation")

    @field_validator("env")
    @classmethod
    def _env_named(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("agent.env is empty; name a built-in environment (e.g. record-lookup) or give "
                             "'module:function'")
        return v


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
    stop_tokens: list[str] = Field(default_factory=list, description="tokens (as text, one token each) that end an "
                                   "answer or an agent's turn besides the tokenizer's end of sequence, e.g. "
                                   "['<|im_end|>'] for a base model whose eos is <|endoftext|>")
    rollout: RolloutConfig = Field(RolloutConfig(), description="which sampler draws the answers")
    agent: AgentConfig | None = Field(None, description="multi-turn branches with tools (docs/agents.md); absent: "
                                      "one answer per branch")
    reward: str | list[str] | None = Field(
        None, description="reward name or module:function, or a list of them (several reward functions, weighted by "
        "grpo.reward_weights, combined by grpo.multi_objective_aggregation); default: the task's verifier, or `env` "
        "(the rewards its environments gave) with `agent`")
    reward_nan_max_share: float = Field(
        0.5, ge=0, le=1, description="the most a reward function may return NaN for, as a share of a group's "
        "answers: above it the run stops with an error naming the function (a broken reward would train on noise); "
        "at or below it each NaN scores 0.0, counts in reward_failures and is summed up in one warning per group")
    mode: Literal["naive", "detached", "exact"] = "exact"
    epochs: int = Field(1, ge=1, description="optimizer updates per rollout (>1: off-policy, clipping active)")
    moe_routing_replay: bool = Field(
        False, description="MoE routing replay (R3, engine/routing.py; MoE models only, e.g. GLM-5): the rollout "
        "records the experts each sampled token went to and stores them with it, the capture keeps the prompt's "
        "with the state, and replay and the prompt backward route every token to those experts instead of "
        "re-routing; later epochs of a step capture the prompt with the epoch-0 routing, so every update of the "
        "step is computed on the experts that produced the samples. The KL reference model (another model) routes "
        "by itself")
    grpo: GRPOConfig = Field(GRPOConfig(), description="the loss: clipping, KL, aggregation")
    engine: EngineConfig = Field(EngineConfig(), description="how its gradient is computed: prompt chunk, branch "
                                 "batch, kept graphs, boundary states (time and memory, never the gradient)")
    optim: OptimConfig = OptimConfig()
    lora: LoraSpec | None = Field(None, description="LoRA adapters instead of full fine-tuning (absent: full)")
    seed: int = 0
    threads: int | None = Field(None, ge=1, description="torch CPU threads")
    device: str = Field("auto", description="where each rank's model computes: auto (the GPU when torch sees one, "
                        "else the CPU), cpu, cuda (an error when there is none) or cuda:N (one process only; "
                        "torchrun's ranks each take their LOCAL_RANK's GPU)")
    run_dir: str = "runs/grpo"
    store: StoreConfig = StoreConfig()
    pipeline: PipelineConfig = PipelineConfig()
    tracking: TrackingConfig = TrackingConfig()
    schedule: ScheduleConfig = ScheduleConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data):
        if isinstance(data, dict) and "scale_advantages" in data:
            raise ValueError("scale_advantages is now grpo: {scale_rewards: group|none} (true -> group, false -> "
                             "none; or batch: the std of all the step's groups); remove scale_advantages")
        return data

    @field_validator("reward")
    @classmethod
    def _reward_names(cls, v: str | list[str] | None) -> str | list[str] | None:
        names = [v] if isinstance(v, str) else v or []
        if isinstance(v, list) and not v:
            raise ValueError("reward is an empty list; name at least one reward function, or leave reward unset")
        if any(not n.strip() for n in names):
            raise ValueError("reward names an empty reward function; give a registered name or module:function")
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"reward lists {', '.join(map(repr, twice))} more than once; to weigh a function more, "
                             "give it a larger grpo.reward_weights entry")
        return v

    @field_validator("device")
    @classmethod
    def _device_setting(cls, v: str) -> str:
        return check_device_setting(v)

    @field_validator("run_dir")
    @classmethod
    def _run_dir_is_a_path(cls, v: str) -> str:
        if "://" in v:
            raise ValueError(f"run_dir {v!r} is a URL, but the run directory needs a filesystem (its lock is an "
                             "flock, a checkpoint is committed by a rename, MLflow writes SQLite there): use a path "
                             "every node mounts (NFS, Lustre, CephFS), and the state store on object storage with "
                             f"store.url: {v.rstrip('/')}/store")
        return v

    @model_validator(mode="after")
    def _source(self) -> "TrainConfig":
        if (self.task is None) == (self.dataset is None):
            raise ValueError("set exactly one of `task` (a built-in task) or `dataset` (a JSONL file)")
        if self.dataset is not None and self.reward is None and self.agent is None:
            raise ValueError("a dataset needs a `reward` (e.g. exact_match, number_match or module:function)")
        weights, rewards = self.grpo.reward_weights, self.rewards
        if weights is not None and len(weights) != len(rewards):
            raise ValueError(f"grpo.reward_weights has {len(weights)} weight(s) for {len(rewards)} reward "
                             f"function(s) ({', '.join(rewards)}); give one weight per entry of `reward`, in its "
                             "order")
        self._agent_fits()
        p = self.pipeline
        if p.nproc > 1 and self.mode == "naive":
            raise ValueError("mode naive is the one-process reference (every branch recomputes the prompt); run it "
                             "with pipeline.nproc 1, or use exact mode on several ranks")
        if self.responses % p.data_parallel:
            raise ValueError(f"responses {self.responses} do not split evenly over the {p.data_parallel} "
                             f"data-parallel groups (pipeline.nproc {p.nproc} / sp {p.sequence_parallel}); use a "
                             f"multiple of {p.data_parallel}")
        if self.optim.mixed_precision and self.dtype != "bfloat16":
            raise ValueError(f"optim.mixed_precision computes in bf16 with fp32 master weights; set dtype: bfloat16 "
                             f"(it is {self.dtype}), or mixed_precision: false for AdamW in {self.dtype}")
        if p.nproc > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device} pins one GPU, but the {p.nproc} ranks each take their own (their "
                             "LOCAL_RANK's); set device: cuda (or auto)")
        if self.optim.zero_stage and p.nproc == 1:
            raise ValueError(f"optim.zero_stage {self.optim.zero_stage} shards over several ranks; set "
                             "pipeline.nproc > 1 or zero_stage 0")
        return self

    def _agent_fits(self) -> None:
        named = [self.reward] if isinstance(self.reward, str) else self.reward or []
        if self.agent is None:
            if ENV_REWARD in named:
                raise ValueError(f"reward {ENV_REWARD!r} is the rewards an agent's environment gives, but no `agent` "
                                 "is set; add an agent section (agent: {env: ...}) or choose another reward")
            return
        if self.rollout.backend != "native":
            raise ValueError(f"agent branches decode on LongStraw's own sampler, but rollout.backend is "
                             f"{self.rollout.backend!r}; set rollout.backend: native (or remove agent)")

    @property
    def rewards(self) -> list[str]:
        """The reward functions, in order: `reward` as a list, or the task's verifier (`env` with an agent)."""
        if self.reward is None:
            return [ENV_REWARD] if self.agent is not None else [self.task]
        return [self.reward] if isinstance(self.reward, str) else list(self.reward)

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
