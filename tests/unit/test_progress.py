"""Rank 0's progress: plain lines (never a carriage return) when the stream is not a terminal, the
tqdm bar when it is; the lines carry the step, the last logged loss, tokens/s and the ETA, and come
after the first logged step, every ``every_s`` seconds and after the last step."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from shardwise.errors import ConfigError
from shardwise.train.progress import ProgressBar, duration


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _fit(
    bar: ProgressBar, steps: int, *, log_every: int = 2, clock: list[float] | None = None, stop_at: int | None = None
) -> None:
    trainer = SimpleNamespace(env=SimpleNamespace(is_main=True), step=0, total_steps=steps)
    bar.on_fit_start(trainer)
    for step in range(1, (stop_at or steps) + 1):
        trainer.step = step
        if clock is not None:
            clock[0] += 1.0  # one second per step
        metrics = {"step": step}
        if step % log_every == 0:
            metrics.update(loss=5.0 - step / 10, tokens_per_s=12345.6, samples_per_s=96.4)
        bar.on_step_end(trainer, metrics)
        if step == 4:
            bar.on_eval_end(trainer, {"val_loss": 4.25, "step": step})
    bar.on_fit_end(trainer)


def test_a_file_gets_plain_lines_every_n_seconds_with_step_loss_rate_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("shardwise.train.progress.time.monotonic", lambda: clock[0])
    out = io.StringIO()
    _fit(ProgressBar(every_s=3.0, stream=out), 10, clock=clock)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    progress = [line for line in lines if line.startswith("train ")]
    steps = [int(line.split("step ")[1].split("/")[0]) for line in progress]
    assert steps == [2, 5, 8, 10]  # the first logged step, then every 3 s (one step per second), then the last
    assert "step 2/10 (20%)  loss 4.8000  12,346 tokens/s  elapsed 2s  eta 8s" in progress[0]
    assert "loss 4.6000" in progress[1]  # the newest logged loss (step 4), not a stale one
    assert progress[-1].endswith("elapsed 10s")  # no eta after the last step
    assert "step 4: val_loss 4.25" in lines


def test_a_stopped_fit_says_where_it_stopped_and_samples_without_tokens() -> None:
    out = io.StringIO()
    bar = ProgressBar(every_s=3600, stream=out)
    trainer = SimpleNamespace(env=SimpleNamespace(is_main=True), step=0, total_steps=100)
    bar.on_fit_start(trainer)
    for step in (1, 2, 3):
        trainer.step = step
        bar.on_step_end(trainer, {"step": step, **({"loss": 2.0, "samples_per_s": 12.5} if step == 2 else {})})
    bar.on_fit_end(trainer)
    steps = [line.split("step ")[1].split("/")[0] for line in out.getvalue().splitlines()]
    assert steps == ["2", "3"] and "12.5 samples/s" in out.getvalue()


def test_a_terminal_keeps_the_bar_and_other_ranks_print_nothing() -> None:
    tty = Terminal()
    _fit(ProgressBar(stream=tty), 6)
    assert "\r" in tty.getvalue() and "6/6" in tty.getvalue() and "step 4: val_loss 4.25" in tty.getvalue()
    quiet = io.StringIO()
    bar = ProgressBar(stream=quiet)
    trainer = SimpleNamespace(env=SimpleNamespace(is_main=False), step=1, total_steps=2)
    bar.on_fit_start(trainer)
    bar.on_step_end(trainer, {"step": 1, "loss": 1.0})
    bar.on_fit_end(trainer)
    assert quiet.getvalue() == ""
    forced = io.StringIO()
    _fit(ProgressBar(stream=forced, bar=True), 2)  # bar=True draws it into a file too
    assert "\r" in forced.getvalue()


def test_durations_and_a_bad_interval() -> None:
    assert [duration(s) for s in (0, 44.6, 125, 3720)] == ["0s", "45s", "2m05s", "1h02m"]
    with pytest.raises(ConfigError, match="every_s=0"):
        ProgressBar(every_s=0)
