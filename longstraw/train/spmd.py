"""The training run as one SPMD program: rank 0 drives, every rank executes.

`longstraw train --nproc N` starts N ranks with torchrun. Every rank builds one `Worker` (worker.py) that keeps
the model and the optimizer resident for the whole run. Rank 0 also runs the orchestration (the Prefect flow);
each stage it runs is an op: rank 0 broadcasts it as a JSON command (`Driver.call`), every rank executes it on
its resident model with the same arguments (`execute`: the method `Worker.OPS` names), and rank 0 gets every
rank's small JSON result. The ops' own collectives (attention merges, FSDP gathers, gradient sums) run over the
compute process group; commands over a separate gloo group and results over another. Every group has the
collective timeout, so a rank that vanished without closing its connections (a machine that lost power or its
network) fails the others then, not in days. While rank 0 does rank-0-only work (rewards, tracking, its flow's
start), a thread of it broadcasts a heartbeat on the command group a few times per timeout; the other ranks
wait for commands only that long, and a rank 0 that went silent is named as lost (`LeaderLost`).
Nothing here is a home-made transport: torchrun starts the processes, torch.distributed moves the bytes. At
N = 1 the same ops run in-process without any of it.

Failures. An error that every rank raises together (`Agreed`: bad or corrupted input found while loading, before
any compute collective) is raised on rank 0 and the ranks go on serving, so the flow can handle it (e.g. drop a
corrupted state and run the step again). Any other error on a rank ends the job: that rank prints it, records it
under `<run_dir>/ranks/`, and tears down its process groups, so the others fail at once instead of waiting for the
collective timeout; rank 0 raises `RankFailed` naming the rank and its error, ends its flow run and exits non-zero.
A rank that records nothing (its node was lost: killed, or down) is named by rank 0 as lost, with its node and host.
Each record has the error's kind (longstraw/errors.py): "user" (bad input, a corrupted checkpoint, a full disk, a
lock: a resume fails the same way, so no rank advises one), "fault" (a resume fixes it), "peer" (this rank only
saw another one leave) or "lost" (rank 0 names ranks that recorded nothing); the launcher's last line names the
earliest record that is not a peer's (`job_failure`).
Workers then exit 0 so that torchrun leaves rank 0 time to finish its bookkeeping; the job's exit status is rank
0's (a worker on another node than rank 0 exits 1, so that the scheduler sees that node's part fail too).
`longstraw resume` starts a fresh job from the stored state, on any number of nodes.

Several nodes: every rank records its node (`--node-rank`) and host at the start, and rank 0 checks that every
rank sees the run directory it writes (the checkpoint commit and the state shards need one shared filesystem).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import is_user_error, user_line
from ..files import CorruptArtefact
from ..memory import measured
from ..parallel import ONE_RANK, SequenceGroup, SequenceParallel
from ..parallel.launch import torchrun
from ..parallel.objects import broadcast_json, gather_json
from .config import TrainConfig
from .device import run_device

HEARTBEATS_PER_TIMEOUT = 4  # rank 0's heartbeats per collective timeout, while the others wait for a command
RECORD_WAIT_S = 5.0  # after a failure, how long rank 0 waits for the other ranks' error records
CLOCK_SKEW_S = 30.0  # records are stamped by each machine's clock; the run's start clears older ones anyway


class RankFailed(RuntimeError):
    """A rank of the SPMD job failed; the job is over. `user`: the cause is a user's error (no resume fixes it)."""

    def __init__(self, message: str, user: bool = False) -> None:
        super().__init__(message)
        self.user = user


class LeaderLost(RankFailed):
    """Rank 0 sent neither a command nor a heartbeat within the collective timeout, or its connection closed."""


