"""A tensor-parallel target: one replica's weights sharded over N processes with ``torch.distributed``.

The split is Megatron's, for a Llama decoder:

- attention is split by key/value head groups: rank r keeps the k/v heads of its range and the query
  heads that share them (GQA), the matching columns of ``q/k/v_proj`` and rows of ``o_proj``; its KV
  caches hold only its own heads, so cache memory is split too;
- the MLP is split along its intermediate size (``gate/up_proj`` columns, ``down_proj`` rows);
- ``o_proj`` and ``down_proj`` each end in one all-reduce that sums the ranks' partial outputs;
- embeddings, norms and the LM head are replicated (on a 135M model they are a third of the weights,
  but sharding the vocabulary would add a gather per pass for little).

Head counts need not divide evenly: SmolLM2-135M has 3 k/v heads, so at N = 2 the ranks hold 2 and 1.

Only rank 0 serves gRPC. Every engine call it makes (prefill, fork, verify, release, warm-up) is first
broadcast to the other ranks, which make the same call on their shards; the passes' all-reduces then
pair up. The engine's decisions are deterministic given its inputs, and the all-reduced activations
are identical on every rank, so each rank's session caches stay identical in shape to rank 0's.
Caches rank 0 drops on its own (idle expiry, LRU and budget eviction) are sent with the next call,
so a follower never evicts by itself.

A failed collective means the group is broken (a rank died, or the ranks fell out of step): any rank
that sees one exits at once, rather than pair later all-reduces with the wrong pass, and its
supervisor restarts the whole replica.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from specdec.config import TensorParallelConfig
from specdec.kvcache import CacheTable, HiddenRows
from specdec.models import LoadedModel
from specdec.vocab import ModelFacts
from target_service.engine import TargetEngine, VerifyCall, VerifyOutcome

log = logging.getLogger("specdec.target.tp")

# A follower waits this long for rank 0's next call before giving up; rank 0 pings more often.
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
PING_EVERY_S = 60.0
# Followers hold every cache rank 0 holds and drop only what rank 0 says, so their own LRU bound is
# set out of reach (their memory is still bounded by rank 0's limits, one call late).
_FOLLOWER_CAPACITY = 1 << 30


def split(n: int, parts: int) -> list[range]:
    """``n`` items in ``parts`` contiguous ranges whose sizes differ by at most one (earlier ones larger)."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class RowParallelLinear(nn.Module):
    """A linear layer holding some input features' columns; the all-reduce sums the ranks' parts."""

    def __init__(self, linear: nn.Linear, keep_bias: bool) -> None:
        super().__init__()
        self.linear = linear
        if not keep_bias:  # the bias is added once, on one rank, not N times
            self.linear.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        collective(dist.all_reduce, out)
        return out


def collective(op, *args: Any) -> None:
    """Runs one collective; a failure ends this process (see the module docstring)."""
    try:
        op(*args)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the group unusable
        group_broken(exc)


def group_broken(exc: BaseException) -> None:
    """Exits now: this rank cannot take part in the group's passes any more."""
    log.critical("tensor-parallel group broken (%s); exiting so the whole replica restarts", exc)
    logging.shutdown()
    os._exit(1)


def _slice_linear(linear: nn.Linear, rows: range | None = None, cols: range | None = None) -> nn.Linear:
    """A copy of ``linear`` keeping output features ``rows`` and input features ``cols``."""
    weight = linear.weight.detach()  # [out, in]
    bias = linear.bias.detach() if linear.bias is not None else None
    if rows is not None:
        weight = weight[rows.start : rows.stop]
        bias = bias[rows.start : rows.stop] if bias is not None else None
    if cols is not None:
        weight = weight[:, cols.start : cols.stop]
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    out.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.contiguous().clone(), requires_grad=False)
    return out


