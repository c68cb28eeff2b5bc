"""Importing Hugging Face ``transformers`` (the optional extra ``shardwise[hf]``) for
:mod:`shardwise.models.hf`: :func:`require_transformers` (the module, or one line naming the fix),
:func:`check_transformers` (the same check without the import) and the import of its quantizers
without torchao. Both functions stay importable from :mod:`shardwise.models.hf`."""

from __future__ import annotations

from typing import Any

from shardwise.errors import ConfigError


def require_transformers() -> Any:
    """The ``transformers`` module, or a ConfigError saying how to install it; its quantizers are
    imported without torchao (:func:`_quantizers_without_torchao`)."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "Hugging Face models need the 'transformers' package", hint="pip install 'shardwise[hf]'"
        ) from None
    _quantizers_without_torchao()
    return transformers


def check_transformers() -> None:
    """:func:`require_transformers`'s check without the import (1-2 CPU-seconds), for a command
    that checks its input before it starts the processes that import it."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError("Hugging Face models need the 'transformers' package", hint="pip install 'shardwise[hf]'")


def _quantizers_without_torchao() -> None:
    """Import ``transformers.quantizers`` (every model build does) with torchao reported absent.

    When torchao is installed, transformers imports it to register its torchao quantizer: about 3
    CPU-seconds in every process that builds a model, for loading torchao-quantized checkpoints,
    which shardwise does not do. torchao is imported by what uses it instead (``precision=fp8``:
    :mod:`shardwise.parallel.fp8`; ``--lora.base nf4``: :mod:`shardwise.models.nf4`; peft). Once
    the quantizers are imported, the check is transformers' own again. Where that is not possible
    (torchao already imported, another transformers layout), torchao is imported as transformers
    does, with its load-time noise about GPU kernels and enums quieted."""
    import contextlib
    import importlib
    import importlib.util
    import sys

    if importlib.util.find_spec("torchao") is None or "transformers.quantizers.auto" in sys.modules:
        return
    if "torchao" not in sys.modules:
        try:
            import transformers.utils as tf_utils

            real = tf_utils.is_torchao_available
            tf_utils.is_torchao_available = lambda *args, **kwargs: False
            try:
                module = importlib.import_module("transformers.quantizers.quantizer_torchao")
                importlib.import_module("transformers.quantizers.auto")
            finally:
                tf_utils.is_torchao_available = real
            module.is_torchao_available = real
            return
        except (ImportError, AttributeError):
            pass
    from shardwise.models.lora import quiet_torchao

    with quiet_torchao():
        import torchao  # noqa: F401

        for name in (
            "torchao.prototype.mx_formats",
            "torchao.prototype.moe_training",
        ):  # imported by transformers' quantizer
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