class Agreed(Exception):
    """An error every rank raised together (so the job can go on); `error` is what to raise on rank 0."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Ranks:
    """This process's place in the job: the sequence-parallel group (with its data-parallel groups) for the ops'
    collectives, and the gloo group that carries commands and results."""

    parallel: SequenceGroup
    control: dist.ProcessGroup | None
    rank: int
    world: int
    results: dist.ProcessGroup | None = None  # gathers of results: the collective timeout (default: control)
    places: list[dict] | None = None  # every rank's {"node", "host"}, in rank order
    # rank 0's one sender on the control group at a time: an op's command, a heartbeat or the stop
    control_lock: threading.RLock = field(default_factory=threading.RLock)
    closed: bool = False  # no more commands or heartbeats (stopped, or the groups are gone)

    def where(self, rank: int) -> str:
        """'node 1, host h1' of a rank (its launcher's --node-rank and its machine)."""
        p = self.places[rank] if self.places else {"node": "?", "host": "?"}
        return f"node {p['node']}, host {p['host']}"

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def beside_leader(self) -> bool:
        """On rank 0's machine (where a worker's non-zero exit would make torchrun stop rank 0 mid-bookkeeping)."""
        return not self.places or self.places[self.rank] == self.places[0]

    @property
    def distributed(self) -> bool:
        """More than one process: a failing op must end the job on every rank."""
        return self.world > 1

    def broadcast(self, value):
        return broadcast_json(value, 0, self.control)

    def gather(self, value) -> list:
        return gather_json(value, self.results or self.control)


class OneProcess(Ranks):
    """The job of one process (no torchrun): the single-rank group, and commands that go nowhere."""

    def __init__(self) -> None:
        super().__init__(ONE_RANK, None, 0, 1)

    def broadcast(self, value):
        return value

    def gather(self, value) -> list:
        return [value]


ONE_PROCESS = OneProcess()
_RANKS: Ranks | None = None


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def init_ranks(cfg: TrainConfig) -> Ranks:
    """Join the torchrun job (process groups with the configured timeout, the (dp, sp) mesh) once per process."""
    global _RANKS
    if _RANKS is not None:
        return _RANKS
    world = int(os.environ["WORLD_SIZE"])
    p = cfg.pipeline
    if world != p.nproc:
        raise ValueError(f"torchrun started {world} ranks but the config says pipeline.nproc {p.nproc} (the ranks of "
                         f"all nodes together); start it with `longstraw train --nproc {world}` or set pipeline.nproc")
    cuda = cfg.device != "cpu" and torch.cuda.is_available()  # device: cpu on a GPU machine runs on gloo
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    run_device(cfg.device)  # device: cuda without a GPU fails here, before the ranks meet
    timeout = timedelta(seconds=p.collective_timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    results = dist.new_group(backend="gloo", timeout=timeout)
    if p.data_parallel == 1:
        parallel = SequenceParallel()
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda" if cuda else "cpu", (p.data_parallel, p.sequence_parallel),
                                mesh_dim_names=("dp", "sp"))
        parallel = SequenceParallel.from_mesh(mesh)
    ranks = Ranks(parallel, control, dist.get_rank(), world, results)
    ranks.places = ranks.gather({"node": p.node_rank, "host": socket.gethostname()})
    if ranks.leader and len({json.dumps(x) for x in ranks.places}) > 1:  # torchrun's c10d rendezvous placed them
        print(f"longstraw: {world} ranks: " + "; ".join(
            f"rank {r} on {ranks.where(r)}" for r in range(world)), flush=True)
    _check_shared_run_dir(cfg, ranks)
    if ranks.leader:
        threading.Thread(target=_heartbeat, args=(ranks, p.collective_timeout_s / HEARTBEATS_PER_TIMEOUT),
                         name="longstraw-heartbeat", daemon=True).start()
    _RANKS = ranks
    return _RANKS


def _heartbeat(ranks: Ranks, every_s: float) -> None:
    """Rank 0's thread: tell the ranks waiting for a command that rank 0 is alive, until the job ends."""
    while True:
        time.sleep(every_s)
        with ranks.control_lock:
            if ranks.closed:
                return
            try:
                ranks.broadcast({"op": "alive"})
            except RuntimeError:  # a rank is gone: the flow's next op finds it and names it
                return


def _check_shared_run_dir(cfg: TrainConfig, ranks: Ranks) -> None:
    """Every rank must see the run directory rank 0 writes (ranks on other machines write their shards into it and
    read the checkpoints): rank 0 writes a new file there, every rank looks for it; an error on every rank if not."""
    d = _errors_dir(cfg)
    name = None
    if ranks.leader:
        d.mkdir(parents=True, exist_ok=True)
        name = f"shared-{uuid.uuid4().hex}"
        (d / name).write_text(socket.gethostname())
    name = ranks.broadcast(name)
    blind = [r for r, sees in enumerate(ranks.gather((d / name).is_file())) if not sees]
    if ranks.leader:
        (d / name).unlink()
    if blind:
        raise ValueError(f"the run directory {cfg.run_dir} is not one directory for every rank: rank(s) "
                         f"{', '.join(f'{r} ({ranks.where(r)})' for r in blind)} do not see what rank 0 "
                         f"({ranks.where(0)}) wrote there; put run_dir on a filesystem every node mounts at the same "
                         "path (NFS, Lustre, ...)")


def current_ranks() -> Ranks:
    """The job this process joined (`ONE_PROCESS` when it joined none)."""
    return _RANKS or ONE_PROCESS


def joined() -> bool:
    """Whether this process is a rank of a torchrun job (`init_ranks`)."""
    return _RANKS is not None


def shutdown() -> None:
    """Leave the job: destroy the process groups (which also makes peers blocked on us fail at once)."""
    global _RANKS
    if _RANKS is not None:
        with _RANKS.control_lock:  # not while rank 0's heartbeat is sending
            _RANKS.closed = True
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANKS = None


# ---- executing ops ----------------------------------------------------------------------------------------------

def _errors_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.run_dir) / "ranks"


