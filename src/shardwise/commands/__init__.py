"""One module per ``shardwise`` subcommand; each exposes ``register(subparsers)``."""
