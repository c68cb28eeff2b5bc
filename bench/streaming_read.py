"""Streaming read throughput: ``PackedStream`` over a pre-tokenized ``.bin`` file against the
plainest possible reader of the same windows, in the same run.

A ``.bin`` file of ``--tokens`` uint16 token ids (one document) is read as windows of
``--seq + 1`` tokens:

- ``baseline``: ``np.memmap`` reshaped to ``[windows, seq + 1]``, each window turned into a
  torch tensor (no packing, no sharding, no position: the floor);
- ``stream``: ``PackedStream`` through ``StreamLoader`` on one rank, no workers (every window);
- ``stream_rank_of_8``: rank 0 of ``dp=8`` (one window in 8 is copied, the others only counted).

Each is repeated ``--repeats`` times, interleaved, and the median windows per second is reported,
with the ratio to the baseline. Also the size of a resumable position (pickled) after one global
batch. Writes bench/results/streaming_read.json.

Run:  .venv/bin/python bench/streaming_read.py [--tokens 20000000] [--seq 1023] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--seq", type=int, default=1023)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import numpy as np
    import torch

    from shardwise.data.streaming import PackedStream, StreamLoader

    width = args.seq + 1
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokens.bin")
        (np.arange(args.tokens, dtype=np.int64) % 50_000).astype("<u2").tofile(path)
        n_windows = args.tokens // width // args.global_batch * args.global_batch

        def baseline() -> int:
            rows = np.memmap(path, dtype="<u2", mode="r")[: n_windows * width].reshape(n_windows, width)
            return sum(1 for row in rows if torch.from_numpy(row.astype(np.int64)).numel())

        def stream(dp_size: int) -> int:
            loader = StreamLoader(
                PackedStream([path], seq_len=args.seq),
                dp_rank=0,
                dp_size=dp_size,
                micro_batch_size=8,
                global_batch_size=args.global_batch,
            )
            return sum(len(x) for x, _ in loader)

        readers = {"baseline": baseline, "stream": lambda: stream(1), "stream_rank_of_8": lambda: stream(8)}
        rates: dict[str, list[float]] = {name: [] for name in readers}
        for _ in range(args.repeats):
            for name, read in readers.items():
                start = time.perf_counter()
                windows = read()
                rates[name].append(windows / (time.perf_counter() - start))
        loader = StreamLoader(PackedStream([path], seq_len=args.seq), dp_rank=0, dp_size=1, micro_batch_size=8,
                              global_batch_size=args.global_batch)
        it = iter(loader)
        for _ in range(args.global_batch // 8):
            next(it)
        loader.position.advance(args.global_batch)
        position_bytes = len(pickle.dumps(loader.position.state_dict()))

    median = {name: statistics.median(r) for name, r in rates.items()}
    result = {
        "tokens": args.tokens, "seq_len": args.seq, "windows": n_windows, "repeats": args.repeats,
        "windows_per_s": median, "all_windows_per_s": rates,
        "ratio_to_baseline": {name: median[name] / median["baseline"] for name in median},
        "position_bytes_after_one_global_batch": position_bytes,
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "streaming_read.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    for name in readers:
        print(f"{name:>18}: {median[name]:10.0f} windows/s  ({result['ratio_to_baseline'][name]:.2f}x baseline)")
    print(f"position after one global batch: {position_bytes} bytes pickled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
