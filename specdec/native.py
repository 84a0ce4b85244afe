"""Builds the C++ kernels under ``specdec/csrc`` for the CPU this process runs on.

torch compiles each on first use with the machine's C++ compiler (``torch.utils.cpp_extension``, tens
of seconds) and caches the result under ``~/.cache/torch_extensions`` (or ``TORCH_EXTENSIONS_DIR``),
so a later process loads it at once; ``make install`` builds them ahead. Built with ``-march=native``:
a kernel uses the instructions this CPU has (AVX-512 where present).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")


def build(name: str, source: str) -> ModuleType | None:
    """Extension ``name`` built from ``csrc/<source>``, or None where it cannot be built (logged)."""
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the pip-installed ninja, beside this interpreter
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

        return load(
            name,
            [str(SOURCES / source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as error:  # noqa: BLE001 - any build failure means: use the torch ops instead
        log.warning("the kernel %s could not be built (%s); torch ops stand in", source, error)
        return None
