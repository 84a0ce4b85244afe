"""A specdec cluster of real processes on loopback, for fault injection.

redis-server, draft and target replicas and coordinators each run as a child process on a port
fixed at start, so a test can kill, freeze or restart any of them and the others find it again at
the same address. ``Models.tiny`` runs the tiny random models (a fault lands mid-stream within
seconds); ``Models.default`` runs what `specdec up` runs: SmolLM2-135M-Instruct with the shipped
feature draft, k chosen per round and the CLI's own deadlines.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from specdec import Client, RetryPolicy
from specdec.config import FEATURE_KIND, default_draft_model
from specdec.stack import Process, child_env, free_port, redis_argv, wait_for_line, wait_for_redis


@dataclass(frozen=True)
class Models:
    """What the replicas serve, and the coordinator settings that go with it."""

    target: str
    draft_kind: str
    draft: str
    cache_dir: Path
    # Coordinator flags: the draft length ("auto": chosen per round) and the deadlines (None: the CLI's).
    default_k: str = "auto"
    rpc_timeout_s: float | None = None
    draft_timeout_s: float | None = None
    # Seconds a replica may take to load and warm up.
    startup_s: float = 120.0

    @classmethod
    def tiny(cls, tiny_dir: Path) -> Models:
        """The tiny random target and a one-layer token draft; k 3 and short deadlines, so a hung
        replica costs a stream a second or two."""
        return cls(
            str(tiny_dir / "target"),
            "model",
            str(tiny_dir / "draft"),
            tiny_dir,
            default_k="3",
            rpc_timeout_s=2.0,
            draft_timeout_s=1.0,
        )

    @classmethod
    def default(cls, cache_dir: Path) -> Models:
        """The embedded default model and its shipped feature draft, with the CLI's defaults."""
        return cls("default", FEATURE_KIND, default_draft_model(FEATURE_KIND), cache_dir, startup_s=300.0)


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
        models: Models,
        log_dir: Path,
        drafts: int = 2,
        targets: int = 2,
        coordinators: int = 2,
        grace_s: float = 5.0,
        session_ttl_s: int = 20,
        cache_idle_s: float = 8.0,
    ) -> None:
        self.models = models
        self.log_dir = log_dir
        self.members: dict[str, Member] = {}
        self._ports: set[int] = set()
        exe = [sys.executable, "-m", "specdec.cli"]
        redis_port = self._free_port()
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self._add("redis", redis_argv(redis_port), redis_port)
        common = [
            "--cache-dir",
            str(models.cache_dir),
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
                    models.target,
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
                    models.draft_kind,
                    "--model",
                    models.draft,
                    "--target-model",
                    models.target,
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
        deadlines = [
            *(["--rpc-timeout", str(models.rpc_timeout_s)] if models.rpc_timeout_s else []),
            *(["--draft-timeout", str(models.draft_timeout_s)] if models.draft_timeout_s else []),
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
                    models.target,
                    "--redis-url",
                    self.redis_url,
                    "--default-k",
                    models.default_k,
                    *deadlines,
                    "--grace",
                    str(grace_s),
                    "--session-ttl",
                    str(session_ttl_s),
                    # Every process shares this machine's cores.
                    "--draft-colocated",
                    "--cache-dir",
                    str(models.cache_dir),
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
            wait_for_line(member.process, "READY ", self.models.startup_s)

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

    def busiest(self, role: str) -> str:
        """The running ``role`` replica ("draft", "target") holding the most session caches now: the
        one whose loss the most sessions see."""
        names = [n for n in self.members if n.rstrip("0123456789") == role and self.alive(n)]
        return max(names, key=lambda n: self.metric(n, "specdec:active_sessions"))

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
        """Stops every process: the coordinators together, then the rest together."""
        running = [m.process for m in self.members.values() if m.process is not None]
        first = [p for p in running if p.name.startswith("coordinator")]
        for group in (first, [p for p in running if p not in first]):
            with ThreadPoolExecutor(max(1, len(group))) as pool:
                list(pool.map(lambda process: process.stop(timeout_s=5.0), group))

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class Ask:
    """One request a client stream sends: a prompt, greedy or seeded sampled."""

    prompt: str
    sampled: bool = False


@dataclass
class StreamResult:
    """What one client stream received, and how it ended."""

    ask: Ask
    tokens: list[int] = field(default_factory=list)
    error: Exception | None = None
    # Monotonic times: the request sent, every chunk's arrival, the stream's end.
    started: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    ended: float | None = None

    def in_flight_at(self, moment: float) -> bool:
        """Whether the request was sent before ``moment`` and still running at it."""
        return self.started < moment and (self.ended is None or self.ended > moment)

    def gap_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the first chunk after it (None: none came)."""
        later = [t for t in self.arrivals if t >= moment]
        return later[0] - moment if later else None


class Streams:
    """Client streams running in threads, each with the SDK pointed at every coordinator.

    Each thread sends its ``Ask`` once, or, given ``until``, again and again until that is set.
    ``sampling`` is what a sampled ask adds to its request (temperature and seed).
    """

    def __init__(
        self,
        addresses: list[str],
        asks: list[Ask],
        max_new_tokens: int,
        sampling: dict,
        until: threading.Event | None = None,
    ) -> None:
        self.runs: list[StreamResult] = []
        self._received = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(addresses, ask, max_new_tokens, sampling, until), daemon=True)
            for ask in asks
        ]

    def _run(self, addresses, ask: Ask, max_new_tokens: int, sampling: dict, until: threading.Event | None) -> None:
        retry = RetryPolicy(attempts=30, backoff_s=0.05, max_backoff_s=0.5)
        options = sampling if ask.sampled else {}
        with Client(addresses, timeout=120, retry=retry) as client:
            while True:
                result = StreamResult(ask, started=time.monotonic())
                with self._lock:
                    self.runs.append(result)
                try:
                    for chunk in client.stream(ask.prompt, max_new_tokens=max_new_tokens, **options):
                        result.tokens.extend(chunk.token_ids)
                        result.arrivals.append(time.monotonic())
                        with self._lock:
                            self._received += len(chunk.token_ids)
                except Exception as exc:  # noqa: BLE001 - the test reports every failure
                    result.error = exc
                result.ended = time.monotonic()
                if until is None or until.is_set():
                    return

    def start(self) -> Streams:
        """Starts every stream."""
        for thread in self._threads:
            thread.start()
        return self

    @property
    def received(self) -> int:
        """Tokens the streams received so far, together."""
        return self._received

    def wait_received(self, tokens: int, timeout_s: float = 120.0) -> None:
        """Blocks until the streams together received ``tokens`` tokens."""
        deadline = time.monotonic() + timeout_s
        while self._received < tokens:
            assert time.monotonic() < deadline, f"streams stalled at {self._received} tokens"
            time.sleep(0.005)

    def join(self, timeout_s: float = 300.0) -> list[StreamResult]:
        """Waits for every stream to end; returns every request's result."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), "a stream hung"
        return self.runs


def write_report(path: str | None, section: str, entries: dict) -> None:
    """Merges ``entries`` into ``section`` of the JSON report at ``path`` (nothing when None), so the
    fault runs, the real-model faults, the fuzz and the soak each refresh their own part of one file."""
    if not path:
        return
    import json
    import os

    target = Path(path)
    try:
        report = json.loads(target.read_text())
    except (OSError, ValueError):
        report = {}
    report.setdefault(section, {}).update(entries)
    report["host"] = {"cores": os.cpu_count()}
    report["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2) + "\n")
