"""Hugging Face ``transformers`` causal language models: tiny configurations, building, the loss, the shape.

The optional extra ``shardwise[hf]`` installs ``transformers``; nothing else in shardwise imports
it, and this module imports it only inside its functions (:func:`require_transformers` turns a
missing install into one line naming the fix).

- :func:`tiny_config` — a small configuration of a family (``llama``, ``qwen2``, ``mistral``,
  ``gemma``, ``phi``, ``gpt2``, ``mixtral``, ``phi3``: fused ``qkv_proj`` and ``gate_up_proj``)
  with dropout and the KV cache off, for tests,
  examples and ``shardwise verify --script`` files; nothing is downloaded.
- :func:`build_causal_lm` — ``torch.manual_seed(seed)`` then ``AutoModelForCausalLM.from_config``:
  the same weights on every rank for the same seed.
- :func:`lm_loss` — next-token cross-entropy on a model output (a ``ModelOutput`` with ``logits``
  or a logits tensor, which is what a pipeline's last stage hands the loss), the mean over the
  targets that are not ``-100`` (padding, prompts): a token mean, for ``loss_reduction="tokens"``.
- :func:`shape_of` — the planner's :class:`~shardwise.shape.TransformerShape` read from a config.
- :func:`check_packing` — refuses a model that does not keep packed documents apart (a packed
  row's documents must get the logits each has alone).
- :func:`save_tiny` — a small model directory with a BPE tokenizer (and a chat template) made locally.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.models.hf_import import check_transformers  # noqa: F401 - re-exported: callers import it from here
from shardwise.models.hf_import import require_transformers
from shardwise.shape import TransformerShape

FAMILIES = ("llama", "qwen2", "mistral", "gemma", "phi", "gpt2", "mixtral", "phi3")


def tiny_config(family: str, *, layers: int = 4, hidden: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 64,
                seq: int = 32, **overrides: Any) -> Any:
    """A small ``transformers`` config of ``family`` (module doc); ``overrides`` are config keys."""
    tf = require_transformers()
    if family not in FAMILIES:
        raise ConfigError(f"model family {family!r} is unknown", hint=f"use one of {', '.join(FAMILIES)}")
    if family == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    else:
        common = dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=seq,
            use_cache=False,
            attention_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=None,
        )
        classes = {
            "llama": tf.LlamaConfig,
            "qwen2": tf.Qwen2Config,
            "mistral": tf.MistralConfig,
            "gemma": tf.GemmaConfig,
            "phi": tf.PhiConfig,
            "mixtral": tf.MixtralConfig,
            "phi3": tf.Phi3Config,
        }
        extra: dict[str, Any] = {}
        if family == "gemma":
            extra = {"head_dim": hidden // heads}
        if family in ("phi", "phi3"):
            extra = {"resid_pdrop": 0.0, "embd_pdrop": 0.0}
        if family == "mixtral":
            extra = {"num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0}
        cfg = classes[family](**common, **extra)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_causal_lm(config: Any, *, seed: int = 0) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` after ``torch.manual_seed(seed)``, in fp32, eager-free
    attention as the config says (``sdpa`` by default), with the KV cache off."""
    tf = require_transformers()
    config.use_cache = False
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config)


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: a tensor, a ``ModelOutput``'s ``logits`` or a tuple's first element."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConfigError(
        f"cannot find logits in a {type(output).__name__}", hint="return a tensor or a ModelOutput with .logits"
    )


IGNORE_INDEX = -100  # Hugging Face's labels (and torch's cross-entropy) mark "no target" with it


def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the valid targets: ``targets[b, t]`` is the token after
    ``inputs[b, t]``, or ``-100`` where nothing is to be learned (padding, a prompt)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def read_config(directory: str) -> dict[str, Any]:
    """``config.json`` of a model directory (or that file itself) as a dict (one line naming the problem otherwise)."""
    path = os.path.join(directory, "config.json")
    if os.path.isfile(directory) and directory.endswith(".json"):
        path = directory
    elif not os.path.isdir(directory):
        raise ConfigError(
            f"model directory {directory!r} does not exist", hint="pass a directory written by save_pretrained"
        )
    if not os.path.exists(path):
        raise ConfigError(
            f"{directory!r} holds no config.json",
            hint="pass a Hugging Face model directory (save_pretrained writes config.json)",
        )
    try:
        with open(path) as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON ({exc.msg} at line {exc.lineno})") from None


def shape_of(config: Any, *, seq_len: int | None = None) -> TransformerShape:
    """The planner's shape of a Hugging Face config (an object or a ``config.json`` dict).

    A mixture of experts (``num_local_experts``) counts all experts' MLP parameters (``ffn`` =
    intermediate size x experts), so memory is right; its compute is then over-counted by
    experts / experts-per-token (the shape has no field for routing)."""
    data = config if isinstance(config, dict) else config.to_dict()
    get = data.get
    hidden = get("hidden_size") or get("n_embd")
    experts = int(get("num_local_experts") or get("num_experts") or 1)
    heads = get("num_attention_heads") or get("n_head")
    gpt2 = get("model_type") == "gpt2"
    values = {
        "layers": get("num_hidden_layers") or get("n_layer"), "hidden": hidden, "heads": heads,
        "vocab_size": get("vocab_size"), "seq_len": seq_len or get("max_position_embeddings") or get("n_positions"),
        "ffn": (get("intermediate_size") or get("n_inner") or 0) * experts, "kv_heads": get("num_key_value_heads") or 0,
        "tied_embeddings": bool(get("tie_word_embeddings", gpt2)), "bias": gpt2 or bool(get("attention_bias", False)),
        "learned_positions": gpt2, "separate_qkv": not gpt2, "name": str(get("model_type") or "hf"),
    }
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise ConfigError(
            f"the model config has no {missing[0]} (hidden_size, num_attention_heads, num_hidden_layers, vocab_size, "
            "max_position_embeddings)",
            hint="pass a decoder-only language model's config",
        )
    return TransformerShape(**values)


