"""FP8 and per-block compile on one GPU: shardwise's Trainer against a hand-written fully_shard +
torch.compile loop, on a ~1.1B-parameter Llama-style model (TinyLlama's shape: 22 layers, hidden
2048, SwiGLU 5632, 32 heads, 4 key/value heads, vocabulary 32000), built from a config (nothing
is downloaded).

Five runs in one process, one after another, each from the same seed on the same random token
batches (AdamW, sequence 2048):

==========================  ===========================================================================
run                         what
==========================  ===========================================================================
shardwise bf16 eager        ``Trainer(plan="zero=3,precision=bf16")`` (FSDP2 over the one GPU, bf16)
shardwise bf16 compiled     ``... ,compile`` (each decoder layer compiled, torchtitan's order)
shardwise fp8 compiled      ``... ,precision=fp8,compile`` (torchao float8, tensorwise, FP8 all-gather)
reference bf16 compiled     by hand: ``layer.compile()``, ``fully_shard(layer)`` per layer and the root,
                            ``MixedPrecisionPolicy(bf16, fp32)``, the plain loop
reference fp8 compiled      the same after torchao's ``convert_to_float8_training`` (LM head kept,
                            ``enable_fsdp_float8_all_gather``)
==========================  ===========================================================================

For each: tokens/s (steps after ``--warmup``, timed after a device synchronization), MFU against
the GPU's dense bf16 peak (FLOPs per token ``6 N + 12 L h T``, N the non-embedding parameters; the
FP8 peak is twice the bf16 one, so an FP8 run's MFU is quoted on the bf16 scale, torchtitan's
convention), peak allocated memory, the final loss. The figures are the ratios: each shardwise run
against the reference of the same precision (bf16 eager against the bf16 compiled reference as
well), compiled against eager, FP8 against bf16. Writes ``bench/results/gpu/fp8_compile.json``.

    python bench/gpu_fp8_compile.py                 # on one H100/H200 (needs torchao and transformers)
    python bench/gpu_fp8_compile.py --tiny          # any machine: a tiny Llama on the CPU, FP8 emulated
                                                    # (checks that the script runs; numbers mean nothing)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "gpu")
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM (NVIDIA's data sheet)


def llama_config(tiny: bool) -> Any:
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=128,
            attn_implementation="sdpa",
            use_cache=False,
        )
    return LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
        use_cache=False,
    )


def build_model(config: Any, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with device:
        return LlamaForCausalLM(config)


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def flops_per_token(model: torch.nn.Module, config: Any, seq: int) -> float:
    embed = model.get_input_embeddings().weight.numel()
    n = sum(p.numel() for p in model.parameters()) - embed
    return 6 * n + 12 * config.num_hidden_layers * config.hidden_size * seq


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def run_shardwise(plan: str, *, config: Any, data: Any, args: argparse.Namespace, device: torch.device) -> dict:
    """The Trainer as a user writes it; step times from a callback after a synchronization."""
    from shardwise.train import Callback, DataOptions, LoggingOptions, TrainOptions, Trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []

        def on_step_end(self, trainer: Any, metrics: dict) -> None:
            sync(device)
            self.times.append(time.perf_counter())
            if "loss" in metrics:
                self.losses.append(float(metrics["loss"]))

    reset_memory(device)
    clock = Clock()
    model = build_model(config, device)
    trainer = Trainer(model, loss_fn=loss_fn, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), plan=plan,
                      global_batch_size=args.batch, train=TrainOptions(max_steps=args.warmup + args.steps),
                      data=DataOptions(shuffle=False),
                      logging=LoggingOptions(log_every=args.warmup + args.steps, progress_bar=False), callbacks=[clock])
    trainer.fit(data)
    seconds = clock.times[-1] - clock.times[args.warmup - 1]
    out = {
        "seconds": seconds,
        "final_loss": clock.losses[-1] if clock.losses else None,
        "peak_memory_gib": peak_memory(device),
    }
    del trainer, model
    return out


def run_reference(precision: str, *, config: Any, data: Any, args: argparse.Namespace, device: torch.device) -> dict:
    """fully_shard + torch.compile by hand (torchtitan's recipe, in ~20 lines)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reset_memory(device)
    model = build_model(config, device)
    if precision == "fp8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        fp8 = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=device.type != "cuda")
        convert_to_float8_training(model, config=fp8, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x_all, y_all = data.tensors
    times, loss = [], None
    for step in range(args.warmup + args.steps):
        i = (step * args.batch) % len(x_all)
        x, y = x_all[i:i + args.batch].to(device), y_all[i:i + args.batch].to(device)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter())
    out = {
        "seconds": times[-1] - times[args.warmup - 1],
        "final_loss": float(loss.detach()),
        "peak_memory_gib": peak_memory(device),
    }
    del model, opt
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny Llama on the CPU: checks the script, measures nothing"
    )
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tiny = args.tiny
    args.seq = args.seq or (32 if tiny else 2048)
    args.batch = args.batch or (2 if tiny else 4)
    args.steps = args.steps or (2 if tiny else 20)
    args.warmup = args.warmup or (1 if tiny else 5)
    args.out = args.out or os.path.join(RESULTS, "fp8_compile_tiny.json" if tiny else "fp8_compile.json")

    import shardwise
    from torch.utils.data import TensorDataset

    env = shardwise.init()
    device = env.device
    if not tiny and device.type != "cuda":
        raise SystemExit("no GPU here: run with --tiny to check the script on the CPU")
    config = llama_config(tiny)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, ((args.warmup + args.steps) * args.batch, args.seq + 1), generator=gen)
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    probe = build_model(config, torch.device("meta"))
    fpt = flops_per_token(probe, config, args.seq)
    params = sum(p.numel() for p in probe.parameters())
    del probe
    peak = H200_BF16_PEAK if device.type == "cuda" else None

    runs: dict[str, dict] = {}
    plans = {
        "shardwise bf16 eager": "zero=3,precision=bf16",
        "shardwise bf16 compiled": "zero=3,precision=bf16,compile",
        "shardwise fp8 compiled": "zero=3,precision=fp8,compile",
    }
    for name, plan in plans.items():
        runs[name] = {"plan": plan, **run_shardwise(plan, config=config, data=data, args=args, device=device)}
    for precision in ("bf16", "fp8"):
        runs[f"reference {precision} compiled"] = run_reference(
            precision, config=config, data=data, args=args, device=device
        )
    tokens = args.steps * args.batch * args.seq
    for run in runs.values():
        run["tokens_per_s"] = tokens / run["seconds"]
        run["mfu_bf16_peak"] = run["tokens_per_s"] * fpt / peak if peak else None
    tps = {k: v["tokens_per_s"] for k, v in runs.items()}
    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu (--tiny: FP8 emulated, numbers mean nothing)",
        "model": {
            "params": params,
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "seq": args.seq,
            "batch": args.batch,
            "flops_per_token": fpt,
        },
        "runs": runs,
        "ratios": {
            "shardwise/reference bf16 compiled": tps["shardwise bf16 compiled"] / tps["reference bf16 compiled"],
            "shardwise/reference fp8 compiled": tps["shardwise fp8 compiled"] / tps["reference fp8 compiled"],
            "shardwise bf16 eager/reference bf16 compiled": tps["shardwise bf16 eager"]
            / tps["reference bf16 compiled"],
            "compiled/eager (shardwise bf16)": tps["shardwise bf16 compiled"] / tps["shardwise bf16 eager"],
            "fp8/bf16 (shardwise compiled)": tps["shardwise fp8 compiled"] / tps["shardwise bf16 compiled"],
        },
        "command": "python bench/gpu_fp8_compile.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    for name, run in runs.items():
        mfu = f"{run['mfu_bf16_peak']:.1%}" if run["mfu_bf16_peak"] else "-"
        mem = f"{run['peak_memory_gib']:.1f} GiB" if run["peak_memory_gib"] else "-"
        print(
            f"{name:26s} {run['tokens_per_s']:12,.0f} tokens/s  MFU {mfu:>6s}  peak {mem:>9s}  loss "
            f"{run['final_loss']:.4f}"
        )
    for name, value in result["ratios"].items():
        print(f"{name:45s} {value:.3f}")
    print(args.out)


if __name__ == "__main__":
    main()
