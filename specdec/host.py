"""Facts about the host a service runs on, read once at the edge: how much memory it may use, which
allocator its model services should run on, and how large its last-level cache is.

A container's limit is its cgroup's (``memory.max`` under cgroup v2, ``memory.limit_in_bytes``
under v1), which is the pod's limit in Kubernetes; outside one it is the machine's memory.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# cgroup files that hold the memory limit, v2 then v1; v1 writes a huge number for "no limit".
_CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
# Where Debian's libtcmalloc-minimal4 (installed by the Makefile and the container image) puts it.
TCMALLOC_PATHS = (
    Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
    Path("/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4"),
)
# Where Linux describes the first CPU's caches, one ``index*`` directory per cache.
_CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
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


@functools.cache
def last_level_cache_bytes(caches: Path = _CPU_CACHES) -> int | None:
    """The size of the first CPU's last-level cache (the highest-level data or unified one Linux lists),
    or None where the host does not say."""
    sizes: dict[int, int] = {}
    for index in caches.glob("index*"):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()  # "32768K"
        except (OSError, ValueError):
            continue
        scale = _SIZE_UNITS.get(size[-1:], 1)
        digits = size[:-1] if size[-1:] in _SIZE_UNITS else size
        if kind != "Instruction" and digits.isdigit():
            sizes[level] = int(digits) * scale
    return sizes[max(sizes)] if sizes else None
