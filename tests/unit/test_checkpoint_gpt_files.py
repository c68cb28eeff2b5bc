"""The built-in GPT's model file beside its checkpoints: a round trip, atomic (no temporary file
left), and each malformed file refused as one error naming it."""

from __future__ import annotations

import json
import os

import pytest

from shardwise.checkpoint.gpt_files import GPTFiles, gpt_files_in, keep_gpt_files, read_gpt_files
from shardwise.data.corpus import CharVocab
from shardwise.errors import ConfigError
from shardwise.models.gpt import GPT, GPTConfig

SHAPE = GPT(GPTConfig(vocab_size=16, seq_len=8, layers=1, hidden=8, heads=2), seed=0).config


def test_round_trip(tmp_path) -> None:
    assert not gpt_files_in(str(tmp_path))
    path = keep_gpt_files(str(tmp_path), GPTFiles(SHAPE, CharVocab("\n ab\"\\é")))
    assert gpt_files_in(str(tmp_path)) and os.listdir(os.path.dirname(path)) == ["model.json"]
    files = read_gpt_files(str(tmp_path))
    assert files.shape == SHAPE and files.vocab.chars == "\n ab\"\\é"
    assert files.vocab.decode(files.vocab.encode("ab é")) == "ab é" and files.vocab.unknown("abxyx") == "xy"


def test_malformed_files_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="keeps no GPT model file"):
        read_gpt_files(str(tmp_path))
    with pytest.raises(ConfigError, match="does not fit the model's vocab_size=16"):
        GPTFiles(SHAPE, CharVocab("".join(chr(65 + i) for i in range(17))))
    path = tmp_path / "gpt" / "model.json"
    path.parent.mkdir()
    good = {"format": "shardwise-gpt", "version": 1, "shape": SHAPE.to_dict(), "vocab": "ab"}
    for payload, match in [({**good, "version": 2}, "format version 2"), ({**good, "format": "x"}, "no \"format\""),
                           ({**good, "shape": {**SHAPE.to_dict(), "wings": 2}}, "'wings' is unknown"),
                           ({**good, "vocab": ["a"]}, "needs a \"shape\" object and a \"vocab\" string")]:
        path.write_text(json.dumps(payload))
        with pytest.raises(ConfigError, match=match):
            read_gpt_files(str(tmp_path))
