"""The one exception type users see.

Every check of user input raises :class:`ShardwiseError` with a message that says what is wrong
and what to do. The CLI prints it as one line and exits non-zero; library users can catch it.
"""

from __future__ import annotations


class ShardwiseError(Exception):
    """Bad input or an environment problem, explained for the user.

    ``str(err)`` is ``"<what is wrong>"`` or ``"<what is wrong>; <what to do>"`` when a hint is given.
    """

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message}; {hint}" if hint else message)


class ConfigError(ShardwiseError):
    """A configuration key, value or combination that cannot work."""


class LaunchError(ShardwiseError):
    """Processes could not be started, could not meet, or failed."""
