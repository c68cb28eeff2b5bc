"""The standard-library corpus: deterministic order, split, windows, unigram entropy; the digits."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from shardwise.data.corpus import CharWindows, load_stdlib_corpus, stdlib_dir, stdlib_files
from shardwise.errors import ConfigError


@pytest.fixture(scope="module")
def corpus():
    return load_stdlib_corpus(max_chars=50_000, val_fraction=0.1)


def test_files_come_from_the_stdlib_in_a_fixed_order() -> None:
    files = stdlib_files()
    assert len(files) > 100 and files == stdlib_files()
    assert all(f.endswith(".py") and not f.startswith(("test/", "site-packages/")) for f in files)
    assert "os.py" in files and "json/__init__.py" in files


def test_size_cap_split_and_round_trip(corpus) -> None:
    assert len(corpus.text) == 50_000
    assert len(corpus.train) == 45_000 and len(corpus.val) == 5_000
    assert corpus.decode(torch.cat([corpus.train, corpus.val])) == corpus.text
    assert corpus.vocab == "".join(sorted(set(corpus.text)))
    assert corpus.text.startswith(
        open(f"{stdlib_dir()}/{corpus.files[0]}", encoding="utf-8", errors="replace").read()[:1000]
    )
    assert load_stdlib_corpus(max_chars=50_000).text == corpus.text  # deterministic


def test_unigram_entropy_in_nats(corpus) -> None:
    counts = Counter(corpus.decode(corpus.train))
    n = sum(counts.values())
    expected = -sum(c / n * math.log(c / n) for c in counts.values())
    assert corpus.unigram_entropy == pytest.approx(expected, rel=1e-12)
    assert 2.0 < corpus.unigram_entropy < math.log(corpus.vocab_size)


def test_windows_are_shifted_by_one(corpus) -> None:
    windows = CharWindows(corpus.train, 64)
    assert len(windows) == (len(corpus.train) - 65) // 64 + 1
    x, y = windows[3]
    assert x.shape == y.shape == (64,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1]) and torch.equal(x, corpus.train[192:256])
    last_x, last_y = windows[len(windows) - 1]
    assert last_y.shape == (64,)
    with pytest.raises(IndexError):
        windows[len(windows)]
    assert len(CharWindows(corpus.train, 64, stride=32)) == (len(corpus.train) - 65) // 32 + 1


def test_errors() -> None:
    with pytest.raises(ConfigError, match="max_chars"):
        load_stdlib_corpus(max_chars=10)
    with pytest.raises(ConfigError, match="val_fraction"):
        load_stdlib_corpus(max_chars=5000, val_fraction=0.7)
    with pytest.raises(ConfigError, match="shorter than one window"):
        CharWindows(torch.arange(10), 64)


def test_digits_split() -> None:
    pytest.importorskip("sklearn")
    from shardwise.data.digits import load_digits

    splits = load_digits(val_fraction=0.2, seed=0)
    assert len(splits.train) + len(splits.val) == 1797 and len(splits.val) == 359
    x, y = splits.train[0]
    assert x.shape == (1, 8, 8) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0 and 0 <= int(y) < 10
    flat = load_digits(flatten=True)
    assert flat.train[0][0].shape == (64,)
    assert torch.equal(load_digits(seed=0).val.tensors[1], splits.val.tensors[1])


def test_digits_without_sklearn_says_what_to_install(monkeypatch) -> None:
    import sys

    from shardwise.data.digits import load_digits
    from shardwise.errors import ShardwiseError

    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail like a missing package
    with pytest.raises(ShardwiseError, match=r"needs scikit-learn.*pip install"):
        load_digits()
