"""Whether a memory allocator or an OpenMP setting pays for the target's pass (``make bench-allocators``).

An eager pass makes thousands of small tensors, so the allocator behind them and how OpenMP's idle
threads wait can cost as much as a kernel. This runs ``specdec pass-curve`` (one dtype) in a child
process per setting, each setting twice in the order A B C D D C B A so a shared machine's drift falls
on all alike (``--rounds`` times), and reports each setting's median pass by rows beside the default's.

    python -m bench.allocators --out reports/allocators.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.alternating import alternate, chosen_settings, write_report

# Debian's libtcmalloc-minimal4 (the Makefile and the container image install it).
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
# Each setting's environment on top of the caller's; the rows each report compares.
VARIANTS = {
    "default": {},
    "tcmalloc": {"LD_PRELOAD": TCMALLOC},
    "omp-active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "tcmalloc+omp-active": {"LD_PRELOAD": TCMALLOC, "OMP_WAIT_POLICY": "ACTIVE"},
}
KEYS = ("1", "8", "8x1")


def run_variant(env: dict[str, str], args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One ``specdec pass-curve`` in a child with ``env`` added; its pass medians by rows (``KEYS``)."""
    argv = [sys.executable, "-m", "specdec.cli", "pass-curve", "--dtypes", args.dtype]
    argv += ["--repeats", str(args.repeats), "--cache-dir", str(args.cache_dir), "--out", str(out)]
    argv += ["--compiled"] if args.compiled else []
    subprocess.run(argv, env=os.environ | env, check=True, stdout=subprocess.DEVNULL)
    engine = f"{args.dtype}-compiled" if args.compiled else args.dtype
    curve = json.loads(out.read_text())["engines"][engine]["pass_ms"]
    return {key: curve[key] for key in KEYS}


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict:
    """Per setting: the median over its runs of each row count's pass, and default's over it."""
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in KEYS} for name, rs in runs.items()}
    base = medians["default"]
    return {
        name: {"pass_ms": m, "speedup_vs_default": {key: round(base[key] / m[key], 3) for key in KEYS}}
        for name, m in medians.items()
    }


def main(argv: list[str] | None = None) -> None:
    """Runs every setting A B .. B A and writes the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5, help="timed sweeps of each child's pass-curve")
    p.add_argument("--rounds", type=int, default=2, help="A B .. B A rounds: each setting runs twice a round")
    p.add_argument("--compiled", action="store_true", help="time the compiled pass, as the target serves")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated settings (default first)")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "specdec")
    p.add_argument("--out", type=Path, default=Path("specdec-allocators.json"))
    args = p.parse_args(argv)
    if not Path(TCMALLOC).is_file():
        raise SystemExit(f"{TCMALLOC} is missing: apt-get install libtcmalloc-minimal4")
    variants = chosen_settings(VARIANTS, args.variants, "default")
    with tempfile.TemporaryDirectory() as scratch:
        runs = alternate(
            list(variants), args.rounds, lambda name, i: run_variant(variants[name], args, Path(scratch) / f"{i}.json")
        )
    config = {"dtype": args.dtype, "compiled": args.compiled, "repeats": args.repeats, "rounds": args.rounds}
    config["variants"] = variants
    write_report(args.out, config, runs, summarize(runs))


if __name__ == "__main__":
    main()
