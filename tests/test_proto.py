"""The committed stubs are what `make proto` generates from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto" / "specdec" / "v1").glob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            *protos,
        ],
        cwd=ROOT,
        check=True,
    )
    generated = sorted((tmp_path / "specdec" / "v1").iterdir())
    assert generated, "protoc produced nothing"
    for path in generated:
        committed = ROOT / "specdec" / "v1" / path.name
        assert committed.read_text() == path.read_text(), f"{path.name} is stale: run `make proto`"
