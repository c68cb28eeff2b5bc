"""A model directory's safetensors weights checked from the headers: whole files, every shard of
the index, and the shapes the model built from config.json needs (shardwise.checkpoint.weights_check)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from shardwise.checkpoint.weights_check import check_weights, read_header
from shardwise.errors import ConfigError

TENSORS = {"a.weight": torch.ones(4, 3), "b.weight": torch.zeros(5, dtype=torch.bfloat16)}


def _saved(tmp_path: Path, name: str = "model.safetensors") -> Path:
    path = tmp_path / name
    save_file(TENSORS, str(path))
    return path


def test_a_whole_file_gives_every_tensor_with_dtype_and_shape(tmp_path: Path) -> None:
    header = read_header(str(_saved(tmp_path)))
    assert {k: (t.dtype, t.shape) for k, t in header.items()} == {
        "a.weight": ("F32", (4, 3)),
        "b.weight": ("BF16", (5,)),
    }


@pytest.mark.parametrize(
    "cut, expect",
    [
        (lambda b: b[: len(b) - 7], r"is truncated: it has \d+ bytes, its header describes \d+"),
        (lambda b: b + b"xx", r"is longer than its header describes"),
        (lambda b: b[:20], r"truncated or not a safetensors file"),
        (lambda b: b[:4], r"truncated or not a safetensors file"),
    ],
)
def test_a_cut_or_padded_file_is_one_line_naming_it(tmp_path: Path, cut, expect: str) -> None:
    path = _saved(tmp_path)
    path.write_bytes(cut(path.read_bytes()))
    with pytest.raises(ConfigError, match=expect) as err:
        read_header(str(path))
    assert str(path) in str(err.value)


def test_a_header_that_lies_about_a_tensor_names_the_tensor(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8: 8 + n])
    header["a.weight"]["shape"] = [4, 4]  # 64 bytes by its shape, 48 by its offsets
    path.write_bytes(data[:8] + json.dumps(header, separators=(",", ":")).encode().ljust(n) + data[8 + n:])
    with pytest.raises(ConfigError, match=r"corrupt: tensor 'a\.weight' \(F32, shape \[4, 4\]\) has data_offsets"):
        read_header(str(path))
    path.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(ConfigError, match=r"corrupt: its header is not a JSON object"):
        read_header(str(path))


def test_an_index_names_shards_that_must_be_there_and_hold_their_tensors(tmp_path: Path) -> None:
    _saved(tmp_path, "model-00001-of-00002.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                                "c.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(
        ConfigError,
        match=r"model-00002-of-00002\.safetensors is missing: .* names it for 1 tensor\(s\), e\.g\. 'c\.weight'",
    ):
        check_weights(str(tmp_path))
    index.write_text(json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                                "c.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(
        ConfigError, match=r"lacks tensor 'c\.weight', which model\.safetensors\.index\.json places there"
    ):
        check_weights(str(tmp_path))
    index.write_text("[]")
    with pytest.raises(ConfigError, match=r"is not a safetensors index"):
        check_weights(str(tmp_path))
    os.remove(index)
    assert set(check_weights(str(tmp_path))) == {"a.weight", "b.weight"}


class _Model(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        with torch.device("meta"):
            self.a = nn.Linear(3, rows, bias=False)


def test_the_shapes_must_be_the_models_and_every_parameter_stored(tmp_path: Path) -> None:
    _saved(tmp_path)
    check_weights(str(tmp_path), _Model(4))
    with pytest.raises(
        ConfigError, match=r"model\.safetensors: tensor 'a\.weight' has shape \[4, 3\], but the model .* needs \[6, 3\]"
    ):
        check_weights(str(tmp_path), _Model(6))
    save_file({"b.weight": TENSORS["b.weight"]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"has no weights for 1 parameter\(s\) of the model, e\.g\. 'a\.weight'"):
        check_weights(str(tmp_path), _Model(4))
