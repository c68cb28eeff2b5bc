"""Sharded text generation (``shardwise generate``): greedy or sampled decoding with a KV cache,
under tensor parallelism, from a Hugging Face directory or a shardwise checkpoint.

- :mod:`.decode`: where the model comes from (built on the meta device, parallelized, each rank
  reading its own slices), the checks before any process starts, and the decode loop;
- :mod:`.decoders`: what the loop asks of a model (one call), with the adapters of a Hugging Face
  causal LM and of the built-in GPT.

The names below are imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardwise.exports import lazy_exports

_NAMES = {
    **dict.fromkeys(("Sampling", "check_context", "check_request", "generate_ids", "load_model"),
                    "shardwise.generate.decode"),
    **dict.fromkeys(("CausalLM", "causal_lm"), "shardwise.generate.decoders"),
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = lazy_exports(__name__, _NAMES)

if TYPE_CHECKING:
    from shardwise.generate.decode import Sampling, check_context, check_request, generate_ids, load_model
    from shardwise.generate.decoders import CausalLM, causal_lm
