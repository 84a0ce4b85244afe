"""Facts about the host a service runs on, read once at the edge: how much memory it may use, and
which allocator its model services should run on.

A container's limit is its cgroup's (``memory.max`` under cgroup v2, ``memory.limit_in_bytes``
under v1), which is the pod's limit in Kubernetes; outside one it is the machine's memory.
"""

from __future__ import annotations

import os
from pathlib import Path

# cgroup files that hold the memory limit, v2 then v1; v1 writes a huge number for "no limit".
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
# Where Debian's libtcmalloc-minimal4 (installed by the Makefile and the container image) puts it.
TCMALLOC_PATHS = (
    Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
    Path("/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4"),
)
# The share of its memory a model service gives its session caches by default: the weights, the
# activations and, on one machine, the other services need the rest.
KV_SHARE = 1 / 3


def memory_limit_bytes(cgroup_files: tuple[Path, ...] = _CGROUP_LIMITS) -> int:
    """The memory this process may use: its cgroup's limit where one is set, else the machine's."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in cgroup_files:
        try:
            raw = path.read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < physical:
            return int(raw)
    return physical


def default_kv_budget_mb(limit_bytes: int | None = None) -> int:
    """The KV cache budget a model service takes when none is configured: ``KV_SHARE`` of its
    memory limit, in MiB."""
    limit = memory_limit_bytes() if limit_bytes is None else limit_bytes
    return max(1, int(limit * KV_SHARE) >> 20)


def tcmalloc(paths: tuple[Path, ...] = TCMALLOC_PATHS) -> Path | None:
    """tcmalloc's shared library when the host has it, else None.

    A pass makes many tensors (thousands eager, dozens compiled), and tcmalloc serves them faster
    than glibc's allocator (``make bench-allocators`` measures the compiled pass under each:
    ``reports/allocators.json``), so a local stack preloads it for its model services.
    """
    return next((path for path in paths if path.is_file()), None)
