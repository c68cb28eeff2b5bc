"""Streaming datasets (``PackedStream`` through torchdata's ``StatefulDataLoader``).

- every window of an epoch appears exactly once over 2 data-parallel ranks x 2 loader workers
  (windows identified by their token ids: documents of distinct ids), in the global order, up to
  the last whole global batch; text, JSONL, .npy and .bin documents are packed across document boundaries;
- through the Trainer, a run stopped at step 4 (mid-epoch) and resumed reads exactly the windows an
  uninterrupted run reads (bitwise, per step; file order and a shuffle buffer of 2 global batches
  reshuffled every epoch), on the same layout (dp=2, 2 workers: every worker
  restored by the StatefulDataLoader; weights then equal bitwise too) and on another (one
  process, no workers: the windows before the position are skipped); losses equal at rtol 1e-5;
- a shuffle buffer permutes windows within blocks only, keeps every window once over ranks and
  workers, and a loader restored mid-block continues exactly on the same and another layout.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch import nn

from shardwise.data.streaming import PackedStream, StreamLoader

SEQ, GBS, VOCAB = 4, 8, 1000


def _token_files(directory: str) -> list[str]:
    """7 documents of distinct token ids (lengths 3..40): windows cross document boundaries."""
    files, start = [], 1
    for i, n in enumerate([13, 40, 3, 27, 31, 8, 22]):
        path = os.path.join(directory, f"doc{i}.npy")
        np.save(path, np.arange(start, start + n, dtype=np.int64))
        files.append(path)
        start += n
    return files


def _windows(loader: StreamLoader) -> list[list[int]]:
    return [row.tolist() for x, _ in loader for row in x]


def test_every_window_once_over_ranks_and_workers(tmp_path) -> None:
    files = _token_files(str(tmp_path))
    total = 144 + 7  # tokens, with one eos (0) after each document
    n_windows = total // (SEQ + 1)
    whole = n_windows // GBS * GBS
    # one process, one worker: the global order of windows
    alone = _windows(StreamLoader(PackedStream(files, seq_len=SEQ, eos_id=0), dp_rank=0, dp_size=1, micro_batch_size=2,
                                  global_batch_size=GBS))
    assert len(alone) == whole
    ids = np.concatenate([np.append(np.load(f), 0) for f in files]).tolist()  # the packed token stream
    assert alone == [
        ids[k * (SEQ + 1) : k * (SEQ + 1) + SEQ] for k in range(whole)
    ]  # window k: inputs are its first SEQ
    per_rank = [
        _windows(
            StreamLoader(
                PackedStream(files, seq_len=SEQ, eos_id=0),
                dp_rank=r,
                dp_size=2,
                micro_batch_size=2,
                global_batch_size=GBS,
                num_workers=2,
            )
        )
        for r in range(2)
    ]
    assert [len(w) for w in per_rank] == [whole // 2] * 2
    # rank r holds windows r, r + 2, ... in order; together each window exactly once
    assert per_rank[0] == alone[0::2] and per_rank[1] == alone[1::2]
    seen = [tuple(w) for ws in per_rank for w in ws]
    assert len(set(seen)) == len(seen) == whole


def test_text_jsonl_and_token_files_pack_across_boundaries(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("abcdefg")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "hij"}) + "\n" + json.dumps({"text": "klmnopqrstu"}) + "\n")
    stream = PackedStream(
        [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")],
        seq_len=3,
        tokenize=lambda s: [ord(c) for c in s],
        eos_id=0,
    )
    got = [(bytes(x[0].tolist()), bytes(y[0].tolist())) for x, y in
           StreamLoader(stream, dp_rank=0, dp_size=1, micro_batch_size=1, global_batch_size=1)]
    # "abcdefg|hij|klmnopqrstu|" in windows of 4 tokens: inputs are the first 3, targets the last 3
    assert all(x[1:] == y[:-1] for x, y in got)
    assert [(x + y[-1:]).replace(b"\0", b"|") for x, y in got] == [b"abcd", b"efg|", b"hij|", b"klmn", b"opqr", b"stu|"]
    # raw token files (.bin, uint16) read like .npy ones
    np.arange(1, 11, dtype="<u2").tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", np.arange(11, 16))
    raw = PackedStream([str(tmp_path / "t.bin"), str(tmp_path / "t.npy")], seq_len=3)
    assert _windows(StreamLoader(raw, dp_rank=0, dp_size=1, micro_batch_size=1, global_batch_size=1)) == [
        [1, 2, 3], [5, 6, 7], [9, 10, 11]]


class Recorder(nn.Module):
    """A tiny LM that keeps the input ids of every forward (the windows this rank trained on)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
        self.seen: list[list[list[int]]] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append(ids.tolist())
        return self.head(self.emb(ids))


