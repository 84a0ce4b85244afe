"""A GGUF model is converted once, keyed by its content, and every later load reads the conversion."""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec import cli
from specdec import models as model_side
from specdec.models import load_model, smollm2_gguf_path
from specdec.vocab import CONVERTED, converted_folder, resolve_model_path


@pytest.fixture(scope="module")
def gguf_copy(tmp_path_factory):
    """The default model's GGUF file, copied where no conversion of it lives yet."""
    path = tmp_path_factory.mktemp("gguf") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    shutil.copyfile(smollm2_gguf_path(), path)
    return path


def test_convert_once_then_every_load_reads_the_folder(gguf_copy, tmp_path, monkeypatch, capsys, default_model):
    assert cli.main(["convert", str(gguf_copy), "--cache-dir", str(tmp_path)]) is None
    folder = converted_folder(gguf_copy, tmp_path)
    assert folder.parent == tmp_path / CONVERTED and str(folder) in capsys.readouterr().out

    def never(*_):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(model_side, "_convert", never)
    # A copy elsewhere has the same content, so it finds the same conversion.
    moved = tmp_path / "elsewhere" / gguf_copy.name
    moved.parent.mkdir()
    shutil.copyfile(gguf_copy, moved)
    assert resolve_model_path(str(moved), tmp_path) == folder
    loaded = load_model(str(gguf_copy), tmp_path)
    assert loaded.fingerprint == default_model.fingerprint
    theirs = default_model.model.state_dict()
    for name, weight in loaded.model.state_dict().items():
        assert torch.equal(weight, theirs[name]), name
    # Changed content is another model: it converts anew.
    with open(moved, "ab") as f:
        f.write(b"\0")
    assert converted_folder(moved, tmp_path) != folder


def test_convert_refuses_what_is_not_a_model(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        cli.main(["convert", str(tmp_path / "missing.gguf"), "--cache-dir", str(tmp_path)])
