"""The tensor-parallel target: its shards split the model as meant, and through the whole stack
(coordinator, draft, a target sharded over two gloo processes) greedy output is the target's."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
import torch
from test_e2e_default_model import check_against_reference, hf_greedy

from specdec import Client
from specdec.stack import LocalStack, Process, StackConfig, child_env, wait_for_line
from target_service.tensor_parallel import shard_llama, split

NEW_TOKENS = 24
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
]


def test_split_is_contiguous_and_balanced():
    assert split(3, 2) == [range(2), range(2, 3)]
    assert split(1536, 2) == [range(768), range(768, 1536)]
    parts = split(10, 4)
    assert [len(r) for r in parts] == [3, 3, 2, 2]
    assert [i for r in parts for i in r] == list(range(10))


def test_cli_reads_the_group_from_torchrun_only_with_tp(monkeypatch):
    from specdec.cli import _parser
    from target_service.cli import tensor_parallel

    def place(*flags):
        return tensor_parallel(_parser().parse_args(["serve-target", *flags]))

    monkeypatch.delenv("SPECDEC_TENSOR_PARALLEL", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")  # left behind by some other job
    assert place().world_size == 1
    with pytest.raises(SystemExit, match="--tp 2 but the launcher started 8 ranks"):
        place("--tp", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    tp = place("--tp", "2")
    assert (tp.world_size, tp.rank, tp.master_port, tp.launched) == (2, 1, 29511, True)
    monkeypatch.delenv("WORLD_SIZE")
    tp = place("--tp", "2")
    assert (tp.world_size, tp.rank, tp.launched) == (2, 0, False)
    with pytest.raises(SystemExit, match="outside a group"):
        place("--tp", "0")


def test_shard_keeps_its_heads_and_refuses_more_ranks_than_kv_heads(tiny_dir):
    from specdec.models import load_model

    loaded = load_model(str(tiny_dir / "target"), tiny_dir)  # 4 query heads in 2 groups, MLP 64 wide
    full_q = loaded.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    shard_llama(loaded.model, rank=1, world_size=2)
    attn = loaded.model.model.layers[0].self_attn
    head_dim = attn.head_dim
    assert torch.equal(attn.q_proj.weight, full_q[2 * head_dim :])  # the second group's two query heads
    assert attn.k_proj.weight.shape[0] == head_dim
    assert attn.o_proj.linear.weight.shape[1] == 2 * head_dim
    assert loaded.model.model.layers[0].mlp.gate_proj.weight.shape[0] == 32

    with pytest.raises(ValueError, match="only 2 key/value heads"):
        shard_llama(load_model(str(tiny_dir / "target"), tiny_dir).model, rank=0, world_size=3)


@pytest.fixture(scope="module")
def references(default_model):
    """Single-process greedy output of HF generate on the whole model."""
    return hf_greedy(default_model, PROMPTS, NEW_TOKENS)


@pytest.mark.slow
def test_tp2_stack_greedy_equals_single_process(references, default_model, tmp_path):
    # float32, as the reference computes: a sharded pass sums the ranks' partial products (all-reduce),
    # which rounds differently from one product, so only float32 keeps the two greedy paths together
    # (in bf16 they part at the first top-two gap under bf16's rounding, as any two kernels would).
    config = StackConfig(target_tp=2, target_threads=1, default_k=4, dtype="float32")
    with LocalStack(config, log_dir=tmp_path) as stack:
        target = psutil.Process(stack.process("target").popen.pid)
        shards = [p for p in target.children() if "serve-target" in " ".join(p.cmdline())]
        assert len(shards) == 1, "the target should run as rank 0 plus one follower process"
        accepted = 0
        with Client(stack.address, timeout=300) as client:
            for prompt, (ids, expected) in zip(PROMPTS, references):
                result = client.complete(prompt, max_new_tokens=NEW_TOKENS)
                accepted += result.stats.accepted_tokens
                check_against_reference(result, prompt, ids, expected, default_model.model)
            sampled = [client.complete(PROMPTS[2], max_new_tokens=8, temperature=0.8, seed=7) for _ in range(2)]
        assert accepted > 0
        assert sampled[0].token_ids == sampled[1].token_ids
        assert all(shard.is_running() for shard in shards)


@contextmanager
def _tp2_target(tiny_dir, tmp_path) -> Iterator[tuple[Process, psutil.Process]]:
    """A tiny target sharded over two processes, serving: (rank 0, its follower)."""
    argv = [
        sys.executable,
        "-m",
        "specdec.cli",
        "serve-target",
        "--port",
        "0",
        "--model",
        str(tiny_dir / "target"),
        "--cache-dir",
        str(tiny_dir),
        "--threads",
        "1",
        "--tp",
        "2",
    ]
    proc = Process("target", argv, tmp_path, child_env(1, passive=True))
    try:
        wait_for_line(proc, "READY ", 120.0)
        yield proc, psutil.Process(proc.popen.pid).children()[0]
    finally:
        proc.stop()


def test_sigterm_is_for_rank_0_which_drains_and_stops_its_shards(tiny_dir, tmp_path):
    """A follower stopped mid-pass would break the pass: it ignores SIGTERM, and exits when rank 0,
    having drained, tells it to."""
    with _tp2_target(tiny_dir, tmp_path) as (proc, shard):
        shard.terminate()
        time.sleep(1.0)
        assert shard.is_running() and shard.status() != psutil.STATUS_ZOMBIE
        proc.popen.terminate()
        assert proc.popen.wait(timeout=30) == 0, proc.log_tail()
        shard.wait(timeout=30)  # not our child: its exit status went to rank 0
        assert "exited with" not in proc.log_tail()  # rank 0 saw it stop cleanly (status 0)


def test_shard_dies_with_rank_0(tiny_dir, tmp_path):
    """A follower whose rank 0 was killed does not linger holding its shard."""
    with _tp2_target(tiny_dir, tmp_path) as (proc, shard):
        proc.popen.kill()
        shard.wait(timeout=20)


def test_replica_stops_when_a_shard_dies(tiny_dir, tmp_path):
    """A target missing a shard cannot run a pass: rank 0 exits rather than hang, so it gets restarted."""
    with _tp2_target(tiny_dir, tmp_path) as (proc, shard):
        shard.kill()
        deadline = time.monotonic() + 20
        while proc.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.popen.returncode == 1, proc.log_tail()
        assert "exited with -9; this replica stops" in proc.log_tail()
