"""Slurm host-list parsing without calling ``scontrol``.

Slurm compresses host lists as ``prefix[ranges]suffix`` groups separated by commas, for example
``node[01-04,7]``, ``a1,b2`` or ``gpu-[01-02,05]``; several bracket groups may appear in one name
(``rack[1-2]-node[1-2]`` expands to the cartesian product). Zero padding is kept: ``[08-10]`` gives
``08, 09, 10``.
"""

from __future__ import annotations

import itertools
import re

from shardwise.errors import ShardwiseError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _bad(text, "nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _bad(text, "']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise _bad(text, "unclosed '['")
    parts.append(text[start:])
    return parts


def _bad(text: str, why: str) -> ShardwiseError:
    return ShardwiseError(
        f"malformed Slurm node list {text!r} ({why})",
        hint="expected forms like 'node[01-04,7]', 'a1,b2' or 'gpu-[01-02,05]'; check SLURM_JOB_NODELIST",
    )


def _expand_ranges(body: str, whole: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise _bad(whole, f"bad range {item!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise _bad(whole, f"range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_name(name: str, whole: str) -> list[str]:
    # Alternate literal text and bracket bodies: "gpu-[01-02]x[1-2]" -> ["gpu-", "01-02", "x", "1-2", ""]
    pieces = re.split(r"\[([^\]]*)\]", name)
    choices: list[list[str]] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if "[" in piece or "]" in piece:
                raise _bad(whole, "unbalanced brackets")
            choices.append([piece])
        else:
            choices.append(_expand_ranges(piece, whole))
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list into host names, in order."""
    text = nodelist.strip()
    if not text:
        raise _bad(nodelist, "empty")
    hosts: list[str] = []
    for name in _split_top_level(text):
        name = name.strip()
        if not name:
            raise _bad(nodelist, "empty host name")
        hosts.extend(_expand_name(name, nodelist))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: where shardwise puts the rendezvous."""
    return expand_nodelist(nodelist)[0]
