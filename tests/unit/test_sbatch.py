"""``shardwise slurm``'s script: every ``sbatch --time`` form, and the SIGUSR1 warning before the limit."""

from __future__ import annotations

import math
import re

import pytest

from shardwise.errors import ShardwiseError
from shardwise.launch.sbatch import SbatchSpec, render_sbatch, slurm_time_seconds

# (value, seconds) for each form sbatch accepts
FORMS = [
    ("120", 7200), ("1", 60), ("0:30", 30), ("90:15", 5415), ("24:00:00", 86400), ("100:00:00", 360000),
    ("2-12", 216000), ("1-0:30", 88200), ("2-00:00:00", 172800), ("0-0:0:45", 45),
]


@pytest.mark.parametrize("value,seconds", FORMS)
def test_every_slurm_form_is_accepted_and_warned_before_the_limit(value: str, seconds: int) -> None:
    assert slurm_time_seconds(value) == seconds
    text = render_sbatch(SbatchSpec(script=("train.py",), time=value))
    assert f"#SBATCH --time={value}\n" in text
    warning = int(re.search(r"#SBATCH --signal=B:USR1@(\d+)", text).group(1))
    limit = math.ceil(seconds / 60) * 60  # Slurm rounds a limit up to whole minutes
    assert 0 < warning < limit and warning <= 120


def test_no_limit_keeps_the_two_minute_warning() -> None:
    assert slurm_time_seconds("0") == 0
    assert "#SBATCH --signal=B:USR1@120 " in render_sbatch(SbatchSpec(script=("train.py",), time="0"))


@pytest.mark.parametrize(
    "value", ["forever", "", "1:2:3:4", "10:75", "1:60:00", "2-", "2-24", "-5", "1.5", "1d", "1-2-3", " 120"]
)
def test_other_forms_are_refused(value: str) -> None:
    with pytest.raises(ShardwiseError, match="is not a Slurm time"):
        render_sbatch(SbatchSpec(script=("train.py",), time=value))
