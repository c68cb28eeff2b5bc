"""The verify engine: a parallel layout against one process on the same seed and global batches
(:mod:`shardwise.verify.parity`) and the exact global gradient norm it compares
(:mod:`shardwise.verify.grad_norm`). ``shardwise verify`` and the parity tests run it."""
