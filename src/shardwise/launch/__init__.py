"""Starting processes: ``shardwise run`` (scripts, :mod:`shardwise.launch.run` on the flags of
:mod:`shardwise.launch.options`), :func:`shardwise.launch.inprocess.launch` (functions) and
``shardwise slurm`` (:mod:`shardwise.launch.sbatch`), all on torch's elastic agent; and
``shardwise run --hostfile`` (:mod:`shardwise.launch.multihost`: hosts, pre-flight, one ssh
session per node, the remote side's stdin lifeline)."""