def _in_op(op: str, params: dict) -> str:
    """'replay (step 1, group 0, epoch 0)'."""
    where = ", ".join(f"{k} {params[k]}" for k in ("step", "group", "epoch") if k in params)
    return f"{op}{f' ({where})' if where else ''}"


def error_kind(error: BaseException) -> str:
    """'user', 'peer' or 'fault' (the module's docstring)."""
    if is_user_error(error) or getattr(error, "user", False):
        return "user"
    return "peer" if isinstance(error, LeaderLost) or _peer_gone(str(error)) else "fault"


def _record_failure(cfg: TrainConfig, ranks: Ranks, op: str, params: dict, error: BaseException) -> None:
    line = f"rank {ranks.rank} of {ranks.world} failed in {_in_op(op, params)}: {type(error).__name__}: {error}"
    print(f"longstraw: {line}", file=sys.stderr, flush=True)
    _write_record(cfg, ranks.rank, op, line, error)


def _write_record(cfg: TrainConfig, rank: int, op: str, line: str, error: BaseException, kind: str | None = None
                  ) -> None:
    d = _errors_dir(cfg)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"error-rank{rank:03d}.json").write_text(json.dumps(
        {"rank": rank, "op": op, "message": line, "kind": kind or error_kind(error), "error": user_line(error),
         "traceback": traceback.format_exc(), "time": time.time()}))


def record_error(cfg: TrainConfig, error: BaseException) -> None:
    """Record this rank's error that ended it outside an op (the flow's own code, the start), so that the other
    ranks and the launcher name it rather than the rank's leaving; best effort (the disk may be what failed)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        _write_record(cfg, rank, "", f"rank {rank} of {world} failed: {type(error).__name__}: {error}", error)
    except OSError:
        pass


def _records(cfg: TrainConfig, since: float) -> dict[int, dict]:
    """The error records written since `since` (each machine's clock), by rank; a record lacking its kind (an
    older library's) is a fault unless its message says a peer left."""
    d = _errors_dir(cfg)
    out = {}
    for f in sorted(d.glob("error-rank*.json")) if d.is_dir() else ():
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):  # being written
            continue
        if r["time"] >= since:
            r.setdefault("kind", "peer" if _peer_gone(r["message"]) else "fault")
            out[r["rank"]] = r
    return out


def job_failure(cfg: TrainConfig, since: float) -> dict | None:
    """The record of the error that ended the job launched at `since`: the earliest that is not only a peer's
    leaving; None when every rank that recorded saw only a peer leave (a rank was killed or lost)."""
    skew = CLOCK_SKEW_S if cfg.pipeline.nnodes > 1 else 1.0
    causes = [r for r in _records(cfg, since - skew).values() if r["kind"] != "peer"]
    return min(causes, key=lambda r: r["time"]) if causes else None


def execute(worker, op: str, params: dict):
    """Run `op` on this rank; with other ranks, gather every rank's result to rank 0 (merged there)."""
    ranks = worker.ranks
    fn = _op(worker, op)
    if not ranks.distributed:
        return measured(fn, worker, **params)  # one process: errors are raised as they are (`agree` raises them too)
    try:
        out = measured(fn, worker, **params)
        results = ranks.gather(out)
    except Agreed:
        raise
    except BaseException as e:
        _record_failure(worker.cfg, ranks, op, params, e)
        shutdown()  # peers blocked on this rank fail now, not after the collective timeout
        raise RankFailed(str(e), user=error_kind(e) == "user") from e
    return merge(results) if ranks.leader else None


