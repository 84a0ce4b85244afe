"""The one thread a service runs its model on, from loading to the last pass.

PyTorch's OpenMP on Linux (libgomp) gives every thread that runs a parallel region a team of helper
threads of its own, and once it manages more threads than the process may use CPUs, its helpers stop
spinning between regions and sleep on a futex instead. A service that loaded and warmed its model
on the main thread and served it from a worker thread owned two teams: on the 2-core development
CPU with 2 threads, each of a pass's ~500 parallel regions then waited for a helper to wake, and the
default target's one-token pass took 45 instead of 37 ms (medians of 40 passes, in-process: worker
thread after loading on the main thread, against everything on one thread).

So a service loads, packs, warms and serves its model on one worker thread (``model_executor``), and
its event loop's thread runs no parallel torch op: hidden states cross the wire through numpy
(``specdec.hidden_wire``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def model_executor(name: str) -> ThreadPoolExecutor:
    """The single worker thread that runs every model call of one service."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


def on_model_thread(executor: ThreadPoolExecutor, threads: int, build: Callable[[], T]) -> T:
    """Runs ``build`` (loading and warming a model) on ``executor``'s thread with ``threads`` intra-op
    threads, and returns what it built."""

    def run() -> T:
        torch.set_num_threads(threads)
        return build()

    return executor.submit(run).result()
