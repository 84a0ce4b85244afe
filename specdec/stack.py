"""A local stack on loopback: redis-server, draft, target and coordinator as child processes.

Used by ``specdec up``, ``specdec generate --local`` and the end-to-end tests. Logs go to files, not
pipes, so a chatty child can never block; every child is stopped when the stack closes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.config import DEFAULT_DRAFT_KIND, default_cache_dir, default_draft_model


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that are free right now (all bound at once, so no two
    are the same)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


@dataclass(frozen=True)
class StackConfig:
    """What a local stack runs."""

    target_model: str = "default"
    draft_kind: str = DEFAULT_DRAFT_KIND
    # None: the draft shipped for the default target (specdec.config.SHIPPED_DRAFTS).
    draft_model: str | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    coordinator_port: int = 0
    target_threads: int = 2
    # Processes the target is sharded over (tensor parallelism); each gets target_threads threads.
    target_tp: int = 1
    # The draft's torch threads; None: auto, from the draft's size (``draft_service.server.auto_draft_threads``).
    draft_threads: int | None = None
    # None: the coordinator picks k each round.
    default_k: int | None = None
    # With k auto, the draft stops where its confidence no longer pays (see CoordinatorConfig).
    confidence_cutoff: bool = True
    # Tokens the draft drafts ahead while a lone session's round is verified (see CoordinatorConfig).
    draft_ahead: int = 0
    # Most nodes of a round's token tree (0: chains only; see CoordinatorConfig).
    tree_nodes: int = 15
    # Under load the target feeds a new prompt in its session's first verify pass (see TargetConfig).
    fold_prefills: bool = True
    # Tokens of a long prompt the target feeds a pass (see TargetConfig.prefill_chunk).
    prefill_chunk: int = 128
    otlp_endpoint: str | None = None
    startup_timeout_s: float = 300.0
    # Extra coordinators sharing the same services and Redis (tests of session hand-over).
    extra_coordinators: int = 0
    # Port of the first coordinator's OpenAI-compatible HTTP API; 0 picks a free one, None serves none.
    http_port: int | None = None
    # What target and draft compute in (``specdec.config.MODEL_DTYPES``); None: each service's own
    # default (its --dtype default, env SPECDEC_DTYPE / SPECDEC_DRAFT_DTYPE, else auto).
    dtype: str | None = None
    # The target's --compile (``specdec.config.COMPILE_MODES``); None: its default (env SPECDEC_COMPILE,
    # else background).
    compile: str | None = None
    # The coordinator's --chat-template (a name or a Jinja file); None: the tokenizer's own.
    chat_template: str | None = None
    # The target's --metrics-port (Prometheus over HTTP; 0 picks a free one); None serves none.
    target_metrics_port: int | None = None
    # Target's and draft's --prefix-reuse; None: their default. Benchmarks that send the same prompt
    # in several modes set 0, or whichever mode runs a prompt second would skip its prefill.
    prefix_reuse: int | None = None
    # A library the model services preload: tcmalloc where the host has it (``specdec.host.tcmalloc``),
    # which makes an eager pass's many small allocations cheaper. None: the system allocator.
    preload: Path | None = None
    # The HTTP API's extra model names and CORS origins (the coordinator's --served-model-name and
    # --allowed-origins, comma-separated values each).
    served_model_names: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()


class Process:
    """One child process whose output goes to a log file."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def log_tail(self, lines: int = 30) -> str:
        """The last lines the process wrote."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        terminate(self.popen, timeout_s)
        self._log.close()


def terminate(popen: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to a child process, then SIGKILL if it has not exited within ``timeout_s``."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def wait_for_line(proc: Process, prefix: str, timeout_s: float) -> str:
    """The rest of the first log line of ``proc`` that starts with ``prefix`` (``READY`` announces
    a server's address), waiting up to ``timeout_s``; raises if the process exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in proc.log_path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        time.sleep(0.1)
    raise TimeoutError(f"{proc.name} did not start within {timeout_s:.0f}s:\n{proc.log_tail()}")


def redis_argv(port: int) -> list[str]:
    """A redis-server on loopback ``port`` that keeps nothing on disk."""
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("redis-server is not installed (make install puts it there)")
    return [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def wait_for_redis(proc: Process, port: int, timeout_s: float = 20.0) -> None:
    """Waits until the redis-server ``proc`` answers PING on ``port``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not start:\n{proc.log_tail()}")


TARGET_SPIN_COUNT = "10000"
"""The target's ``GOMP_SPINCOUNT`` where the environment sets none (``child_env``)."""


def child_env(threads: int, passive: bool, preload: Path | None = None) -> dict[str, str]:
    """The environment of a service child process: its thread count, whether idle threads sleep, and
    a library to preload (the allocator, ``StackConfig.preload``)."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"})
    if preload is not None:
        env["LD_PRELOAD"] = " ".join(filter(None, (str(preload), env.get("LD_PRELOAD"))))
    if passive:
        # The draft waits while the target verifies: its idle OpenMP threads must sleep, not spin. An
        # explicit GOMP_SPINCOUNT would outrank the policy in libgomp, so none passes through.
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        env.pop("GOMP_SPINCOUNT", None)
    elif "OMP_WAIT_POLICY" not in env:
        # The target's threads spin briefly between ops (sleeping between its ~500 ops per pass measured
        # 10-15% slower here), but not for libgomp's default 300,000 turns, which also spin between
        # passes while the coordinator and the draft work (``make bench-spin``).
        env.setdefault("GOMP_SPINCOUNT", TARGET_SPIN_COUNT)
    return env


class LocalStack:
    """Starts the whole system on loopback; use as a context manager."""

    def __init__(self, config: StackConfig, log_dir: Path | None = None) -> None:
        self.config = config
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="specdec-stack-"))
        self.processes: list[Process] = []
        self.redis_url = ""
        self.draft_address = ""
        self.target_address = ""
        self.coordinator_addresses: list[str] = []
        # host:port of the first coordinator's OpenAI API, when the config serves it.
        self.http_address = ""

    @property
    def address(self) -> str:
        """The (first) coordinator's address."""
        return self.coordinator_addresses[0]

    def _spawn(
        self, name: str, argv: list[str], threads: int = 1, passive: bool = True, model: bool = False
    ) -> Process:
        # Only the model services (``model``) run torch, which the preloaded allocator is for.
        preload = self.config.preload if model else None
        proc = Process(name, argv, self.log_dir, child_env(threads, passive, preload))
        self.processes.append(proc)
        return proc

    def _wait_for_line(self, proc: Process, prefix: str) -> str:
        return wait_for_line(proc, prefix, self.config.startup_timeout_s)

    def _start_redis(self) -> None:
        port = free_port()
        wait_for_redis(self._spawn("redis", redis_argv(port)), port)
        self.redis_url = f"redis://127.0.0.1:{port}/0"

    def start(self) -> LocalStack:
        """Starts every process and waits until the coordinator serves."""
        c = self.config
        exe = [sys.executable, "-m", "specdec.cli"]
        common = ["--cache-dir", str(c.cache_dir)] + (["--otlp-endpoint", c.otlp_endpoint] if c.otlp_endpoint else [])
        dtype = ["--dtype", c.dtype] if c.dtype else []
        compile_mode = ["--compile", c.compile] if c.compile else []
        reuse = [] if c.prefix_reuse is None else ["--prefix-reuse", str(c.prefix_reuse)]
        try:
            self._start_redis()
            # Ports are chosen here so that the coordinators can start beside the services: each waits
            # for its replicas to be ready, and importing it overlaps their loading the models.
            target_port, draft_port = free_ports(2)
            self.target_address, self.draft_address = f"127.0.0.1:{target_port}", f"127.0.0.1:{draft_port}"
            target = self._spawn(
                "target",
                [
                    *exe,
                    "serve-target",
                    "--port",
                    str(target_port),
                    "--model",
                    c.target_model,
                    "--threads",
                    str(c.target_threads),
                    "--tp",
                    str(c.target_tp),
                    "--prefill-chunk",
                    str(c.prefill_chunk),
                    *([] if c.fold_prefills else ["--no-fold-prefills"]),
                    *([] if c.target_metrics_port is None else ["--metrics-port", str(c.target_metrics_port)]),
                    *dtype,
                    *compile_mode,
                    *reuse,
                    *common,
                ],
                c.target_threads,
                passive=False,
                model=True,
            )
            draft = self._spawn(
                "draft",
                [
                    *exe,
                    "serve-draft",
                    "--port",
                    str(draft_port),
                    "--kind",
                    c.draft_kind,
                    "--model",
                    c.draft_model or default_draft_model(c.draft_kind, c.target_model),
                    "--target-model",
                    c.target_model,
                    "--threads",
                    "auto" if c.draft_threads is None else str(c.draft_threads),
                    *dtype,
                    *reuse,
                    *common,
                ],
                # Auto may take every core: the OpenMP default must not cap what the draft then sets.
                len(os.sched_getaffinity(0)) if c.draft_threads is None else c.draft_threads,
                model=True,
            )
            coordinators = []
            http = []
            if c.http_port is not None:
                http_port = c.http_port or free_port()
                http, self.http_address = ["--http-port", str(http_port)], f"127.0.0.1:{http_port}"
                http += [arg for name in c.served_model_names for arg in ("--served-model-name", name)]
                http += [arg for origins in c.allowed_origins for arg in ("--allowed-origins", origins)]
            for i in range(1 + c.extra_coordinators):
                port = c.coordinator_port if i == 0 else 0
                coordinator = self._spawn(
                    f"coordinator{i}",
                    [
                        *exe,
                        "serve-coordinator",
                        "--port",
                        str(port),
                        "--draft",
                        self.draft_address,
                        "--target",
                        self.target_address,
                        "--redis-url",
                        self.redis_url,
                        "--tokenizer",
                        c.target_model,
                        "--default-k",
                        "auto" if c.default_k is None else str(c.default_k),
                        # Every process of a local stack shares this machine's cores.
                        "--draft-colocated",
                        *([] if c.confidence_cutoff else ["--no-confidence-cutoff"]),
                        "--draft-ahead",
                        str(c.draft_ahead),
                        "--tree-nodes",
                        str(c.tree_nodes),
                        *([] if c.chat_template is None else ["--chat-template", c.chat_template]),
                        *(http if i == 0 else []),
                        *common,
                    ],
                )
                coordinators.append(coordinator)
            self._wait_for_line(target, "READY ")
            self._wait_for_line(draft, "READY ")
            self.coordinator_addresses = [self._wait_for_line(proc, "READY ") for proc in coordinators]
        except BaseException:
            self.close()
            raise
        return self

    def process(self, name: str) -> Process:
        """The child process called ``name``."""
        return next(p for p in self.processes if p.name == name)

    def close(self) -> None:
        """Stops every child, coordinators first."""
        for proc in reversed(self.processes):
            proc.stop()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