def _op(worker, op: str) -> Callable[..., dict]:
    if op not in worker.OPS:
        raise ValueError(f"unknown op {op!r}; the ops are {', '.join(worker.OPS)}")
    return worker.OPS[op]


def merge(results: list[dict]) -> dict:
    """Rank 0's result, with the largest peak memory of all ranks, the bytes all ranks read and wrote, and each
    rank's peak, seconds and bytes."""
    out = dict(results[0])
    for key in ("read_bytes", "written_bytes"):
        out[f"per_rank_{key}"] = [r[key] for r in results]
        out[key] = sum(r[key] for r in results)
    if all("peak_bytes" in r for r in results):
        out["peak_bytes"] = max(r["peak_bytes"] for r in results)
        out["per_rank_peak_bytes"] = [r["peak_bytes"] for r in results]
    if all("seconds" in r for r in results):
        out["per_rank_seconds"] = [r["seconds"] for r in results]
    return out


def agree(ranks: Ranks, fn):
    """fn() on every rank; if it raised on any rank, raise `Agreed` (the first rank's error) on all of them.
    For checks before compute collectives, so that bad input is an error on every rank and nothing hangs."""
    err: BaseException | None = None
    value = None
    try:
        value = fn()
    except (ValueError, OSError, KeyError) as e:
        err = e
    if not ranks.distributed:
        if err is not None:
            raise err
        return value
    records = ranks.gather(None if err is None else {"type": type(err).__name__, "message": str(err),
                                                     "where": getattr(err, "where", None), "rank": ranks.rank})
    first = next((r for r in records if r is not None), None)
    if first is not None:
        raise Agreed(err if err is not None and first["rank"] == ranks.rank else _rebuild(first))
    return value


def _rebuild(record: dict) -> BaseException:
    msg = f"{record['message']} (rank {record['rank']})"
    if record["type"] == "CorruptArtefact":
        return CorruptArtefact(msg, record["where"])
    if record["type"] in ("FileNotFoundError", "OSError"):
        return FileNotFoundError(msg)
    return ValueError(msg)


def _peer_gone(message: str) -> bool:
    """An error that only says another rank left or stopped answering (not why)."""
    return any(m in message for m in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                      "Timed out waiting"))


class Driver:
    """Rank 0's handle on the job: `call("capture", **params)` runs that op (`Worker.OPS["capture"]`, i.e.
    `Worker.capture`) on every rank and returns the merged result. The name is what goes to the other ranks."""

    def __init__(self, worker) -> None:
        self.worker = worker
        # one op at a time (every rank must see the same sequence), and no heartbeat in between
        self._lock = worker.ranks.control_lock
        self._failed: RankFailed | None = None

    def call(self, op: str, /, leader: dict | None = None, **params) -> dict:
        """Run `op(**params)` on every rank; `leader`: further arguments of rank 0's op alone (never sent, e.g. what
        only rank 0 writes), which the others' op gets as its defaults."""
        _op(self.worker, op)  # an unknown op fails here, before any rank is sent it
        with self._lock:
            if self._failed is not None:
                raise RankFailed(f"the job stopped earlier ({self._failed})", user=self._failed.user)
            ranks = self.worker.ranks
            started = time.time()
            try:
                ranks.broadcast({"op": op, "params": params})
                return execute(self.worker, op, params | (leader or {}))
            except Agreed as e:
                raise e.error from None
            except (RankFailed, RuntimeError) as e:
                if not ranks.distributed:
                    raise
                shutdown()  # first: ranks blocked on this one fail now and record it, which `_who_failed` reads
                self._failed = self._who_failed(started, ranks, _in_op(op, params)) or RankFailed(str(e))
                raise self._failed from e

    def _who_failed(self, since: float, ranks: Ranks, in_op: str) -> RankFailed | None:
        """The failure another rank recorded during this op (it tore down the groups: our error is only 'peer
        closed'); else the ranks that recorded nothing, i.e. were lost with their node. Waits a few seconds for
        every other rank's record (each surviving rank writes one as soon as its collectives fail). A user's error
        among them gets no resume advice (a resume would fail the same way) and is marked `user`."""
        stopped = f" (the job stopped; `longstraw resume {self.worker.cfg.run_dir}` continues it)"
        deadline = time.monotonic() + RECORD_WAIT_S
        while True:
            records = _records(self.worker.cfg, since - CLOCK_SKEW_S)
            # the others saw a peer leave; "lost" is this rank's own earlier conclusion
            causes = [r for r in records.values() if r["kind"] not in ("peer", "lost")]
            if causes:
                user = any(r["kind"] == "user" for r in causes)
                return RankFailed("; ".join(r["message"] for r in causes) + ("" if user else stopped), user=user)
            if len(records.keys() - {0}) >= ranks.world - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        by_place: dict[str, list[str]] = {}  # the lost ranks, by node
        for r in range(1, ranks.world):
            if r not in records:
                by_place.setdefault(ranks.where(r), []).append(str(r))
        if not by_place:
            return None
        lost = "; ".join(f"{', '.join(rs)} of {ranks.world} ({where})" for where, rs in by_place.items())
        line = (f"lost rank(s) {lost} in {in_op}: no answer and no error recorded; its processes were killed, or "
                f"its machine is down or unreachable" + stopped)
        with contextlib.suppress(OSError):  # for the launchers of every node, which name it last
            _write_record(self.worker.cfg, ranks.rank, in_op, line, RankFailed(line), kind="lost")
        return RankFailed(line)

    def stop(self) -> None:
        """Tell the other ranks to leave their loop (after the run, or after it failed)."""
        with self._lock:
            ranks = self.worker.ranks
            if ranks.distributed and self._failed is None and dist.is_initialized():
                try:
                    ranks.broadcast({"op": "stop"})
                except RuntimeError:
                    pass  # a peer is gone already
            ranks.closed = True


