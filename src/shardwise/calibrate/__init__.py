"""Measuring this machine for the planner: concurrent timing windows, matmul, transformer-layer,
optimizer, collective and parallel-layer costs, and the per-host cache ``Trainer(plan="auto")``
reads. It runs real training steps of parallelized models, so it sits above ``train/``; the pure
cost model that uses its figures is :mod:`shardwise.plan`."""