# Families whose MLP is gated (SwiGLU / GeGLU: gate, up and down projections, 3 h f weights).
GATED_FAMILIES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "olmo",
    "olmo2",
    "phi3",
    "granite",
    "cohere",
)


def stats_of_config(config: Any, *, seq: int | None = None) -> Any:
    """The planner's statistics of a Hugging Face config (an object or a ``config.json`` dict) at
    ``seq`` tokens per sample (default: its context length): :func:`shape_of`'s shape, with a gated
    MLP for the families that have one (:data:`GATED_FAMILIES`)."""
    from shardwise.plan.stats import transformer_stats

    data = config if isinstance(config, dict) else config.to_dict()
    return transformer_stats(shape_of(data, seq_len=seq), seq=seq, gated_mlp=data.get("model_type") in GATED_FAMILIES)


def load_tokenizer(directory: str) -> Any:
    """The tokenizer saved in a model directory (``AutoTokenizer``, local files only)."""
    tf = require_transformers()
    read_config(directory)
    try:
        return tf.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{directory!r} holds no tokenizer ({str(exc).splitlines()[0][:120]})",
                          hint="save one into the model directory (tokenizer.save_pretrained(dir))") from None


# A chat template of the ChatML kind for save_tiny's tokenizers: each turn is "<|role|>\n" content
# "<eos>\n", and the generation prompt is "<|assistant|>\n" (it renders a chat turn by turn).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT_ROLES = ("<|system|>", "<|user|>", "<|assistant|>")


def check_packing(model: nn.Module, *, vocab_size: int, what: str = "the model") -> None:
    """Refuse ``model`` for packed batches unless two documents packed into one row with restarting
    ``position_ids`` get the logits each has alone (fp32, on the CPU, rtol 1e-4): the model must keep
    them apart by itself (Hugging Face models build a block mask from such ``position_ids`` when no
    ``attention_mask`` is passed; a model or attention backend that does not would let tokens attend
    across the boundary)."""
    import inspect

    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ConfigError(f"{what} takes no position_ids, so packed documents cannot restart their positions",
                          hint="use padded batches (--data.packing false)")
    gen = torch.Generator().manual_seed(0)
    first, second = (
        torch.randint(0, vocab_size, (1, 5), generator=gen),
        torch.randint(0, vocab_size, (1, 7), generator=gen),
    )
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = logits_of(model(torch.cat([first, second], dim=1), position_ids=positions)).float()
            alone = torch.cat([logits_of(model(first)).float(), logits_of(model(second)).float()], dim=1)
    finally:
        model.train(was_training)
    worst = float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-6))
    if not worst <= 1e-4:
        attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ConfigError(
            f"{what}{f' (attention {attention!r})' if attention else ''} does not keep packed documents apart: "
            f"a packed row's logits differ from the documents' own by {worst:.1e}",
            hint="use padded batches (--data.packing false), or an attention backend that honours position_ids",
        )


def check_packing_of(directory: str) -> None:
    """:func:`check_packing` on a model of ``directory``'s architecture made small (one layer, narrow,
    random weights: the mask, not the weights, is checked), so it costs a fraction of a second."""
    tf = require_transformers()
    config = tf.AutoConfig.from_pretrained(directory, local_files_only=True)
    small = {
        "num_hidden_layers": 1,
        "n_layer": 1,
        "hidden_size": 64,
        "n_embd": 64,
        "intermediate_size": 128,
        "n_inner": 128,
        "num_attention_heads": 4,
        "n_head": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 128,
    }
    for key, value in small.items():
        if hasattr(config, key) and getattr(config, key) is not None:
            setattr(config, key, value)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    name = f"{config.model_type} from {directory}"
    try:
        model = build_causal_lm(config)
    except Exception as exc:  # noqa: BLE001 - a config that cannot be made small: say so instead of guessing
        raise ConfigError(
            f"cannot check that {name} keeps packed documents apart ({type(exc).__name__}: {str(exc)[:120]})",
            hint="use padded batches (--data.packing false)",
        ) from None
    check_packing(model, vocab_size=128, what=name)


def tiny_tokenizer(texts: list[str], *, vocab: int = 256, chat: bool = False) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (``<unk>``, ``<eos>``), as a ``transformers``
    fast tokenizer; ``chat``: with :data:`CHAT_TEMPLATE` and its role markers as special tokens."""
    tf = require_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<eos>", *(CHAT_ROLES if chat else ())]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                      additional_special_tokens=list(CHAT_ROLES) if chat else None)
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny(
    directory: str,
    *,
    family: str = "llama",
    texts: list[str],
    vocab: int = 256,
    seed: int = 0,
    chat: bool = False,
    **config: Any,
) -> Any:
    """Write a small model of ``family`` with a byte-level BPE tokenizer trained on ``texts`` to
    ``directory`` (``config.json``, ``model.safetensors``, tokenizer files): a Hugging Face model
    directory made locally, for examples and tests. ``chat``: the tokenizer gets
    :data:`CHAT_TEMPLATE` and its role markers as special tokens. Returns the model's config."""
    fast = tiny_tokenizer(texts, vocab=vocab, chat=chat)
    size = -(-len(fast) // 8) * 8  # a multiple of 8, so tensor parallelism can split the vocabulary
    cfg = tiny_config(family, vocab=size, **config)
    cfg.eos_token_id = fast.eos_token_id
    cfg.bos_token_id = fast.eos_token_id
    build_causal_lm(cfg, seed=seed).save_pretrained(directory)
    fast.save_pretrained(directory)
    return cfg
