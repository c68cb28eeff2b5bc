"""``shardwise.launch(fn)`` sends ``fn`` to its workers by pickle (shardwise.launch.call_worker): a
function a fresh interpreter cannot import is refused with one line before any process starts."""

from __future__ import annotations

import pytest

from shardwise import launch
from shardwise.errors import LaunchError


def test_a_function_the_workers_cannot_import_is_refused_before_starting() -> None:
    def nested() -> int:
        return 1

    for fn in (lambda: 1, nested):
        with pytest.raises(LaunchError) as err:
            launch(fn, nprocs=2)
        assert "cannot send" in str(err.value) and "module level" in err.value.hint
