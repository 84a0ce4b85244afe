"""Memory is bounded by default: a model service's KV budget comes from its memory limit."""

from __future__ import annotations

from specdec.cli import _parser, model_config
from specdec.host import KV_SHARE, default_kv_budget_mb, last_level_cache_bytes, memory_limit_bytes


def test_the_memory_limit_is_the_containers_where_one_is_set(tmp_path):
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    physical = memory_limit_bytes(())
    assert physical > 0
    v2.write_text("max\n")  # no limit under cgroup v2
    v1.write_text(str(1 << 62))  # cgroup v1 says "no limit" with a huge number
    assert memory_limit_bytes((v2, v1)) == physical
    v2.write_text(str(8 << 30))  # an 8Gi pod
    assert memory_limit_bytes((v2, v1)) == min(8 << 30, physical)


def test_the_kv_budget_is_on_by_default_and_scales_with_the_limit():
    assert default_kv_budget_mb(8 << 30) == int((8 << 30) * KV_SHARE) >> 20
    for command in ("serve-target", "serve-draft"):
        args = _parser().parse_args([command])
        budget = model_config(args, "default").kv_budget_mb
        assert budget == default_kv_budget_mb() > 0, command
        off = _parser().parse_args([command, "--kv-budget-mb", "0"])
        assert model_config(off, "default").kv_budget_mb == 0


def test_the_last_level_cache_is_the_highest_data_or_unified_one(tmp_path):
    caches = [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"), (3, "Unified", "32768K")]
    for index, (level, kind, size) in enumerate(caches):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("level", str(level)), ("type", kind), ("size", size)):
            (folder / name).write_text(value + "\n")
    assert last_level_cache_bytes(tmp_path) == 32 << 20
    (tmp_path / "index3" / "size").write_text("unknown\n")  # a size it cannot read: the next level down
    last_level_cache_bytes.cache_clear()
    assert last_level_cache_bytes(tmp_path) == 1 << 20
    assert last_level_cache_bytes(tmp_path / "missing") is None


def test_the_target_streams_its_weights_as_told_and_by_its_size_by_default(monkeypatch):
    parser = _parser()
    monkeypatch.delenv("SPECDEC_STREAM_WEIGHTS", raising=False)
    assert model_config(parser.parse_args(["serve-target"]), "default").stream_weights is None
    assert model_config(parser.parse_args(["serve-target", "--stream-weights", "off"]), "x").stream_weights is False
    monkeypatch.setenv("SPECDEC_STREAM_WEIGHTS", "on")
    assert model_config(_parser().parse_args(["serve-target"]), "x").stream_weights is True
    assert model_config(_parser().parse_args(["serve-draft"]), "x").stream_weights is None  # a draft decides by size
