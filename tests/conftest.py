"""Shared fixtures: a real redis-server, tiny models, and the real default model."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_model  # noqa: E402

from specdec.models import load_model  # noqa: E402

CACHE_DIR = Path.home() / ".cache" / "specdec"

# Target services the tests start serve eager passes: a background compile would take their two cores
# for minutes. tests/test_compiled.py builds the compiled pass itself.
os.environ.setdefault("SPECDEC_COMPILE", "off")


@pytest.fixture(scope="session", autouse=True)
def _threads():
    # Tests share two cores with the servers they start; one torch thread each avoids oversubscription.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a free loopback port for the whole session."""
    server = shutil.which("redis-server")
    assert server, "redis-server is missing: run `make install`"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(tmp_path_factory.mktemp("redis") / "redis.log", "wb")
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """Folder holding tiny target and draft models that share one tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    make_model(root / "target", seed=0)
    make_model(root / "draft", seed=1, layers=1)
    return root


@pytest.fixture(scope="session")
def tiny_target(tiny_dir):
    """The tiny target, loaded."""
    return load_model(str(tiny_dir / "target"), tiny_dir)


@pytest.fixture(scope="session")
def tiny_draft(tiny_dir):
    """The tiny draft (a different random model), loaded."""
    return load_model(str(tiny_dir / "draft"), tiny_dir)


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct, converted once into the cache."""
    return load_model("default", CACHE_DIR)
