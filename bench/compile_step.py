"""Compiled against eager: the training step of the built-in GPT with ``plan compile`` (each block
compiled by inductor, torchtitan's order) against the same step eager, on this CPU, in one run.

Both models are parallelized by shardwise from the same seed (``dp=1`` against ``dp=1,compile``,
one process), trained with AdamW on the same random token batches. After ``--warmup`` steps (the
first compiled step pays for compilation; its time is reported separately), repetitions are
interleaved (eager, compiled, compiled, eager, ...) so that the machine's noise hits both alike;
each repetition times ``--steps`` steps. The figure is the median of the per-pair ratios
eager time / compiled time (> 1: compiled is faster), with the compile log's graph, graph-break
and recompile counts. Writes ``bench/results/compile_step.json``.

    python bench/compile_step.py [--reps 7] [--steps 5] [--layers 4 --hidden 128 --seq-len 128 --batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def build(plan: str, args: argparse.Namespace):
    from shardwise.layout import Plan
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize

    shape = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab_size=128, seq_len=args.seq_len)
    p = Plan.parse(plan)
    pm = parallelize(GPT(shape, seed=0), p, build_mesh(p, "cpu"))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    return pm, opt, shape


def steps(pm, opt, batches) -> float:
    start = time.perf_counter()
    for x, y in batches:
        loss = F.cross_entropy(pm.module(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(RESULTS, "compile_step.json"))
    args = parser.parse_args()

    import shardwise
    from shardwise.parallel.compile import compile_stats

    shardwise.init()
    eager, eager_opt, shape = build("dp=1", args)
    compiled, compiled_opt, _ = build("dp=1,compile", args)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (args.steps, args.batch, args.seq_len + 1), generator=gen)
    batches = [(b[:, :-1], b[:, 1:]) for b in ids]
    first_compiled = steps(compiled, compiled_opt, batches[:1])  # compilation happens here
    after_first = compile_stats()
    for _ in range(args.warmup):
        steps(eager, eager_opt, batches[:1])
        steps(compiled, compiled_opt, batches[:1])
    pairs = []
    for rep in range(args.reps):
        order = (
            [(eager, eager_opt), (compiled, compiled_opt)]
            if rep % 2 == 0
            else [(compiled, compiled_opt), (eager, eager_opt)]
        )
        times = {id(pm): steps(pm, opt, batches) for pm, opt in order}
        pairs.append((times[id(eager)], times[id(compiled)]))
    final = compile_stats()
    ratios = [e / c for e, c in pairs]
    tokens = args.steps * args.batch * args.seq_len
    result = {
        "median_speedup_eager_over_compiled": statistics.median(ratios),
        "ratios": ratios,
        "eager_tokens_per_s": tokens / statistics.median(e for e, _ in pairs),
        "compiled_tokens_per_s": tokens / statistics.median(c for _, c in pairs),
        "first_compiled_step_s": first_compiled,
        "graphs_after_first_step": after_first.graphs,
        "graph_breaks": final.graph_breaks,
        "recompiles_after_first_step": final.graphs - after_first.graphs,
        "shape": {
            "layers": shape.layers,
            "hidden": shape.hidden,
            "heads": shape.heads,
            "seq_len": shape.seq_len,
            "batch": args.batch,
        },
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "command": "python bench/compile_step.py " + " ".join(sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(
        f"compiled step: {result['median_speedup_eager_over_compiled']:.2f}x eager (median of {args.reps} interleaved "
        f"pairs), first compiled step {first_compiled:.1f} s, {final.graphs} graphs, {final.graph_breaks} graph "
        f"breaks, {result['recompiles_after_first_step']} recompiles; {args.out}"
    )


if __name__ == "__main__":
    main()
