"""Measuring this machine for the planner: concurrent timing windows, matmul, transformer-layer,
optimizer, collective and parallel-layer costs (the per-host cache ``Trainer(plan="auto")`` reads
is :mod:`shardwise.auto.machine`). It runs real training steps of parallelized models with
``parallel/`` and ``verify/``, never the Trainer, so it sits below ``auto/`` and ``train/``; the pure
cost model that uses its figures is :mod:`shardwise.plan`."""
