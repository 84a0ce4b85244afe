"""Benchmarks that compare settings by turns, A B .. B A, so a shared machine's drift falls on all alike."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def chosen_settings(settings: dict[str, dict], names: str, base: str) -> dict[str, dict]:
    """The ``settings`` named in ``names`` (comma-separated), in that order; they must include
    ``base``, which the others are compared with. Exits with the reason where a name is unknown."""
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in settings]
    if unknown:
        raise SystemExit(f"unknown settings {', '.join(unknown)}: choose from {', '.join(settings)}")
    if base not in chosen:
        raise SystemExit(f"the settings must include {base}: the others are compared with it")
    return {name: settings[name] for name in chosen}


def alternate(names: list[str], rounds: int, run: Callable[[str, int], dict]) -> dict[str, list[dict]]:
    """Each setting run twice a round, in the order A B .. B A (``run(name, index)``); the results by
    setting, in order."""
    order = (list(names) + list(reversed(names))) * rounds
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for index, name in enumerate(order):
        runs[name].append(run(name, index))
        print(f"{name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    return runs


def write_report(out: Path, config: dict, runs: dict[str, list[dict]], settings: dict) -> None:
    """Writes the report (its config, every run, each setting's summary) to ``out`` and shows the summary."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": config, "runs": runs, "settings": settings}, indent=2) + "\n")
    print(json.dumps(settings, indent=2))
