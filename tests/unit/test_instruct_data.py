"""Instruction data (shardwise.data.instruct, .records, .batching, .example_stream): which tokens the
loss covers, the one-line errors that name the file and line, padding and packing, a packed row
whose documents each get the loss they have alone, and a stream that resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from shardwise.data.batching import PackedExamples, PadCollate, PaddedExamples, pack  # noqa: E402
from shardwise.data.example_stream import ExampleStream  # noqa: E402
from shardwise.data.instruct import (  # noqa: E402
    InstructFormat,
    make_examples,
    piece,
    template_roles,
    tokenize,
)
from shardwise.data.records import Record, read_records  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.models import hf  # noqa: E402

CHAT = InstructFormat(format="chat")
PC = InstructFormat()


@pytest.fixture(scope="module")
def tok():
    texts = ["What is two plus three? Two plus three is five.", "def f(x):\n    return x + 1\n"] * 4
    return hf.tiny_tokenizer(texts, vocab=160, chat=True)


def chat(*turns: str, system: str | None = None) -> dict:
    roles = ["user", "assistant"] * len(turns)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": r, "content": c} for r, c in zip(roles, turns)
    ]
    return {"messages": messages}


def learned_text(tok, record: dict, fmt: InstructFormat = CHAT) -> list[str]:
    tokens, learned = tokenize(Record("t:1", record), tok, fmt)
    out, run = [], []
    for t, keep in zip(tokens.tolist(), learned.tolist()):
        if keep:
            run.append(t)
        elif run:
            out.append(tok.decode(run))
            run = []
    return out + ([tok.decode(run)] if run else [])


def test_chat_loss_covers_the_assistant_turns_only(tok) -> None:
    record = chat("What is two plus three?", "five", "And doubled?", "ten", system="Add.")
    assert learned_text(tok, record) == ["five<eos>\n", "ten<eos>\n"]
    everything = learned_text(tok, record, InstructFormat(format="chat", train_on="prompt"))
    assert len(everything) == 1 and everything[0].startswith("<|system|>")


def test_prompt_completion_learns_the_completion_and_its_end(tok) -> None:
    assert learned_text(tok, {"prompt": "def f(x):", "completion": " return x"}, PC) == [" return x<eos>"]
    tokens, learned = tokenize(
        Record("t:1", {"q": "a", "a": "b"}), tok, InstructFormat(prompt_key="q", completion_key="a")
    )
    p = piece(tokens, learned, seq_len=16)
    assert p.shape[0] == 2 and (p[1] >= 0).sum() == learned[1:].sum()  # targets are the next tokens where learned


def test_a_prompt_that_fills_the_context_is_dropped_and_counted(tok) -> None:
    records = [
        Record("t:1", {"prompt": "two plus three " * 8, "completion": "five"}),
        Record("t:2", {"prompt": "x", "completion": "y"}),
    ]
    examples = make_examples(records, tok, PC, seq_len=8)
    assert (examples.records, examples.dropped, len(examples.pieces)) == (2, 1, 1)
    assert "dropped 1 of 2 whose prompt alone fills the 8-token context (the first: t:1)" in examples.describe(8)
    with pytest.raises(
        ConfigError,
        match=r"none of the 1 record\(s\) leaves a target to learn within the 8-token context \(the first: t:1\)",
    ):
        make_examples(records[:1], tok, PC, seq_len=8)


@pytest.mark.parametrize(
    "line, fmt, expect",
    [
        ("{oops", PC, r"data\.jsonl:2 is not JSON"),
        ("[1, 2]", PC, r"data\.jsonl:2 is a JSON list, not an object"),
        ('{"prompt": "x"}', PC, r"data\.jsonl:2 has no field 'completion'"),
        ('{"prompt": 3, "completion": "y"}', PC, r"data\.jsonl:2: field 'prompt' holds int, not str"),
        (json.dumps(chat("hi")), CHAT, r"data\.jsonl:2: the chat has no assistant turn"),
        ('{"messages": [{"role": "user"}]}', CHAT, r"data\.jsonl:2: message 0 of 'messages' is not"),
        (
            '{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}',
            CHAT,
            r"data\.jsonl:2: message 0 has role 'wizard', which the tokenizer's chat template does not know; use one "
            r"of assistant, system, tool, user",
        ),
    ],
)
def test_bad_records_name_the_file_and_line(tmp_path: Path, tok, line: str, fmt: InstructFormat, expect: str) -> None:
    path = tmp_path / "data.jsonl"
    good = json.dumps(chat("hi", "hello") if fmt.format == "chat" else {"prompt": "a", "completion": "b"})
    path.write_text(good + "\n\n" + line + "\n")  # a blank line is no record: the bad one is on line 3
    with pytest.raises(ConfigError, match=expect.replace(":2", ":3")):
        make_examples(read_records(str(path)), tok, fmt, seq_len=32)


def test_chat_needs_a_template_that_renders_turn_by_turn(tok) -> None:
    plain = hf.tiny_tokenizer(["abc"], vocab=64)
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        make_examples([Record("t:1", chat("a", "b"))], plain, CHAT, seq_len=16)
    plain.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(
        ConfigError, match="t:1: the tokenizer's chat template does not render the conversation turn by turn"
    ):
        make_examples([Record("t:1", chat("a", "b"))], plain, CHAT, seq_len=16)


def test_the_roles_of_a_chat_are_the_standard_ones_and_those_the_template_names(tok) -> None:
    named = ("{% for m in messages %}{% if m['role'] == 'ipython' %}<|ipython|>{% elif \"critic\" == m.role %}C"
             "{% elif m['role'] not in ['developer', 'user'] %}{% endif %}{{ m['content'] }}{% endfor %}")
    assert template_roles(named) == {"system", "user", "assistant", "tool", "ipython", "critic", "developer"}
    assert template_roles({"default": named, "tool_use": "{% if message.role == 'observer' %}{% endif %}"}) >= {
        "ipython",
        "observer",
    }
    assert template_roles(tok.chat_template) == {"system", "user", "assistant", "tool"}
    record = {
        "messages": [
            {"role": "tool", "content": "3"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"},
        ]
    }
    assert learned_text(tok, record) == ["ok<eos>\n"]


def test_padding_and_packing_layout() -> None:
    a, b, c = (np.stack([np.arange(n) + 10, np.arange(n) + 20]) for n in (3, 4, 6))
    rows = pack([a, b, c], seq_len=8, pad_id=0)
    assert len(rows) == 2
    assert rows[0][2].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]  # positions restart per document, the padding is its own
    assert rows[0][1].tolist()[-1] == -100 and rows[1][0].tolist() == [10, 11, 12, 13, 14, 15, 0, 0]
    inputs, targets = PadCollate(pad_id=0, multiple_of=4, max_len=8)([PaddedExamples([a, c])[i] for i in range(2)])
    assert inputs.shape == (2, 8) and targets[0].tolist() == [20, 21, 22, -100, -100, -100, -100, -100]
    item = PackedExamples([a, b], seq_len=8, pad_id=0)[0]
    assert set(item) == {"inputs", "targets", "position_ids"}


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_a_packed_row_gives_each_document_the_loss_it_has_alone(family: str) -> None:
    model = hf.build_causal_lm(hf.tiny_config(family, seq=32), seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 64, (2, n), generator=gen) for n in (9, 5, 12)]  # [inputs; targets] of each document
    docs[1][1, :2] = -100  # a prompt
    rows = pack([d.numpy() for d in docs], seq_len=32, pad_id=0)
    assert len(rows) == 1
    item = PackedExamples([d.numpy() for d in docs], seq_len=32, pad_id=0)[0]
    with torch.no_grad():
        logits = hf.logits_of(model(item["inputs"][None], position_ids=item["position_ids"][None]))[0]
        at = 0
        for d in docs:
            n = d.shape[1]
            alone = F.cross_entropy(hf.logits_of(model(d[0][None]))[0], d[1], ignore_index=-100)
            packed = F.cross_entropy(logits[at:at + n], item["targets"][at:at + n], ignore_index=-100)
            torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
            at += n
    hf.check_packing(model, vocab_size=64, what=family)


def test_a_model_that_ignores_document_boundaries_is_refused() -> None:
    from shardwise.models.gpt import GPT, GPTConfig

    with pytest.raises(ConfigError, match="does not keep packed documents apart"):
        hf.check_packing(
            GPT(GPTConfig(vocab_size=64, seq_len=32, layers=1, hidden=32, heads=2)), vocab_size=64, what="the GPT"
        )


@pytest.mark.parametrize("packing", [False, True])
def test_a_stream_resumes_exactly_and_shards_every_sample_once(tmp_path: Path, tok, packing: bool) -> None:
    for part in range(2):
        with open(tmp_path / f"part{part}.jsonl", "w") as fh:
            for i in range(7):
                fh.write(json.dumps(chat(f"what is {i} plus {part}?", "it is " + "so " * (i % 4))) + "\n")
    files = sorted(str(p) for p in tmp_path.glob("*.jsonl"))

    def stream(rank: int = 0, size: int = 1) -> ExampleStream:
        s = ExampleStream(files, tokenizer=tok, fmt=CHAT, seq_len=48, pad_id=0, packing=packing, shuffle=True, seed=3)
        s.shard(dp_rank=rank, dp_size=size, micro_batch=1, global_batch=size)
        return s

    def key(sample) -> tuple:
        return tuple((sample["inputs"] if packing else sample[0]).tolist())

    whole = [key(x) for x in iter(stream())]
    assert len(whole) == len(set(whole)) > 4
    shards = [[key(x) for x in iter(stream(r, 2))] for r in range(2)]
    assert sorted(shards[0] + shards[1]) == sorted(whole[:len(shards[0]) + len(shards[1])])
    first = iter(stream())
    head = [key(next(first)) for _ in range(3)]
    state = first.state_dict()
    restored = iter(stream())  # torchdata's order: iter, then the worker's state
    restored.load_state_dict(state)
    rest = []
    while (x := next(restored, None)) is not None:
        rest.append(key(x))
    assert head + rest == whole


def test_parquet_records_name_their_row_and_skip_whole_row_groups(tmp_path: Path, tok) -> None:
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"q": ["a", "b", "c", "d", "e"], "a": ["1", "2", "3", "4", None]}), path, row_group_size=2)
    assert [(r.where.rsplit(" ", 2)[-2:], r.value["q"]) for r in read_records(str(path), skip=3)] == [
        (["row", "4"], "d"),
        (["row", "5"], "e"),
    ]
    fmt = InstructFormat(prompt_key="q", completion_key="a")
    with pytest.raises(ConfigError, match=r"qa\.parquet row 5: field 'a' holds NoneType, not str"):
        make_examples(read_records(str(path)), tok, fmt, seq_len=16)
