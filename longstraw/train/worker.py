"""`Worker`: what one rank of a training run keeps resident from start to end, and the ops it runs.

The model and the optimizer are loaded once per worker start (`start`: the run's latest checkpoint, verified once)
and stay resident. Each op is one stage of a GRPO step, run by every rank with the same arguments (spmd.py):
capture, rollout, reference, replay, prompt (exact mode's prompt backward), optimizer. What an op hands on is
small JSON (URLs and digests of stored artefacts, metrics); what the next ops of the same step need in memory
stays in memory:

- gradients accumulate in `param.grad` (FSDP: the rank's shard) over every replay and prompt op of an update;
  dLoss/dState of a group accumulates over its replay ops in `self._dstate` and is consumed by its prompt op;
- the last prefix state used stays resident (`self._state`), so rollout and replay after a capture read nothing;
- so do the last rollout's answers, log-probs, sampler log-probs, finish reasons and MoE routing (`self._rollout`)
  and the KL reference's log-probs (`self._reference_logps`): reference and replay read them from the store only
  after a resume. Each is a one-slot `LastUsed` (resident.py), keyed by the stored artefact it holds.

MoE routing replay (`moe_routing_replay`, engine/routing.py): epoch 0's capture records the prompt's experts with
the state, and the rollout each answer's with the rollout (both stored); replay routes the answers as the rollout
did, the prompt backward the prompt as its state says. A later epoch's capture (new weights) takes epoch 0's
routing from its stored state (`routing_from`), so every update of a step is computed on the experts that produced
the samples.

What resume needs is stored, and nothing model-sized per op: prefix-state shards (each written by the rank that
owns its tokens; sharded_state.py), rollouts, references, and checkpoints every `pipeline.checkpoint_every`
steps (sharded, checkpoint.py). A resume after a failure in replay or the prompt backward loads the stored state
and rollout (never recaptures) and replays the step's branches again: at the same N the sums run in the same
order, so the weights end bitwise equal to an uninterrupted run.

Weights are named by a lineage id (`weights_version`): update 0's is the content digest of its checkpoint; each
update hashes its parent's id with its number. A step's cached stages key on it, so they stay valid for the same
weights whether or not that update was checkpointed (a resume recomputes the same updates in the same order).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..config import torch_dtype
from ..data import Tokenizer, check_vocab, load_tokenizer, stop_ids
from ..engine import (Branches, capture, group_entropies, naive_backward, naive_entropies, naive_plan, new_dstate,
                      plan_group, prompt_backward, reduce_gradients, replay, score, with_entropy_weights)
from ..engine.routing import prompt_moe_layers
from ..files import Artefact, remove_stale_temporaries
from ..lora import add_lora
from ..memory import PeakMeter
from ..models import build_model, load_model, meta_model
from ..parallel import shard_from_rank0, shard_model
from ..sampler import Draw, Sampler, SamplingSettings, build_sampler
from ..sharded_state import (commit_sharded_state, load_state_routing, load_state_shard, read_sharded_manifest,
                             save_state_shard, uncommit)
from ..state import LayerState, PrefixState
from ..store import manifest_digest, save_rollout
from .artifacts import load_tensors, save_tensors
from .checkpoint import latest_checkpoint, load_checkpoint, read_trainer, save_checkpoint
from .config import TrainConfig
from .data import example_seed, step_example
from .device import run_device
from .optim import build_optimizer, optimizer_step
from .resident import LastUsed
from .agent import AgentRollout, agent_metrics, rollout_meta
from .answers import Answers, as_rank0_stored, gather_samples, gather_slices, replayed_routing, sampled_answers
from .spmd import ONE_PROCESS, Ranks, agree
from .inputs import env_example, example_record, make_prompt, read_rollout


def next_version(version: str, update: int) -> str:
    """The lineage id of the weights after `update` (1-based) applied to those named `version`."""
    return hashlib.sha256(f"{version}|update {update}".encode()).hexdigest()


def _leader_reads(read: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    """Rank 0's read of the whole model for the others to shard; any failure becomes an error every rank agrees
    on (they wait for this read, so rank 0 must not fail alone)."""
    try:
        return read().state_dict()
    except (ValueError, OSError, KeyError):
        raise
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by agree()
        raise ValueError(f"rank 0 could not read the weights: {type(e).__name__}: {e}") from e


class Worker:
    def __init__(self, cfg: TrainConfig, ranks: Ranks = ONE_PROCESS) -> None:
        self.cfg, self.ranks = cfg, ranks
        self.parallel = ranks.parallel
        self.model: nn.Module | None = None
        self.optim: torch.optim.Optimizer | None = None  # the AdamW (its op is `optimizer`)
        self.update, self.weights_version = 0, ""
        self.model_loads = 0  # per worker start: 1 (2 with a KL reference model)
        # what the rollout op draws the answers with
        self.sampler: Sampler = build_sampler(cfg.rollout.backend, cfg.rollout.options)
        self._agent: AgentRollout | None = None  # with `agent`: its environments and tools, resolved at first use
        self._reference: nn.Module | None = None
        # the last prefix state used, by (url, digest)
        self._state: LastUsed[tuple[str, str], PrefixState] = LastUsed()
        # the last rollout sampled or read: its answers by its artefact, rank 0's on every rank
        self._rollout: LastUsed[Artefact, Answers] = LastUsed()
        # the last KL reference log-probs computed or read (one tensor per answer) by their artefact, rank 0's
        self._reference_logps: LastUsed[Artefact, list[torch.Tensor]] = LastUsed()
        self._dstate: dict[tuple[int, int], dict[int, LayerState]] = {}
        # the entropy options' (mask, bonus weights) of a (group, epoch), from its first replay op to the optimizer
        self._entropy: dict[tuple[int, int], tuple] = {}
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # a torchrun rank has made its LOCAL_RANK's GPU the current one (spmd.init_ranks)
        self._device = run_device(cfg.device)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # kernels that launch on the current device (Triton's) use it too

    # ---- the rank's place ---------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where this rank's model computes (`device:` in the run config; `run_device`)."""
        return self._device

    @property
    def _sp_rank(self) -> tuple[int, int]:
        """(this rank's index in its sequence-parallel group, the group's size)."""
        return self.parallel.rank, self.parallel.size

    @property
    def _writes_shards(self) -> bool:
        """The first data-parallel group writes the state (every group holds the same copy)."""
        return self.parallel.dp_rank == 0

    @property
    def _leader(self) -> bool:
        return self.ranks.leader

    def _meter(self) -> PeakMeter:
        return PeakMeter(self.device, collect=False)  # a full gc per op would cost more than a tiny op

    def _agree(self, fn):
        return agree(self.ranks, fn)

    def _resident(self, read: Callable[[], nn.Module], weights_dir: Path | None, lora: dict | None,
                  stage: int | None = None, trained: bool = True) -> nn.Module:
        """The model to keep resident, from `read()` (the whole model) and `weights_dir` (the directory holding its
        config.json; None for a random model). Sharded (ZeRO-2/3 on several ranks): only rank 0 reads the weights,
        and every rank builds the model on the meta device and takes its shards by broadcast (`shard_from_rank0`:
        1/N of the weights per rank plus one tensor in flight, one read of the files). Otherwise every rank reads
        them, and ZeRO-2/3 then shards them.

        The `trained` model under ZeRO-2/3 with `optim.mixed_precision` reduce-scatters its gradients in fp32
        (`shard_model(mixed_precision=True)`); its fp32 master weights are the optimizer's."""
        stage = self.cfg.optim.zero_stage if stage is None else stage
        mixed = trained and self.cfg.optim.mixed_precision
        experts = self.cfg.optim.expert_parallel
        skeleton = None
        if stage >= 2 and weights_dir is not None:  # ZeRO-2/3: several ranks
            skeleton = self._agree(lambda: meta_model(weights_dir, torch_dtype(self.cfg.dtype),
                                                      self.cfg.model.rope_override))
            if skeleton.config.tie_word_embeddings:  # the meta path would untie them
                skeleton = None
        if skeleton is None:
            model = read()
            return (shard_model(model, stage, self.parallel, mixed_precision=mixed, expert_parallel=experts)
                    if stage >= 2 else model).eval()
        if lora is not None:
            add_lora(skeleton, **lora)
        full = self._agree(lambda: _leader_reads(read) if self._leader else None)
        return shard_from_rank0(skeleton, full, stage, self.parallel, self.device, mixed, experts).eval()

    def _check_version(self, weights_version: str) -> None:
        if weights_version != self.weights_version:
            raise ValueError(f"the ranks hold weights {self.weights_version[:12]} (update {self.update}) but the stage "
                             f"asks for {weights_version[:12]}; resume the run (`longstraw resume <run dir>`)")

    # ---- ops ------------------------------------------------------------------------------------------------------
    def start(self) -> dict:
        """Load the run's latest checkpoint (or make update 0 from the configured model) and keep it resident."""
        cfg, paths = self.cfg, self.cfg.paths()
        if self._leader:
            remove_stale_temporaries(paths.checkpoints)  # a kill mid-commit leaves one; the run lock makes it safe
        latest = self.ranks.broadcast(str(p) if (p := latest_checkpoint(paths.checkpoints)) else None)
        dtype = torch_dtype(cfg.dtype)
        factory = lambda m: build_optimizer(m, cfg.optim, self.parallel)  # noqa: E731
        if latest is None:
            torch.manual_seed(cfg.seed)
            lora = None if cfg.lora is None else cfg.lora.model_dump()

            def read() -> nn.Module:
                # through this module's loaders, which the flows' tests count (tests/flows/hooks)
                model = (load_model(cfg.model.path, dtype=dtype, device=self.device,
                                    rope_scaling=cfg.model.rope_override) if cfg.model.path
                         else build_model(cfg.model.hf_config(), dtype, self.device))
                # adapters initialised from the run's seed too (B = 0: the base model's outputs)
                return model if lora is None else add_lora(model, **lora)

            self.model = self._resident(read, Path(cfg.model.path) if cfg.model.path else None, lora)
            if lora is not None:
                # the adapters' initial values were drawn from the RNG, maybe by rank 0 alone (the sharded load):
                # every rank goes on from rank 0's RNG state
                torch.set_rng_state(torch.tensor(self.ranks.broadcast(torch.get_rng_state().tolist()),
                                                 dtype=torch.uint8))
            tok = load_tokenizer(cfg.tokenizer)
            check_vocab([tok.vocab_size - 1], self.model.config.vocab_size, f"tokenizer {cfg.tokenizer!r}")
            self.optim = factory(self.model)
            latest = save_checkpoint(paths.checkpoint(0), self.model, self.optim, update=0, step=0, extra={})
            meta = read_trainer(latest)  # verified as written
        else:
            self.model, self.optim, meta = load_checkpoint(latest, factory, dtype, loader=self._resident,
                                                           device=self.device)
        self.model_loads += 1
        self.update, self.weights_version = meta["update"], meta["weights_version"]
        for kept in (self._state, self._rollout, self._reference_logps):
            kept.clear()
        self._dstate, self._entropy = {}, {}
        ref = None
        if cfg.grpo.kl_coef > 0:  # the KL reference: update 0's weights
            ref = meta if self.update == 0 else read_trainer(paths.checkpoint(0))
        return {"checkpoint": str(latest), "update": self.update, "weights_version": self.weights_version,
                "reference_version": None if ref is None else ref["weights_version"], "model_loads": self.model_loads}

    def capture(self, weights_version: str, step: int, group: int, epoch: int, routing_from: dict | None = None
                ) -> dict:
        """Capture the group's prompt and store its prefix state: each owner writes its token range's shard.

        MoE routing replay: epoch 0 records the prompt's routing with the state; a later epoch routes the prompt as
        `routing_from` (epoch 0's stored state, {url, sha256}) recorded it."""
        cfg = self.cfg
        self._check_version(weights_version)
        routing = self._prompt_routing(epoch, routing_from)
        prompt, ex = make_prompt(cfg, step, group, self.model.config.vocab_size)
        url = f"{cfg.paths().store_url}/states/step-{step:06d}/group-{group:03d}/epoch-{epoch:02d}"
        rank, ranks = self._sp_rank
        if self._leader:
            uncommit(url, cfg.store.storage_options)  # before any shard is rewritten
        with self._meter() as m:
            # exact mode: the boundary states are stored with the state; the kept chunk graphs stay in memory
            plan = plan_group(self.model, cfg.engine, prompt.numel(), parallel=self.parallel,
                              exact=cfg.mode == "exact")
            state = capture(self.model, prompt, cfg.engine, plan=plan, parallel=self.parallel,
                            exact=cfg.mode == "exact", record_routing=cfg.moe_routing_replay, routing=routing)
            mine = (save_state_shard(state, url, rank, weights_version=weights_version,
                                     shard_tokens=cfg.store.shard_tokens, storage_options=cfg.store.storage_options)
                    if self._writes_shards else None)
        shards = [s for s in self.ranks.gather(mine) if s is not None]  # every owner has committed its shard
        digest = None
        if self._leader:
            manifest = commit_sharded_state(url, shards, state=state, weights_version=weights_version,
                                            storage_options=cfg.store.storage_options,
                                            extra={"example": example_record(ex)})
            digest = manifest_digest(manifest)
        digest = self.ranks.broadcast(digest)
        self._state.keep((url, digest), state)
        return {"url": url, "sha256": digest, "weights_version": weights_version, "prompt_tokens": prompt.numel(),
                "state_bytes": state.nbytes, "peak_bytes": m.peak_bytes, "seconds": m.seconds,
                "tokens_per_s": prompt.numel() / max(m.seconds, 1e-9), "plan": plan.params()}

    def _prompt_routing(self, epoch: int, routing_from: dict | None) -> dict[int, torch.Tensor] | None:
        """The whole prompt's routing a capture forces: under MoE routing replay, a later epoch's is epoch 0's, read
        from its stored state (every rank reads all of it: capture keeps its own rows); None otherwise."""
        if not self.cfg.moe_routing_replay:
            if routing_from is not None:
                raise ValueError("capture got routing_from, but moe_routing_replay is off; leave routing_from unset")
            return None
        if epoch == 0:
            if routing_from is not None:
                raise ValueError("epoch 0's capture records the prompt's routing; routing_from is for later epochs")
            return None
        if routing_from is None:
            raise ValueError(f"epoch {epoch}'s capture under moe_routing_replay routes the prompt as epoch 0 did: pass "
                             "routing_from, epoch 0's stored state ({url, sha256})")
        if not prompt_moe_layers(self.model):  # no MoE layer runs on the prompt: nothing recorded, nothing to force
            return None
        routing = self._agree(lambda: load_state_routing(routing_from["url"],
                                                         storage_options=self.cfg.store.storage_options,
                                                         digest=routing_from["sha256"]))
        if routing is None:
            raise ValueError(f"the prefix state at {routing_from['url']} was captured without its MoE routing, which "
                             "moe_routing_replay forces at later epochs: delete it so that its step captures it again, "
                             "or set moe_routing_replay: false")
        return routing

    def rollout(self, weights_version: str, state: dict, step: int, group: int) -> dict:
        """Sample G answers from the prefix state (shared by all branches) and store them (rank 0). Each
        data-parallel group samples its slice of the G (the slice it replays) and rank 0 gathers them: the same
        answers as one group sampling all G, in 1/dp of the decode steps' batch.

        With `agent`: multi-turn branches (`rollout_turns`), each talking with its own environment; the turns,
        the environments' rewards and counters are stored with the rollout (meta "agent"), and the masks with
        the tokens, so that a resume never calls the tools again."""
        cfg = self.cfg
        self._check_version(weights_version)
        tok = load_tokenizer(cfg.tokenizer)
        prefix = self._load(state)
        mine = self.parallel.branches(cfg.responses)
        draw = Draw(n=len(mine), seed=example_seed(cfg.seed, step, group), first_branch=mine.start)
        agent = None if cfg.agent is None else self._agent_rollout(tok)  # (imports the user's module first)
        settings = self._sampling(tok)
        records, env_seconds = None, 0.0
        with self._meter() as m:
            if agent is None:
                samples = self.sampler.sample(self.model, prefix, settings, draw, parallel=self.parallel)
            else:
                # made on rank 0 of each sequence-parallel group, the only rank that calls them
                envs = self._agree(lambda: agent.environments(env_example(step_example(cfg, tok, step, group)),
                                                              draw.n) if self.parallel.rank == 0 else None)
                samples, records, env_seconds = agent.sample(self.model, prefix, settings, draw, envs, self.parallel)
            if len(mine) < cfg.responses:
                samples = gather_samples(self.ranks, samples)
                if records is not None:
                    records = gather_slices(self.ranks, records)
        lengths = [s.tokens.numel() for s in samples]
        out = {"responses": len(samples), "response_len_mean": sum(lengths) / len(lengths),
               "peak_bytes": m.peak_bytes, "seconds": m.seconds, "tokens_per_s": sum(lengths) / max(m.seconds, 1e-9)}
        stored = None
        if self._leader:
            example = read_sharded_manifest(state["url"], cfg.store.storage_options)["extra"].get("example")
            meta = {"finish_reasons": [s.finish_reason for s in samples],
                    "texts": [tok.decode(s.tokens.tolist()) for s in samples], "example": example}
            if records is not None:
                meta["agent"] = rollout_meta(samples, records, settings.stop_ids, tok)
                # the decode's wait on the environments (wall time, rank 0's group) apart from the tools' own
                out |= agent_metrics(meta["agent"]) | {"env_seconds": env_seconds}
            url = f"{cfg.paths().store_url}/rollouts/step-{step:06d}/group-{group:03d}"
            manifest = save_rollout(url, [s.tokens for s in samples], [s.logprobs for s in samples], meta,
                                    sampler_logprobs=[s.sampler_logprobs for s in samples],
                                    routing=[s.routing for s in samples] if cfg.moe_routing_replay else None,
                                    masks=[s.mask for s in samples] if records is not None else None,
                                    storage_options=cfg.store.storage_options)
            stored = Artefact(url, manifest_digest(manifest))
            out |= stored.to_json()
        # resident for the group's reference and replay ops, as the store keeps them
        self._rollout.keep(*sampled_answers(self.ranks, stored, samples, cfg.moe_routing_replay))
        return out

    def _agent_rollout(self, tok) -> AgentRollout:
        """The run's environments and tools, resolved once (a bad name is an error on every rank)."""
        if self._agent is None:
            self._agent = self._agree(lambda: AgentRollout(self.cfg.agent, tok, self.cfg.stop_tokens))
        return self._agent

    def _sampling(self, tok: Tokenizer) -> SamplingSettings:
        """The run's sampling settings (an answer ends at the tokenizer's end of sequence or a `stop_tokens`)."""
        cfg = self.cfg
        return SamplingSettings(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                top_k=cfg.top_k, stop_ids=stop_ids(tok, cfg.stop_tokens),
                                record_routing=cfg.moe_routing_replay)

    def _responses(self, rollout: dict) -> Answers:
        """The answers of `rollout` (an `Artefact`'s JSON): resident if it was the last one sampled or read, else
        read from the store (after a resume), verified."""
        artefact = Artefact.from_json(rollout)

        return self._rollout.get(artefact, lambda: Answers.stored(self._agree(
            lambda: read_rollout(self.cfg, artefact))))

    def reference(self, reference_version: str, state: dict, rollout: dict, step: int, group: int) -> dict:
        """Log-probs of the sampled answers (`rollout`: an `Artefact`'s JSON) under the frozen initial weights (the
        KL term); the prompt's tokens come from the stored state."""
        cfg = self.cfg
        model = self._reference_model(reference_version)
        prompt = self._load(state).prompt_ids
        responses = self._responses(rollout).responses
        with self._meter() as m:
            # capture and score run no autograd: the plan both run, and the one reported
            plan = plan_group(model, cfg.engine, prompt.numel(), parallel=self.parallel, exact=False, grad=False)
            ref_state = capture(model, prompt, cfg.engine, plan=plan, parallel=self.parallel)
            logps = score(model, ref_state, responses, engine=cfg.engine, plan=plan, parallel=self.parallel)
        out = {"peak_bytes": m.peak_bytes, "seconds": m.seconds, "plan": plan.params()}
        logps = [lp.detach().cpu() for lp in logps]
        stored = None
        if self._leader:
            path = str(cfg.paths().step(step) / f"reference-g{group:03d}.safetensors")
            stored = Artefact(path, save_tensors(path, {f"logprobs.{i}": lp for i, lp in enumerate(logps)}))
            out |= stored.to_json()
        # resident for the group's replays, as for the rollout; the store is there for a resume
        stored, (logps,) = as_rank0_stored(self.ranks, stored, [logps])
        self._reference_logps.keep(stored, logps)
        return out

    def _reference_logprobs(self, reference: dict, n: int) -> list[torch.Tensor]:
        """The KL reference's log-probs of the `n` answers (`reference`: an `Artefact`'s JSON): resident if they
        were the last computed or read, else read from the store (after a resume), verified."""
        artefact = Artefact.from_json(reference)

        def read() -> list[torch.Tensor]:
            tensors = self._agree(lambda: load_tensors(artefact.path, artefact.sha256))
            return [tensors[f"logprobs.{i}"] for i in range(n)]

        return self._reference_logps.get(artefact, read)

    def replay(self, weights_version: str, state: dict, rollout: dict, advantages: list[float],
               reference: dict | None, step: int, group: int, epoch: int, branches: list[list[int]]) -> dict:
        """Replay one slice of branches per data-parallel group (`branches[d]` for group d) with autograd on the
        prefix state; parameter gradients and (exact mode) dLoss/dState accumulate in memory. `advantages`: the
        group's, one per answer (the reward or advantages stage's result, sent to every rank with the op);
        `rollout` and `reference` (the KL reference's log-probs, or None) are `Artefact`s' JSON."""
        cfg = self.cfg
        self._check_version(weights_version)
        if len(branches) != (dp := self.parallel.dp_size):
            raise ValueError(f"replay got {len(branches)} branch slices for {dp} data-parallel groups")

        answers = self._responses(rollout)
        responses = answers.responses
        ref_logps = None if reference is None else self._reference_logprobs(reference, len(responses))
        prefix = self._load(state)  # naive mode too: its prompt is the stored one
        group_branches = Branches.group(
            responses, advantages, cfg.grpo, vocab_size=self.model.config.vocab_size,
            old_logprobs=answers.logprobs if cfg.epochs > 1 else None,  # several epochs: ratios against the sampler
            ref_logprobs=ref_logps, sampler_logprobs=answers.sampler_logprobs,
            truncated=[reason == "length" for reason in answers.finish_reasons], masks=answers.masks)
        if cfg.moe_routing_replay:  # the answers' tokens go to the experts the rollout sent them to
            group_branches = replace(group_branches, routing=replayed_routing(self.model, answers, rollout, state, prefix))
        with self._meter() as m:
            mine = self._entropy_weighted(group_branches, prefix, group, epoch).select(branches[self.parallel.dp_rank])
            if cfg.mode == "naive":  # one process: the state's routing is the whole prompt's
                plan = naive_plan(self.model, cfg.engine, prefix.prompt_ids)
                totals = naive_backward(self.model, prefix.prompt_ids, mine, cfg.grpo, plan=plan,
                                        prompt_routing=self._naive_prompt_routing(prefix))
            else:
                dstate = None
                if cfg.mode == "exact":
                    if (group, epoch) not in self._dstate:
                        self._dstate[(group, epoch)] = new_dstate(prefix)
                    dstate = self._dstate[(group, epoch)]
                plan = plan_group(self.model, cfg.engine, prefix, parallel=self.parallel, exact=dstate is not None)
                totals = replay(self.model, prefix, mine, cfg.grpo, dstate, engine=cfg.engine, plan=plan,
                                parallel=self.parallel)
        tokens = sum(responses[i].numel() for s in branches for i in s)
        return {"branches": branches, **totals, "tokens": tokens, "peak_bytes": m.peak_bytes, "seconds": m.seconds,
                "tokens_per_s": tokens / max(m.seconds, 1e-9), "plan": plan.params()}

    def _naive_prompt_routing(self, prefix: PrefixState) -> dict[int, torch.Tensor] | None:
        """Naive mode recomputes the prompt in one process, so MoE routing replay hands it the state's routing (the
        whole prompt's) as an argument; the other modes route the prompt through the state itself."""
        return prefix.routing if self.cfg.moe_routing_replay else None

    def _entropy_weighted(self, group_branches: Branches, prefix: PrefixState, group: int, epoch: int) -> Branches:
        """The group's branches with the entropy options' mask and bonus weights (`with_entropy_weights`): the
        whole group's, computed by the group's first replay op and kept for the others until the optimizer step."""
        cfg = self.cfg
        if not cfg.grpo.entropy_needed:
            return group_branches
        if (group, epoch) not in self._entropy:
            if cfg.mode == "naive":
                scored = lambda: naive_entropies(self.model, prefix.prompt_ids, group_branches,  # noqa: E731
                                                 engine=cfg.engine, prompt_routing=self._naive_prompt_routing(prefix))
            else:
                scored = lambda: group_entropies(self.model, prefix, group_branches, engine=cfg.engine,  # noqa: E731
                                                 parallel=self.parallel)
            weighted = with_entropy_weights(group_branches, cfg.grpo, scored)
            self._entropy[(group, epoch)] = (weighted.entropy_keep, weighted.bonus_weights)
        keep, bonus = self._entropy[(group, epoch)]
        return replace(group_branches, entropy_keep=keep, bonus_weights=bonus)

    def prompt(self, weights_version: str, state: dict, step: int, group: int, epoch: int) -> dict:
        """Exact mode: back-propagate the group's summed dLoss/dState through the prompt, every chunk recomputed
        (chunk by chunk from the stored boundary states, or layer by layer: `engine.prompt_order`)."""
        self._check_version(weights_version)
        grad = self._dstate.pop((group, epoch), None)
        if grad is None:
            raise ValueError(f"no replay of step {step} group {group} epoch {epoch} ran on these ranks since they "
                             "started: run the group's replay tasks first")
        prefix = self._load(state)
        with self._meter() as m:
            plan = prompt_backward(self.model, prefix, grad, engine=self.cfg.engine, parallel=self.parallel)
        return {"peak_bytes": m.peak_bytes, "seconds": m.seconds,
                "tokens_per_s": prefix.length / max(m.seconds, 1e-9), "plan": plan.params()}

    def optimizer(self, weights_version: str, update: int, step: int, record: dict | None = None) -> dict:
        """Sum the accumulated gradients over the data-parallel groups (FSDP did while reducing), clip, AdamW
        step; commit a checkpoint at the end of every `checkpoint_every`-th step and of the run's last update.
        `record` (the step's metrics so far; rank 0's alone, which writes the checkpoint's trainer record) goes into
        the checkpoint, so a kill after the commit loses no record."""
        cfg = self.cfg
        self._check_version(weights_version)
        if self._dstate:
            raise ValueError(f"prompt backward of {sorted(self._dstate)} (group, epoch) did not run before the "
                             "optimizer step")
        t0 = time.perf_counter()
        if not getattr(self.optim, "reduces_gradients", False):  # MasterAdamW sums them itself, in fp32
            reduce_gradients(self.model, self.parallel)
        stats = optimizer_step(self.model, self.optim, cfg.optim, update, cfg.updates)
        self.update += 1
        self.weights_version = next_version(self.weights_version, self.update)
        self._state.clear()  # captured with the old weights
        self._entropy = {}  # of the old weights
        last_of_step = self.update % cfg.epochs == 0
        checkpoint = None
        if (last_of_step and (step + 1) % cfg.pipeline.checkpoint_every == 0) or self.update == cfg.updates:
            path = save_checkpoint(cfg.paths().checkpoint(self.update), self.model, self.optim, update=self.update,
                                   step=step, weights_version=self.weights_version, base=self._lora_base,
                                   extra={"skipped_update": bool(stats["skipped"]),
                                          **({} if record is None else {"record": {**record, **stats}})})
            checkpoint = str(path)
        return {"update": self.update, "weights_version": self.weights_version, "checkpoint": checkpoint, **stats,
                "seconds": time.perf_counter() - t0}

    @property
    def _lora_base(self) -> str | None:
        """With LoRA, where the frozen base weights are: in update 0's checkpoint, written once."""
        return str(self.cfg.paths().checkpoint(0)) if self.cfg.lora is not None else None

    # The ops rank 0 may ask every rank to run (spmd.Driver.call), by the name that goes over the wire, in the order
    # a step runs them. A table of the methods rather than a look-up of the name, so that a reader (and "find
    # usages") can follow an op from its task to its code.
    OPS: dict[str, Callable[..., dict]] = {
        "start": start, "capture": capture, "rollout": rollout, "reference": reference, "replay": replay,
        "prompt": prompt, "optimizer": optimizer}

    # ---- state and models -----------------------------------------------------------------------------------------
    def _load(self, ref: dict) -> PrefixState:
        """The prefix state of a capture's result ({url, sha256}): resident if it was the last one used, else this
        rank's shard read from the store (its manifest checked against the digest, every file's crc32c)."""
        rank, ranks = self._sp_rank
        return self._state.get((ref["url"], ref["sha256"]), lambda: self._agree(lambda: load_state_shard(
            ref["url"], rank, ranks, model=self.model, weights_version=self.weights_version,
            storage_options=self.cfg.store.storage_options, digest=ref["sha256"])))

    def _reference_model(self, reference_version: str) -> nn.Module:
        """The KL reference (update 0's weights), loaded once per worker start and never stepped."""
        if self._reference is None:
            path = self.cfg.paths().checkpoint(0)
            meta = self._agree(lambda: read_trainer(path))
            if meta["weights_version"] != reference_version:
                raise ValueError(f"{path} holds weights {meta['weights_version'][:12]}, not the reference "
                                 f"{reference_version[:12]} the stage asks for")
            read = lambda: load_model(path, dtype=torch_dtype(self.cfg.dtype), device=self.device)  # noqa: E731
            # the base weights (no adapters: the reference of a LoRA run is its base model)
            self._reference = self._resident(read, path, None, stage=3 if self.cfg.optim.zero_stage >= 2 else 0,
                                             trained=False)
            self._reference.requires_grad_(False)
            self.model_loads += 1
        return self._reference
