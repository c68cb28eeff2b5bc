"""MLflow with the defaults: its default store (MLflow 3: sqlite:///mlflow.db) opens with what
shardwise[mlflow] installs; a file store the user names switches MLflow 3's opt-in on for the run
(the command prints one line, a logger logs one), one switched off on purpose stays an error."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from shardwise.config import LogSection  # noqa: E402
from shardwise.errors import ConfigError  # noqa: E402
from shardwise.jobs.tracking import FILE_STORE_SWITCH, check_tracker  # noqa: E402


@pytest.fixture()
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in (FILE_STORE_SWITCH, "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(var, "")  # recorded, so that what a test sets is taken back afterwards
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_default_store_opens_and_needs_no_switch(clean: Path) -> None:
    assert (
        check_tracker(LogSection(tracker="mlflow")) == {}
    )  # sqlite:///mlflow.db: SQLAlchemy and Alembic are installed
    assert (clean / "mlflow.db").is_file()


def test_a_named_file_store_gets_the_switch_and_one_switched_off_is_refused(
    clean: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = (clean / "mlruns").as_uri()
    assert check_tracker(LogSection(tracker="mlflow", tracking_uri=uri)) == {FILE_STORE_SWITCH: "true"}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # named through MLflow's own variable: the same
    assert check_tracker(LogSection(tracker="mlflow")) == {FILE_STORE_SWITCH: "true"}
    monkeypatch.setenv(FILE_STORE_SWITCH, "false")  # the user's own "no" stands
    with pytest.raises(ConfigError, match="file store.*MLFLOW_ALLOW_FILE_STORE=true"):
        check_tracker(LogSection(tracker="mlflow", tracking_uri=uri))


def test_a_logger_given_a_file_store_switches_it_on_with_one_line(
    clean: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from shardwise.train.trackers import MLflowLogger

    logger = MLflowLogger((clean / "mlruns").as_uri(), experiment="x", run_name="r")
    with caplog.at_level(logging.INFO, logger="shardwise.train"):
        logging.getLogger("shardwise").propagate = True
        try:
            logger.log({"loss": 1.5}, step=1)
        finally:
            logging.getLogger("shardwise").propagate = False
    logger.close()
    assert os.environ[FILE_STORE_SWITCH] == "true"
    assert [r.getMessage() for r in caplog.records if FILE_STORE_SWITCH in r.getMessage()] and (
        clean / "mlruns"
    ).is_dir()
