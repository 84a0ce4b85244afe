"""Builds the target's compiled pass in a process of its own, at the lowest CPU priority, so that its
artifacts land in inductor's on-disk cache while the serving process keeps its cores.

A cold build traces, lowers and compiles C++ for minutes, and inside the serving process it would
hold the interpreter lock for most of that time: on the 2-core development box a served request
took 30 to 50 s instead of about one while the build ran on a thread beside the eager passes. Built
here first, the serving process's own build then loads every graph from the cache (about 20 s for
the default target's six buckets).

``python -m target_service.compile_ahead --model M --cache-dir D --dtype T --threads N --buckets 2,4``
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from specdec.config import ModelConfig

log = logging.getLogger("specdec.target")


def argv(model: ModelConfig, buckets: tuple[int, ...]) -> list[str]:
    """The command that builds ``model``'s compiled pass over ``buckets`` ahead, in a child process."""
    return [
        sys.executable,
        "-m",
        "target_service.compile_ahead",
        "--model",
        model.model,
        "--cache-dir",
        str(model.cache_dir),
        "--dtype",
        model.dtype,
        "--threads",
        str(model.threads),
        "--buckets",
        ",".join(map(str, buckets)),
    ]


def build_ahead(model: ModelConfig, buckets: tuple[int, ...]) -> bool:
    """Runs the child build and waits for it; returns whether it succeeded (its output goes to this
    process's log). The caller's environment names inductor's cache (``keep_artifacts_in``)."""
    done = subprocess.run(argv(model, buckets), check=False)
    if done.returncode != 0:
        log.warning("building the compiled pass ahead exited with %d; building it in process", done.returncode)
    return done.returncode == 0


def main() -> None:
    """The child: load the target as the service does, then build every bucket's graph."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--cache-dir", type=Path, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--buckets", required=True, help="comma-separated row counts")
    args = p.parse_args()
    os.nice(19)  # after the serving process's every pass

    import torch

    from specdec.compiled import build_compiled
    from specdec.models import load_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.cache_dir, dtype=args.dtype, pack=True)
    build_compiled(loaded.model, args.cache_dir, tuple(int(b) for b in args.buckets.split(",")))


if __name__ == "__main__":
    main()