def shard_llama(model: nn.Module, rank: int, world_size: int) -> None:
    """Keeps rank ``rank``'s shard of every decoder layer of a Llama-style model, in place.

    Projection biases (Qwen2) are cut with their rows; per-head norms (Qwen3's q/k norms) act within a
    head and stay whole. Fused projections (Phi-3's ``qkv_proj``, ``gate_up_proj``) are refused: their
    rows would have to be cut in three or two places each.
    """
    config = model.config
    first = model.get_decoder().layers[0]
    if not hasattr(first.self_attn, "q_proj") or not hasattr(first.mlp, "gate_proj"):
        raise ValueError(f"tensor parallel: {config.model_type} fuses its projections; it runs unsharded (--tp 1)")
    kv_heads, heads = config.num_key_value_heads, config.num_attention_heads
    if world_size > kv_heads:
        raise ValueError(f"tensor parallel: {world_size} ranks but the model has only {kv_heads} key/value heads")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    group = heads // kv_heads
    mine = split(kv_heads, world_size)[rank]
    q_features = range(mine.start * group * head_dim, mine.stop * group * head_dim)
    kv_features = range(mine.start * head_dim, mine.stop * head_dim)
    mlp_features = split(config.intermediate_size, world_size)[rank]
    for layer in model.get_decoder().layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _slice_linear(attn.q_proj, rows=q_features)
        attn.k_proj = _slice_linear(attn.k_proj, rows=kv_features)
        attn.v_proj = _slice_linear(attn.v_proj, rows=kv_features)
        attn.o_proj = RowParallelLinear(_slice_linear(attn.o_proj, cols=q_features), keep_bias=rank == 0)
        mlp.gate_proj = _slice_linear(mlp.gate_proj, rows=mlp_features)
        mlp.up_proj = _slice_linear(mlp.up_proj, rows=mlp_features)
        mlp.down_proj = RowParallelLinear(_slice_linear(mlp.down_proj, cols=mlp_features), keep_bias=rank == 0)


@dataclass(frozen=True)
class _Call:
    """One engine call rank 0 makes, as the followers replay it."""

    method: str  # a TargetEngine method, or "ping" / "stop"
    args: tuple[Any, ...] = ()
    # Caches rank 0 dropped by itself since its previous call.
    gone: tuple[str, ...] = field(default_factory=tuple)


def _broadcast(call: _Call | None) -> _Call:
    box = [call]
    collective(dist.broadcast_object_list, box, 0)
    return box[0]


