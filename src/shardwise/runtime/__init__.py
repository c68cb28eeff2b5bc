"""Where this process sits in the distributed world, one module per job:

- :mod:`~shardwise.runtime.detect`: who started this process (torchrun, mpirun, Slurm, none) as a
  :class:`~shardwise.runtime.detect.RuntimeEnv`; torch-free, so flag parsing stays fast;
- :mod:`~shardwise.runtime.settings`: shardwise's own environment variables, read once;
- :mod:`~shardwise.runtime.env`: ``init`` / ``shutdown`` / ``barrier`` of the process group;
- :mod:`~shardwise.runtime.logging`: rank-aware logging;
- :mod:`~shardwise.runtime.watchdog` and :mod:`~shardwise.runtime.hang_report`: the hang watchdog
  ``init`` starts.

The public names (``shardwise.init``, ``shardwise.RuntimeEnv`` ...) are re-exported by the top
package; nothing is imported here, so importing one module does not pull in torch.
"""
