"""Streaming sources beyond plain files: parquet files and Hugging Face ``datasets`` loaded from
local files (map-style and ``streaming=True``), read through ``PackedStream`` / ``StreamLoader``.

- a parquet file's text column and token-id column pack like the same documents in JSONL/.npy;
  resuming inside a file skips whole row groups without reading them;
- over 2 data-parallel ranks x 2 loader workers every window of the global order appears exactly
  once (windows identified by their token ids), for parquet files, a ``datasets.Dataset`` and a
  ``datasets.IterableDataset``;
- a loader restored from its state mid-epoch continues with exactly the windows an uninterrupted
  read gives, on the same layout and at another data-parallel degree, for both dataset kinds;
- ``shuffle`` permutes a map-style dataset's rows each epoch (every row once per epoch);
- what cannot work is refused with one clear message.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardwise.data.documents import FileSource
from shardwise.data.streaming import PackedStream, StreamLoader
from shardwise.errors import ConfigError

SEQ, GBS = 4, 8
N_DOCS = 40


def _texts() -> list[str]:
    return [f"doc{i}:" + "abcdefghij"[: i % 7 + 1] for i in range(N_DOCS)]


def _ids() -> list[list[int]]:
    """Documents of distinct token ids (lengths 1..9): every window is unique."""
    out, start = [], 1
    for i in range(N_DOCS):
        n = i % 9 + 1
        out.append(list(range(start, start + n)))
        start += n
    return out


def _parquet(directory, name: str, rows_per_group: int = 7) -> str:
    path = os.path.join(directory, name)
    pq.write_table(
        pa.table({"text": _texts(), "ids": _ids(), "label": list(range(N_DOCS))}), path, row_group_size=rows_per_group
    )
    return path


def _tokenize(text: str) -> list[int]:
    return [ord(c) for c in text]


def _windows(loader: StreamLoader) -> list[list[int]]:
    return [row.tolist() for x, _ in loader for row in x]


def _loader(source, *, dp_rank: int = 0, dp_size: int = 1, workers: int = 0, **kwargs) -> StreamLoader:
    stream = PackedStream(source, seq_len=SEQ, eos_id=0, **kwargs)
    return StreamLoader(
        stream, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=2, global_batch_size=GBS, num_workers=workers
    )


def _hf(path: str, tmp_path, streaming: bool = False):
    return datasets.load_dataset("parquet", data_files=[path], split="train", streaming=streaming,
                                 cache_dir=None if streaming else str(tmp_path / "hf-cache"))


def test_parquet_columns_pack_like_jsonl_and_npy_and_resume_skips_row_groups(tmp_path, monkeypatch) -> None:
    path = _parquet(tmp_path, "a.parquet")
    with open(tmp_path / "a.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in _texts())
    text = _windows(_loader([path], tokenize=_tokenize))
    assert text and text == _windows(_loader([str(tmp_path / "a.jsonl")], tokenize=_tokenize))
    np.save(tmp_path / "ids.npy", np.concatenate([np.append(d, 0) for d in _ids()])[:-1])  # one document, same tokens
    assert _windows(_loader([path], text_key="ids")) == _windows(_loader([str(tmp_path / "ids.npy")]))

    read = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile, "read_row_group", lambda self, i, **kw: read.append(i) or original(self, i, **kw)
    )
    source = FileSource(
        [path], text_key="text", has_tokenizer=True, bin_dtype=np.dtype("uint16"), shuffle=False, seed=0
    )
    assert list(source.documents(0, 0, 30)) == _texts()[30:]
    assert read == [4, 5]  # rows 30.. live in row groups 4 (28..34) and 5: groups 0-3 are not read


@pytest.mark.parametrize("kind", ["parquet", "dataset", "iterable"])
def test_every_window_once_over_ranks_and_workers(kind: str, tmp_path) -> None:
    path = _parquet(tmp_path, "a.parquet")
    source = {
        "parquet": lambda: [path],
        "dataset": lambda: _hf(path, tmp_path),
        "iterable": lambda: _hf(path, tmp_path, True),
    }[kind]
    alone = _windows(_loader(source(), text_key="ids"))
    flat = [t for d in _ids() for t in d + [0]]
    whole = len(flat) // (SEQ + 1) // GBS * GBS
    assert alone == [flat[k * (SEQ + 1): k * (SEQ + 1) + SEQ] for k in range(whole)]
    per_rank = [_windows(_loader(source(), dp_rank=r, dp_size=2, workers=2, text_key="ids")) for r in range(2)]
    assert per_rank[0] == alone[0::2] and per_rank[1] == alone[1::2]
    seen = [tuple(w) for ws in per_rank for w in ws]
    assert len(set(seen)) == len(seen) == whole


@pytest.mark.parametrize("kind", ["dataset", "iterable"])
def test_a_restored_loader_continues_exactly_on_the_same_and_another_layout(kind: str, tmp_path) -> None:
    path = _parquet(tmp_path, "a.parquet")

    def loader(dp_rank: int = 0, dp_size: int = 1, workers: int = 2) -> StreamLoader:
        return _loader(
            _hf(path, tmp_path, streaming=kind == "iterable"),
            dp_rank=dp_rank,
            dp_size=dp_size,
            workers=workers,
            tokenize=_tokenize,
        )

    whole = _windows(loader(workers=0))
    first = loader()
    it = iter(first)
    head = [row.tolist() for _ in range(8) for row in next(it)[0]]  # 8 micro-batches = 2 global batches
    first.position.advance(2 * GBS)
    state = first.position.state_dict()
    resumed = loader()
    resumed.position.load_state_dict(state)  # the same layout: every worker restored where it was
    assert head + _windows(resumed) == whole
    for rank in range(2):  # another data-parallel degree: each rank re-reads and skips to the global position
        other = loader(dp_rank=rank, dp_size=2, workers=0)
        other.position.load_state_dict(state)
        assert _windows(other) == whole[2 * GBS:][rank::2]


def test_shuffle_permutes_a_datasets_rows_every_epoch(tmp_path) -> None:
    dataset = _hf(_parquet(tmp_path, "a.parquet"), tmp_path)
    docs = {tuple(d) for d in _ids()}

    def epoch_documents(epoch: int) -> list[tuple[int, ...]]:
        stream = PackedStream(dataset, seq_len=SEQ, text_key="ids", shuffle=True, seed=11)
        return [tuple(d) for d in stream.documents.documents(epoch, 0, 0)]

    first, second = epoch_documents(0), epoch_documents(1)
    assert set(first) == set(second) == docs and len(first) == len(second) == N_DOCS
    assert first != second and first == epoch_documents(0)  # another order per epoch, the same for every reader
    assert first[5:] == [tuple(d) for d in PackedStream(dataset, seq_len=SEQ, text_key="ids", shuffle=True, seed=11)
                         .documents.documents(0, 0, 5)]  # resuming at row 5 of the permuted order


def test_what_cannot_work_is_refused(tmp_path) -> None:
    path = _parquet(tmp_path, "a.parquet")
    with pytest.raises(ConfigError, match="has no column 'body'"):
        PackedStream([path], seq_len=SEQ, text_key="body", tokenize=_tokenize)
    with pytest.raises(ConfigError, match="has no column 'body'"):
        PackedStream(_hf(path, tmp_path), seq_len=SEQ, text_key="body")
    with pytest.raises(ConfigError, match="needs a map-style dataset"):
        PackedStream(_hf(path, tmp_path, streaming=True), seq_len=SEQ, shuffle=True)
    with pytest.raises(ConfigError, match="not a callable's documents"):
        PackedStream(lambda: iter(_texts()), seq_len=SEQ, shuffle=True, tokenize=_tokenize)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="is not one of .txt, .jsonl, .parquet"):
        PackedStream([str(tmp_path / "x.csv")], seq_len=SEQ)
