"""The `specdec` command: `up` starts a whole stack and stops every process it started on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specdec import Client
from specdec.host import tcmalloc
from specdec.stack import child_env, free_port


def _processes_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def test_up_serves_and_sigterm_stops_everything(tiny_dir, tmp_path):
    port = free_port()
    marker = str(tmp_path / "cache")  # a unique string on every child's command line
    model = str(tiny_dir / "target")
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "up",
            "--port",
            str(port),
            "--cache-dir",
            marker,
            "--target-model",
            model,
            "--draft-kind",
            "model",
            "--draft-model",
            model,
            "--target-threads",
            "1",
            "--http-port",
            "0",
            "--served-model-name",
            "smol",
            "--allowed-origins",
            "https://app.example.com",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while b"specdec is up" not in (tmp_path / "up.log").read_bytes():
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "stack did not come up"
            time.sleep(0.2)
        assert len(_processes_mentioning(marker)) >= 3  # draft, target, coordinator
        if tcmalloc() is not None:  # the Makefile installs it: the model services run on it
            for pid in _processes_mentioning(marker):
                cmdline, environ = (Path(f"/proc/{pid}/{f}").read_bytes() for f in ("cmdline", "environ"))
                preloaded = f"LD_PRELOAD={tcmalloc()}".encode() in environ.split(b"\0")
                assert preloaded == (b"serve-target" in cmdline or b"serve-draft" in cmdline), cmdline
        with Client(f"127.0.0.1:{port}") as client:
            assert client.complete("w1 w2 w3", max_new_tokens=5).token_ids
        # The HTTP API's options reach the coordinator: the alias is listed, the origin answered.
        api = re.search(rb"OpenAI API at (http://\S+/v1)", (tmp_path / "up.log").read_bytes()).group(1).decode()
        with urllib.request.urlopen(f"{api}/models", timeout=30) as response:
            assert "smol" in [m["id"] for m in json.load(response)["data"]]
        preflight = urllib.request.Request(
            f"{api}/chat/completions",
            method="OPTIONS",
            headers={"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"},
        )
        with urllib.request.urlopen(preflight, timeout=30) as response:
            assert response.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) is not None
        deadline = time.monotonic() + 30
        while _processes_mentioning(marker):
            assert time.monotonic() < deadline, f"left running: {_processes_mentioning(marker)}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_the_coordinator_needs_no_torch(tiny_dir):
    """The coordinator only tokenizes and routes: importing it and loading its tokenizer must not pull
    in torch, which would cost it seconds of start-up and hundreds of MB on every replica."""
    code = (
        "import sys; from pathlib import Path; import coordinator.server, specdec.cli; "
        "from specdec.vocab import load_tokenizer, tokenizer_fingerprint; "
        "tokenizer_fingerprint(load_tokenizer(Path(sys.argv[1]))); "
        "print(sorted(m for m in ('torch', 'transformers.modeling_utils') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tiny_dir / "target")],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_target_spins_briefly_and_the_draft_sleeps_unless_the_environment_says(monkeypatch):
    from specdec.stack import TARGET_SPIN_COUNT

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    target, draft = child_env(2, passive=False), child_env(1, passive=True)
    assert target["GOMP_SPINCOUNT"] == TARGET_SPIN_COUNT and "OMP_WAIT_POLICY" not in target
    assert draft["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in draft
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert child_env(2, passive=False)["GOMP_SPINCOUNT"] == "300000"
    assert "GOMP_SPINCOUNT" not in child_env(1, passive=True)  # it would outrank PASSIVE in libgomp
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own policy stands
    assert "GOMP_SPINCOUNT" not in child_env(2, passive=False)


def test_tcmalloc_is_preloaded_where_installed_unless_refused(tmp_path, monkeypatch):
    from specdec import cli

    library = tmp_path / "libtcmalloc_minimal.so.4"
    library.touch()
    assert tcmalloc((tmp_path / "missing.so", library)) == library
    assert tcmalloc((tmp_path / "missing.so",)) is None
    monkeypatch.setenv("LD_PRELOAD", "libother.so")
    assert child_env(2, False, library)["LD_PRELOAD"] == f"{library} libother.so"
    assert child_env(2, False)["LD_PRELOAD"] == "libother.so"
    monkeypatch.setattr(cli, "tcmalloc", lambda: library)
    parse = cli._parser().parse_args
    assert cli.stack_config(parse(["up"]), 0).preload == library
    assert cli.stack_config(parse(["up", "--no-tcmalloc"]), 0).preload is None
