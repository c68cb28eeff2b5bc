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


class StoppedBySignal(ShardwiseError):
    """A command received a signal (a scheduler's pre-emption or time-limit warning, Ctrl-C) and
    stopped its workers. Not a failure of the job: the CLI prints the message without "error" and
    exits with :attr:`exit_code`, ``128 + signal`` (143 for SIGTERM, 138 for SIGUSR1, 130 for SIGINT),
    the status a shell reports for a process ended by that signal, which schedulers and wrapper
    scripts read as "stopped from outside; run it again" rather than "broken"."""

    def __init__(self, message: str, *, signum: int, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
