"""How specdec is packaged: the shared package imports no service, the client SDK runs without the
server extra, the commands come from entry points, and the shipped drafts and prompts are package data."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from bench.single import PROMPTS
from specdec import cli
from specdec.config import SHIPPED_DRAFTS, default_draft_model, shipped_draft
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
# Packages built on top of specdec/: the shared package never imports them.
ABOVE_SPECDEC = {"coordinator", "draft_service", "target_service", "bench"}
# Top-level modules of the server and train extras (pyproject.toml), none of which the SDK may need.
SERVER_MODULES = (
    "torch",
    "transformers",
    "gguf",
    "accelerate",
    "safetensors",
    "numpy",
    "grpc_health",
    "grpc_reflection",
    "prometheus_client",
    "redis",
    "opentelemetry",
    "kubernetes",
    "tqdm",
)
CLIENT_COMMANDS = {"up", "generate"}


def _imported(tree: ast.AST) -> set[str]:
    """Top-level names of every module a parsed file imports, function-local imports included."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_shared_package_imports_no_service_and_no_benchmark():
    offending = {}
    for path in sorted((ROOT / "specdec").rglob("*.py")):
        found = _imported(ast.parse(path.read_text(), str(path))) & ABOVE_SPECDEC
        if found:
            offending[str(path.relative_to(ROOT))] = sorted(found)
    assert offending == {}


class _Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """A coordinator that streams the same two chunks to any request."""

    def Generate(self, request, context):
        yield coordinator_pb2.GenerateChunk(text="Hello", token_ids=[1], session_id="s1")
        stats = coordinator_pb2.GenerationStats(generated_tokens=2, rounds=1, total_ms=20.0)
        yield coordinator_pb2.GenerateChunk(
            text=" world", token_ids=[2], session_id="s1", finish_reason="length", stats=stats
        )


# Run in a child process: every module of the server extra fails to import, as on an SDK-only install.
_WITHOUT_SERVER_EXTRA = """
import sys

BLOCKED = set(sys.argv[2].split(","))


class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, Blocker())
import specdec.client
from specdec import cli

cli.main(["generate", "--address", sys.argv[1], "--max-new-tokens", "2", "hi"])
print("loaded:", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""


def test_the_client_and_specdec_generate_run_without_the_server_extra(tmp_path):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(_Coordinator(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        out = subprocess.run(
            [sys.executable, "-c", _WITHOUT_SERVER_EXTRA, f"127.0.0.1:{port}", ",".join(SERVER_MODULES)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
    finally:
        server.stop(0)
    assert out.returncode == 0, out.stderr
    assert "Hello world\n\n[finish: length] 2 tokens" in out.stdout
    assert out.stdout.strip().endswith("loaded: []")


def _commands() -> set[str]:
    """The subcommands ``specdec`` offers."""
    parser = cli._parser()
    return set(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


def test_commands_come_from_entry_points_and_need_their_extra(monkeypatch):
    registered = _commands()
    assert {e.name for e in importlib.metadata.entry_points(group=cli.COMMANDS)} == {
        "bench",
        "coordinator",
        "distill",
        "draft",
        "target",
    }
    assert registered == CLIENT_COMMANDS | {
        "serve-coordinator",
        "serve-draft",
        "serve-target",
        "convert",
        "distill",
        "distill-data",
        "bench",
        "pass-grid",
        "pass-curve",
        "tree-ceiling",
    }

    # An SDK-only install: torch, required by the server extra, is missing.
    installed = importlib.metadata.distribution

    def distribution(name: str):
        if name == "torch":
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    cli.extra_installed.cache_clear()
    try:
        assert _commands() == CLIENT_COMMANDS
    finally:
        cli.extra_installed.cache_clear()


def test_shipped_drafts_and_prompts_are_found_as_package_data():
    for kind, name in SHIPPED_DRAFTS.items():
        folder = shipped_draft(name)
        assert default_draft_model(kind) == str(folder)
        assert (folder / "draft.safetensors").is_file() and (folder / "draft_card.json").is_file()
    assert default_draft_model("ngram") == "default"
    assert PROMPTS.is_file() and PROMPTS.read_text().strip()


def test_a_default_draft_speaks_the_target_named():
    # n-gram lookup proposes in the target's own tokenizer; the shipped drafts fit the default target only.
    assert default_draft_model("ngram", "/models/other") == "/models/other"
    for kind in SHIPPED_DRAFTS:
        with pytest.raises(ValueError, match="--draft-model"):
            default_draft_model(kind, "/models/other")


def test_the_wheel_holds_the_package_data_and_the_commands(tmp_path):
    """Built from a copy of the tree, the wheel carries what is looked up as package data, and its
    base requirements are the client's alone."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("specdec", "coordinator", "draft_service", "target_service", "bench", "drafts"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("specdec-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        files = set(archive.namelist())
        info = next(n for n in files if n.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        metadata = archive.read(f"{info}/METADATA").decode()
    assert {"bench/__init__.py", "bench/prompts.jsonl", "drafts/__init__.py"} <= files
    for name in SHIPPED_DRAFTS.values():
        assert {f"drafts/{name}/draft.safetensors", f"drafts/{name}/draft_card.json"} <= files
    assert "[specdec.commands]" in entry_points and "target = target_service.cli:register" in entry_points
    base = [
        line.split(": ", 1)[1]
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert sorted(r.split("==")[0] for r in base) == ["grpcio", "protobuf"]
