"""A specdec cluster of real processes on loopback, for fault injection.

redis-server, draft and target replicas and coordinators each run as a child process on a port
fixed at start, so a test can kill, freeze or restart any of them and the others find it again at
the same address. Models are the tiny random ones, so a fault lands mid-stream within seconds.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdec import Client, RetryPolicy
from specdec.stack import Process, child_env, free_port, redis_argv, wait_for_line, wait_for_redis


@dataclass
class Member:
    """One process of the cluster and how to start it again."""

    name: str
    argv: list[str]
    port: int
    process: Process | None = None
    starts: int = 0


class Cluster:
    """``drafts`` draft and ``targets`` target replicas behind ``coordinators`` coordinators."""

    def __init__(
        self,
        tiny_dir: Path,
        log_dir: Path,
        drafts: int = 2,
        targets: int = 2,
        coordinators: int = 2,
        default_k: int = 3,
        rpc_timeout_s: float = 2.0,
        grace_s: float = 5.0,
        session_ttl_s: int = 20,
        cache_idle_s: float = 8.0,
    ) -> None:
        self.log_dir = log_dir
        self.members: dict[str, Member] = {}
        self._ports: set[int] = set()
        exe = [sys.executable, "-m", "specdec.cli"]
        redis_port = self._free_port()
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self._add("redis", redis_argv(redis_port), redis_port)
        target, draft = str(tiny_dir / "target"), str(tiny_dir / "draft")
        common = [
            "--cache-dir",
            str(tiny_dir),
            "--threads",
            "1",
            "--grace",
            str(grace_s),
            "--cache-idle",
            str(cache_idle_s),
        ]
        for i in range(targets):
            port = self._free_port()
            self._add(
                f"target{i}",
                [
                    *exe,
                    "serve-target",
                    "--port",
                    str(port),
                    "--model",
                    target,
                    "--metrics-port",
                    str(self._free_port()),
                    *common,
                ],
                port,
            )
        for i in range(drafts):
            port = self._free_port()
            self._add(
                f"draft{i}",
                [
                    *exe,
                    "serve-draft",
                    "--port",
                    str(port),
                    "--kind",
                    "model",
                    "--model",
                    draft,
                    "--target-model",
                    target,
                    "--metrics-port",
                    str(self._free_port()),
                    *common,
                ],
                port,
            )
        backends = [
            arg
            for name, m in self.members.items()
            if name.startswith(("draft", "target"))
            for arg in (f"--{name.rstrip('0123456789')}", f"127.0.0.1:{m.port}")
        ]
        for i in range(coordinators):
            port = self._free_port()
            self._add(
                f"coordinator{i}",
                [
                    *exe,
                    "serve-coordinator",
                    "--port",
                    str(port),
                    "--tokenizer",
                    target,
                    "--redis-url",
                    self.redis_url,
                    "--default-k",
                    str(default_k),
                    "--rpc-timeout",
                    str(rpc_timeout_s),
                    "--grace",
                    str(grace_s),
                    "--session-ttl",
                    str(session_ttl_s),
                    "--cache-dir",
                    str(tiny_dir),
                    *backends,
                ],
                port,
            )

    def _free_port(self) -> int:
        # Each member keeps its port across restarts, so no two may share one.
        port = free_port()
        while port in self._ports:
            port = free_port()
        self._ports.add(port)
        return port

    def _add(self, name: str, argv: list[str], port: int) -> None:
        self.members[name] = Member(name, argv, port)

    @property
    def coordinators(self) -> list[str]:
        """Every coordinator's address."""
        return [f"127.0.0.1:{m.port}" for n, m in self.members.items() if n.startswith("coordinator")]

    def start(self) -> Cluster:
        """Starts every process at once (each member's port is fixed, and a coordinator waits for its
        replicas to be ready), then waits until all serve."""
        try:
            for name in self.members:
                self._spawn(name)
            for name in self.members:
                self._wait(name)
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, name: str) -> None:
        member = self.members[name]
        member.starts += 1
        member.process = Process(f"{name}.{member.starts}", member.argv, self.log_dir, child_env(1, passive=True))

    def _wait(self, name: str) -> None:
        member = self.members[name]
        if name == "redis":
            wait_for_redis(member.process, member.port)
        else:
            wait_for_line(member.process, "READY ", 120.0)

    def signal(self, name: str, sig: signal.Signals) -> None:
        """Sends ``sig`` to the process ``name`` (SIGKILL, SIGSTOP, SIGCONT, SIGTERM)."""
        self.members[name].process.popen.send_signal(sig)

    def kill(self, name: str) -> None:
        """SIGKILL, and waits for the process to be gone."""
        process = self.members[name].process
        process.popen.kill()
        process.popen.wait(10)

    def restart(self, name: str) -> None:
        """Starts ``name`` again on its port (stopping it first if it still runs) and waits until it serves."""
        process = self.members[name].process
        if process is not None:
            process.stop()
        self._spawn(name)
        self._wait(name)

    def rss_bytes(self, name: str) -> int:
        """Resident memory of the process ``name`` now."""
        pid = self.members[name].process.popen.pid
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for {name}")

    def metric(self, name: str, metric: str) -> float:
        """The value of ``metric`` on the metrics endpoint of service ``name``."""
        argv = self.members[name].argv
        port = argv[argv.index("--metrics-port") + 1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith(metric + " "):
                    return float(line.split()[1])
        raise KeyError(metric)

    def alive(self, name: str) -> bool:
        """Whether the process ``name`` is running."""
        process = self.members[name].process
        return process is not None and process.popen.poll() is None

    def log_tail(self, name: str) -> str:
        """The last lines ``name`` logged."""
        return self.members[name].process.log_tail()

    def logs(self, prefix: str) -> str:
        """Everything the processes whose names start with ``prefix`` logged, restarts included."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{prefix}*.log")))

    def close(self) -> None:
        """Stops every process, coordinators first."""
        for member in reversed(list(self.members.values())):
            if member.process is not None:
                member.process.stop(timeout_s=5.0)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class StreamResult:
    """What one client stream received, and how it ended."""

    tokens: list[int] = field(default_factory=list)
    error: Exception | None = None
    # Monotonic arrival time of every chunk, for recovery times.
    arrivals: list[float] = field(default_factory=list)

    def gap_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the first chunk after it (None: none came)."""
        later = [t for t in self.arrivals if t >= moment]
        return later[0] - moment if later else None


class Streams:
    """Client streams running in threads, each with the SDK pointed at every coordinator.

    Each thread streams its prompt once, or, given ``until``, again and again until that is set.
    """

    def __init__(
        self,
        addresses: list[str],
        prompts: list[str],
        max_new_tokens: int,
        until: threading.Event | None = None,
        **options,
    ) -> None:
        self.runs: list[tuple[str, StreamResult]] = []
        self._received = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(addresses, p, max_new_tokens, until, options), daemon=True)
            for p in prompts
        ]

    def _run(self, addresses, prompt: str, max_new_tokens: int, until: threading.Event | None, options) -> None:
        retry = RetryPolicy(attempts=30, backoff_s=0.05, max_backoff_s=0.5)
        with Client(addresses, timeout=120, retry=retry) as client:
            while True:
                result = StreamResult()
                with self._lock:
                    self.runs.append((prompt, result))
                try:
                    for chunk in client.stream(prompt, max_new_tokens=max_new_tokens, **options):
                        result.tokens.extend(chunk.token_ids)
                        result.arrivals.append(time.monotonic())
                        with self._lock:
                            self._received += len(chunk.token_ids)
                except Exception as exc:  # noqa: BLE001 - the test reports every failure
                    result.error = exc
                if until is None or until.is_set():
                    return

    def start(self) -> Streams:
        """Starts every stream."""
        for thread in self._threads:
            thread.start()
        return self

    def wait_received(self, tokens: int, timeout_s: float = 60.0) -> None:
        """Blocks until the streams together received ``tokens`` tokens."""
        deadline = time.monotonic() + timeout_s
        while self._received < tokens:
            assert time.monotonic() < deadline, f"streams stalled at {self._received} tokens"
            time.sleep(0.005)

    def join(self, timeout_s: float = 120.0) -> list[tuple[str, StreamResult]]:
        """Waits for every stream to end; returns each request's prompt and result."""
        for thread in self._threads:
            thread.join(timeout_s)
            assert not thread.is_alive(), "a stream hung"
        return self.runs
