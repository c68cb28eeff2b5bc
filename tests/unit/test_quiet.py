"""The dependencies' noise kept off the terminal (shardwise.runtime.quiet): their warnings and log
lines are dropped, the user's own warnings and any library's errors are not, and
SHARDWISE_LOG_LEVEL=debug (what --verbose sets) keeps everything."""

from __future__ import annotations

import logging
import warnings

from shardwise.cli import build_parser
from shardwise.runtime.quiet import LOG_LEVEL_VAR, QUIET_LOGGERS, quiet_dependencies, quiet_while


def _shown(environ: dict[str, str]) -> tuple[list[str], list[int]]:
    """Which warnings survive quiet_dependencies(environ), and the quieted loggers' levels (restored after)."""
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_dependencies(environ)
            for message, category, module in (
                ("`is_gradient_checkpointing` is deprecated", FutureWarning, "transformers.modeling_utils"),
                ("old peft api", DeprecationWarning, "peft.tuners.lora"),
                (
                    "'set_vital' is deprecated, please do not call",
                    UserWarning,
                    "torchdata.stateful_dataloader.stateful_dataloader",
                ),
                (
                    "torch.distributed is disabled, unavailable or uninitialized, assuming",
                    UserWarning,
                    "torch.distributed.checkpoint.utils",
                ),
                ("a user's own deprecation", FutureWarning, "my_transformers_project.model"),
                ("torchdata says something else", UserWarning, "torchdata.nodes"),
                ("a torch warning that matters", UserWarning, "torch.distributed.fsdp"),
            ):
                warnings.warn_explicit(message, category, "x.py", 1, module=module)
        return [str(w.message) for w in caught], [logging.getLogger(name).level for name in QUIET_LOGGERS]
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_the_dependencies_warnings_are_dropped_and_the_users_are_not() -> None:
    shown, levels = _shown({})
    assert shown == ["a user's own deprecation", "torchdata says something else", "a torch warning that matters"]
    assert levels == [logging.ERROR] * len(QUIET_LOGGERS)  # torchao's "Failed to load", torch's pytree notices


def test_debug_keeps_everything() -> None:
    shown, levels = _shown({LOG_LEVEL_VAR: "DEBUG"})
    assert len(shown) == 7
    assert levels == [logging.getLogger(name).level for name in QUIET_LOGGERS]  # untouched


def test_quiet_while_quiets_the_block_and_leaves_the_process_as_it_was() -> None:
    """What a fork server does around its preload: its workers inherit neither the filters nor the levels."""
    filters, levels = list(warnings.filters), [logging.getLogger(name).level for name in QUIET_LOGGERS]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_while({}):
            warnings.warn_explicit("old peft api", DeprecationWarning, "x.py", 1, module="peft.tuners.lora")
            assert [logging.getLogger(name).level for name in QUIET_LOGGERS] == [logging.ERROR] * len(QUIET_LOGGERS)
        warnings.warn_explicit("old peft api, after", DeprecationWarning, "x.py", 1, module="peft.tuners.lora")
    assert [str(w.message) for w in caught] == ["old peft api, after"]
    assert warnings.filters == filters
    assert [logging.getLogger(name).level for name in QUIET_LOGGERS] == levels


def test_verbose_is_a_flag_of_every_command_and_of_the_top_level() -> None:
    parser = build_parser()
    assert parser.parse_args(["--verbose", "doctor"]).verbose
    assert parser.parse_args(["doctor", "--verbose"]).verbose
    assert parser.parse_args(["checkpoint", "inspect", "--verbose", "d"]).verbose
    assert not parser.parse_args(["doctor"]).verbose
    run = parser.parse_args(["run", "train.py", "--verbose"])  # after the script: the script's own argument
    assert not run.verbose and run.script_args == ["--verbose"]