def fit_stream(
    plan: str, files: list[str], directory: str, max_steps: int, resume: str | int | None, workers: int
) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from shardwise.checkpoint import CheckpointManager
    from shardwise.train import DataOptions, LoggingOptions, TrainOptions, Trainer

    model = Recorder()
    trainer = Trainer(model, loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9), plan=plan, global_batch_size=GBS,
                      train=TrainOptions(max_steps=max_steps, seed=3),
                      data=DataOptions(num_workers=workers, worker_start_method="fork"),
                      logging=LoggingOptions(log_every=1, progress_bar=False), checkpoint=CheckpointManager(directory),
                      callbacks=[])
    trainer.fit(
        PackedStream(files, seq_len=SEQ, eos_id=0, shuffle=True, seed=5, shuffle_windows=2 * GBS), resume=resume
    )
    weights = {k: v.detach().clone() for k, v in get_model_state_dict(trainer.model.module).items()}
    # per optimizer step, this rank's windows (one micro-batch per step here)
    return {"seen": model.seen, "losses": [h["loss"] for h in trainer.history if "loss" in h], "weights": weights}


def _steps(results: list[dict]) -> list[list[tuple[int, ...]]]:
    """Per step, the windows of all ranks together (sorted: the set trained on in that step)."""
    return [sorted(tuple(w) for r in results for w in r["seen"][s]) for s in range(len(results[0]["seen"]))]


def test_streaming_resume_is_exact_on_the_same_and_another_layout(pools, tmp_path) -> None:
    files = _token_files(str(tmp_path))
    # 30 windows, 3 whole global batches per epoch: 8 steps cross 2 epoch boundaries (file order reshuffled)
    straight = pools(2).run(fit_stream, "dp=2", files, str(tmp_path / "straight"), 8, None, 2)
    cut = str(tmp_path / "cut")
    first = pools(2).run(fit_stream, "dp=2", files, cut, 4, None, 2)
    assert _steps(first) == _steps(straight)[:4]
    same = pools(2).run(fit_stream, "dp=2", files, cut, 8, "auto", 2)
    assert _steps(same) == _steps(straight)[4:]
    for s, r in zip(straight, same):
        assert all(torch.equal(s["weights"][k], r["weights"][k]) for k in s["weights"])
    other = pools(1).run(fit_stream, "dp", files, cut, 8, 4, 0)  # the step-4 checkpoint again, on one process
    assert _steps(other) == _steps(straight)[4:]
    torch.testing.assert_close(
        torch.tensor(other[0]["losses"]), torch.tensor(straight[0]["losses"][4:]), rtol=1e-5, atol=0
    )


def test_a_restored_loader_continues_without_rereading_and_another_layout_rereads() -> None:
    docs = [f"document {i} " * (i % 4 + 1) for i in range(30)]
    calls = []

    def tokenize(text: str) -> list[int]:
        calls.append(text)
        return [ord(c) for c in text]

    def loader(dp_size: int = 1) -> StreamLoader:
        return StreamLoader(
            PackedStream(lambda: iter(docs), seq_len=SEQ, tokenize=tokenize, eos_id=0),
            dp_rank=0,
            dp_size=dp_size,
            micro_batch_size=2,
            global_batch_size=GBS,
        )

    whole = _windows(loader())
    first = loader()
    it = iter(first)
    head = [row.tolist() for _ in range(8) for row in next(it)[0]]  # 8 micro-batches = 2 global batches
    first.position.advance(2 * GBS)
    state = first.position.state_dict()
    calls.clear()
    resumed = loader()
    resumed.position.load_state_dict(state)
    assert head + _windows(resumed) == whole
    assert (
        len(calls) < len(docs) and calls[0] != docs[0]
    )  # restored where it was: the documents before are not tokenized again
    calls.clear()
    other = loader(dp_size=2)  # another data-parallel degree: rank 0 of 2 continues from the global position
    other.position.load_state_dict(state)
    assert _windows(other) == whole[2 * GBS:][0::2] and len(calls) == len(docs)


def test_a_shuffle_buffer_permutes_windows_within_blocks_and_resumes_exactly(tmp_path) -> None:
    files = _token_files(str(tmp_path))

    def loader(dp_rank: int = 0, dp_size: int = 1, workers: int = 0, epoch: int = 0, **kw) -> StreamLoader:
        out = StreamLoader(PackedStream(files, seq_len=SEQ, eos_id=0, seed=4, **kw), dp_rank=dp_rank, dp_size=dp_size,
                           micro_batch_size=2, global_batch_size=GBS, num_workers=workers)
        out.position.set_epoch(epoch)
        return out

    in_order = _windows(loader())  # 24 windows (30 in the stream, cut to 3 whole global batches)
    shuffled = _windows(loader(shuffle_windows=12))  # blocks of 16 windows (12 rounded up to whole global batches)
    assert len(shuffled) == len(in_order) == 24 and shuffled != in_order
    # a permutation within each block: the first 16, then the last block's 8 whole-batch windows
    assert sorted(shuffled[:16]) == sorted(in_order[:16]) and sorted(shuffled[16:]) == sorted(in_order[16:])
    assert _windows(loader(shuffle_windows=12, epoch=1)) != shuffled  # another permutation each epoch
    per_rank = [_windows(loader(r, 2, 2, shuffle_windows=12)) for r in range(2)]
    assert per_rank[0] == shuffled[0::2] and per_rank[1] == shuffled[1::2]  # every window once over ranks and workers

    first = loader(workers=2, shuffle_windows=12)
    it = iter(first)
    head = [row.tolist() for _ in range(4) for row in next(it)[0]]  # one global batch, mid-block
    first.position.advance(GBS)
    state = first.position.state_dict()
    same = loader(workers=2, shuffle_windows=12)
    same.position.load_state_dict(state)  # every worker restored with the block it holds
    assert head + _windows(same) == shuffled
    for rank in range(
        2
    ):  # another data-parallel degree: the block re-read, the same permutation, skipped to the position
        other = loader(rank, 2, 0, shuffle_windows=12)
        other.position.load_state_dict(state)
        assert _windows(other) == shuffled[GBS:][rank::2]