def serve(worker) -> None:
    """The loop of ranks 1..N-1: execute rank 0's commands until it says stop."""
    ranks = worker.ranks
    since = time.time()
    while True:
        try:
            cmd = ranks.broadcast(None)
        except RuntimeError as e:
            raise _leader_lost(worker, e, since) from e
        if cmd["op"] == "alive":
            continue
        if cmd["op"] == "stop":
            return
        try:
            execute(worker, cmd["op"], cmd["params"])
        except Agreed:
            continue  # every rank raised it; rank 0 handles it and sends the next command


def _leader_lost(worker, error: RuntimeError, since: float) -> RankFailed:
    """Rank 0 did not send the next command: printed, recorded, and the groups torn down (the other ranks stop
    too); the job cannot go on without the rank that drives it. When rank 0 recorded its own error before it left
    (it records before tearing its groups down), that error is the cause: a `RankFailed` of its kind, not
    `LeaderLost` (whose advice, a resume, may not fit)."""
    ranks, cfg = worker.ranks, worker.cfg
    own = _records(cfg, since - (0.0 if ranks.beside_leader else CLOCK_SKEW_S)).get(0)
    if own is not None and own["kind"] != "peer":
        shutdown()
        print(f"longstraw: rank {ranks.rank} of {ranks.world} stopped: rank 0 failed", file=sys.stderr, flush=True)
        return RankFailed(own["message"], user=own["kind"] == "user")
    silent = "Timed out" in str(error)
    how = (f"sent neither a command nor a heartbeat for {cfg.pipeline.collective_timeout_s:g} s" if silent
           else "closed its connection")
    lost = LeaderLost(f"lost rank 0 of {ranks.world} ({ranks.where(0)}), which drives the run: it {how}; its "
                      f"processes were stopped or killed, or its machine is down or unreachable (the job stopped; "
                      f"`longstraw resume {cfg.run_dir}` continues it)")
    _record_failure(cfg, ranks, "its wait for rank 0's next command", {}, lost)
    shutdown()
    return lost


def clear_failures(cfg: TrainConfig) -> None:
    d = _errors_dir(cfg)
    for f in d.glob("error-rank*.json") if d.is_dir() else ():
        f.unlink()


# ---- launching --------------------------------------------------------------------------------------------------

def launch(cfg: TrainConfig, progress: bool = True) -> int:
    """Start this node's ranks of the run under torchrun (`flows.ranks` on each; all `pipeline.nproc` of them on
    one node, nproc / nnodes on each of several, which meet at `rdzv_endpoint`); returns its exit status. Threads
    per rank: `threads`, or the cores divided among the node's ranks."""
    p = cfg.pipeline
    args = ["--config-json", cfg.model_dump_json(), *([] if progress else ["--no-progress"])]
    return torchrun("flows.ranks", args, p.nproc, cfg.threads, nnodes=p.nnodes, rdzv_endpoint=p.rdzv_endpoint
                    ).returncode