class LeaderEngine:
    """Rank 0's engine: every call is announced to the followers before it runs here.

    It offers what the target servicer uses of a TargetEngine. Calls are serialised by a lock (the
    servicer already makes them from one thread; the lock also orders the keep-alive pings).
    """

    def __init__(self, engine: TargetEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._told: set[str] = set()
        self._last_call = time.monotonic()
        self._closed = False
        threading.Thread(target=self._ping, name="tp-ping", daemon=True).start()

    @property
    def facts(self) -> ModelFacts:
        """The model facts this service reports."""
        return self._engine.facts

    @property
    def caches(self) -> CacheTable:
        """Rank 0's session caches (the followers hold the same ones)."""
        return self._engine.caches

    @property
    def batches(self) -> bool:
        """True when calls that arrive together share one pass."""
        return self._engine.batches

    def _announce(self, method: str, *args: Any, new_id: str | None = None) -> None:
        if self._closed:
            raise RuntimeError("the target is shutting down")
        live = self._engine.caches.ids()
        gone = tuple(self._told - live)
        self._told = live | ({new_id} if new_id else set())
        _broadcast(_Call(method, args, gone))
        self._last_call = time.monotonic()

    def prefill(
        self,
        tokens: list[int],
        with_hidden: bool = False,
        fence: int = 0,
        defer: bool = False,
        side_layers: tuple[int, ...] = (),
    ) -> tuple[str, int, HiddenRows | None]:
        """TargetEngine.prefill on every rank, under one cache id."""
        with self._lock:
            cache_id = self._engine.caches.new_id()
            self._announce("prefill", tokens, with_hidden, fence, cache_id, defer, side_layers, new_id=cache_id)
            return self._engine.prefill(tokens, with_hidden, fence, cache_id, defer, side_layers)

    def fork(self, source_id: str, tokens: list[int], fence: int = 0) -> tuple[str, int, int]:
        """TargetEngine.fork on every rank (each copies its own heads' KV), under one cache id."""
        with self._lock:
            cache_id = self._engine.caches.new_id()
            self._announce("fork", source_id, tokens, fence, cache_id, new_id=cache_id)
            return self._engine.fork(source_id, tokens, fence, cache_id)

    def verify_batch(self, calls: list[VerifyCall]) -> list[VerifyOutcome | Exception]:
        """TargetEngine.verify_batch on every rank."""
        with self._lock:
            self._announce("verify_batch", calls)
            return self._engine.verify_batch(calls)

    def release(self, cache_id: str) -> bool:
        """TargetEngine.release on every rank."""
        with self._lock:
            self._announce("release", cache_id)
            return self._engine.release(cache_id)

    def warmup(self) -> None:
        """TargetEngine.warmup on every rank, over the pass sizes rank 0 can run."""
        with self._lock:
            sizes = self._engine.warmup_sizes()
            self._announce("warmup", sizes)
            try:
                self._engine.warmup(sizes)
            except BaseException as exc:  # noqa: BLE001 - the followers would run passes rank 0 skipped
                group_broken(exc)

    def close(self) -> None:
        """Tells the followers to exit."""
        with self._lock:
            if not self._closed:
                self._closed = True
                _broadcast(_Call("stop"))

    def _ping(self) -> None:
        # Followers block in a broadcast that times out after GROUP_TIMEOUT: an idle replica keeps
        # them waiting on purpose, not by a lost leader. A failed ping ends the process (collective).
        while not self._closed:
            time.sleep(PING_EVERY_S / 4)
            with self._lock:
                if not self._closed and time.monotonic() - self._last_call >= PING_EVERY_S:
                    self._announce("ping")


def follow(engine: TargetEngine) -> None:
    """A follower rank's life: replay rank 0's calls on this shard until it says stop.

    An error rank 0 will meet too (a bad token, a stale fence) is ignored here, as rank 0 reports it.
    """
    while True:
        call = _broadcast(None)
        if call.method == "stop":
            return
        for cache_id in call.gone:
            engine.release(cache_id)
        if call.method == "ping":
            continue
        try:
            getattr(engine, call.method)(*call.args)
        except Exception as exc:  # noqa: BLE001 - the same call fails on rank 0, which answers the client
            log.warning("replayed %s failed (rank 0 reports the same error to its caller): %s", call.method, exc)


def follower_engine(loaded: LoadedModel) -> TargetEngine:
    """A follower's engine over its shard: no eviction, expiry or budget of its own."""
    return TargetEngine(loaded, _FOLLOWER_CAPACITY)


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_followers(tp: TensorParallelConfig, argv: list[str]) -> list[subprocess.Popen]:
    """Starts ranks 1..N-1 as torchrun would: the same command, with RANK / WORLD_SIZE / LOCAL_RANK /
    MASTER_ADDR / MASTER_PORT set. They die with this process."""
    procs = []
    for rank in range(1, tp.world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(tp.world_size),
            MASTER_ADDR=tp.master_addr,
            MASTER_PORT=str(tp.master_port),
            SPECDEC_TP_LAUNCHER_PID=str(os.getpid()),
        )
        procs.append(subprocess.Popen([sys.executable, "-m", "specdec.cli", *argv], env=env))
    return procs


def become_follower(launcher_pid: int | None) -> None:
    """Readies a follower process before it joins the group.

    It dies with its launcher (Linux ``PR_SET_PDEATHSIG``): one outliving a killed rank 0 would hold
    its memory until the group times out. It ignores SIGINT and SIGTERM: those are for rank 0, which
    drains and then tells the followers to stop; a follower stopped mid-pass would break the pass.
    """
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != (launcher_pid or os.getppid()):  # the launcher died before that took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def watch_followers(procs: list[subprocess.Popen]) -> None:
    """Ends this process when a follower dies: the replica cannot run a pass without every shard,
    so it exits and lets its supervisor restart the whole group (coordinators move its sessions)."""

    def wait(proc: subprocess.Popen) -> None:
        code = proc.wait()
        if code != 0:  # 0: it was told to stop
            log.error("tensor-parallel rank (pid %d) exited with %s; this replica stops", proc.pid, code)
            os._exit(1)

    for proc in procs:
        threading.Thread(target=wait, args=(proc,), daemon=True).start()


def join_group(tp: TensorParallelConfig) -> None:
    """Joins the process group (blocking until every rank has)."""
    # gloo: the engine computes on CPU tensors. A GPU engine would join with "nccl" here, each rank on
    # cuda:LOCAL_RANK; the engine's tensors are not device-placed yet, so that is not offered.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{tp.master_addr}:{tp.master_port}",
        rank=tp.rank,
        world_size=tp.world_size,
        timeout=GROUP_TIMEOUT,
    )