def test_a_large_token_file_is_read_a_window_at_a_time_and_its_position_is_small(tmp_path) -> None:
    import pickle

    tokens = np.arange(2_000_000, dtype="<u4") % 60_000  # one 8 MB document
    tokens.astype("<u2").tofile(tmp_path / "big.bin")

    def loader() -> StreamLoader:
        return StreamLoader(PackedStream([str(tmp_path / "big.bin")], seq_len=127, eos_id=0), dp_rank=0, dp_size=1,
                            micro_batch_size=2, global_batch_size=GBS)

    first = loader()
    it = iter(first)
    head = [row.tolist() for _ in range(4) for row in next(it)[0]]  # one global batch of the single document
    assert head == [tokens[k * 128: k * 128 + 127].tolist() for k in range(GBS)]
    first.position.advance(GBS)
    state = first.position.state_dict()
    assert len(pickle.dumps(state)) < 4096  # (part, document, token offset): not the rest of the document
    resumed = loader()
    resumed.position.load_state_dict(state)
    x, _ = next(iter(resumed))
    assert x[0].tolist() == tokens[GBS * 128: GBS * 128 + 127].tolist()


def fit_auto_stream(files: list[str], directory: str) -> dict:
    from shardwise.train import LoggingOptions, ParallelOptions, TrainOptions, Trainer

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
    )  # (the Recorder's forward reads values: not on meta)
    trainer = Trainer(model, loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.5), plan="auto", global_batch_size=GBS,
                      train=TrainOptions(max_steps=3, seed=3), parallel=ParallelOptions(cluster="cpu", certify=True),
                      logging=LoggingOptions(log_every=1, progress_bar=False, run_dir=directory))
    result = trainer.fit(PackedStream(files, seq_len=SEQ, eos_id=0))
    choice = trainer.auto_choice  # rank 0's (it decides and broadcasts)
    return {
        "plan": str(trainer.plan),
        "steps": result.step,
        "certificate": choice.certificate if choice is not None else None,
    }


def test_plan_auto_sizes_and_certifies_on_a_stream(pools, tmp_path) -> None:
    """plan="auto" reads the sample shape and the certification batches from a fresh pass of the
    stream (it has no length and no index); training then reads it from the start."""
    results = pools(2).run(fit_auto_stream, _token_files(str(tmp_path)), str(tmp_path / "run"))
    assert [r["steps"] for r in results] == [3, 3] and results[0]["plan"] == results[1]["plan"]
    certificate = results[0]["certificate"]
    assert certificate is not None and certificate["certified"] == results[0]["plan"], (
        certificate
    )  # certified on the stream's first batches
    assert (tmp_path / "run" / "auto_plan.json").is_file()


@pytest.mark.parametrize("kind", ["stream", "persistent-map"])
def test_fit_stops_its_loader_workers_before_it_returns(tmp_path, kind) -> None:
    """The loader's worker processes end with ``fit``; torch would stop them only when the trainer
    is garbage-collected, and in the cyclic collector that waits 5 s per worker. A stream's position
    is kept for a save after ``fit``."""
    import gc
    import multiprocessing
    import time

    from torch.utils.data import TensorDataset

    from shardwise.train import DataOptions, LoggingOptions, TrainOptions, Trainer

    before = set(multiprocessing.active_children())
    if kind == "stream":
        data = PackedStream(_token_files(str(tmp_path)), seq_len=SEQ, eos_id=0)
    else:
        ids = torch.arange(64 * (SEQ + 1)).reshape(64, SEQ + 1) % VOCAB
        data = TensorDataset(ids[:, :-1], ids[:, 1:])
    trainer = Trainer(nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)),
                      loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.5), global_batch_size=GBS,
                      train=TrainOptions(max_steps=2, seed=3),
                      data=DataOptions(num_workers=2, worker_start_method="fork", persistent_workers=True),
                      logging=LoggingOptions(log_every=1, progress_bar=False))
    assert trainer.fit(data).step == 2
    assert set(multiprocessing.active_children()) == before  # the two workers have ended
    if kind == "stream":
        state = trainer.state.sampler.state_dict()
        assert state["consumed"] == 2 * GBS and len(state["loader"]["_snapshot"]["_worker_snapshots"]) == 2, state
    start = time.perf_counter()
    del trainer
    gc.collect()
    assert time.perf_counter() - start < 2.0
