"""Every rank refuses its input with shardwise's own error, as a check inside the workers does."""

from shardwise.errors import ConfigError

raise ConfigError("cp=2: an attention call has a mask or is not causal", hint="drop cp")
