"""Worker entry points: what each process of a built-in job runs (``python -m shardwise.jobs.<job>``)."""
