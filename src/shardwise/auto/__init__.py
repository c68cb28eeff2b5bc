"""``plan="auto"`` in one place: size -> measure -> choose -> certify (:func:`shardwise.auto.flow.plan_for`).

``Trainer(plan="auto")`` and ``prepare(plan="auto")`` call its one entry point, ``plan_for``
(``auto/flow.py``), from their build step (:mod:`shardwise.train.build`). The steps, one file
each, in order:

1. **size** (:mod:`~shardwise.auto.sample`): what one training sample looks like, from the first
   sample of the training data collated as a batch of one (:class:`~shardwise.auto.sample.AutoData`);
2. **measure** (:mod:`~shardwise.auto.measure`): the model's statistics on the ``meta`` device, or
   the closed forms of its config; then whether any plan fits this device's memory at all
   (:func:`~shardwise.auto.machine.device_spec`: fitting does not depend on speed). Only then is
   the machine measured (:mod:`~shardwise.auto.machine`: ``cluster=``, else ``SHARDWISE_CLUSTER``,
   else this machine, calibrated once with :mod:`shardwise.calibrate` and cached), so an
   impossible request fails in milliseconds;
3. **choose** (:mod:`~shardwise.auto.choose`): the torch-free planner's search
   (:mod:`shardwise.plan.planner`) over the plans the parallel layer accepts for this model, loss
   and optimizer; rank 0 searches and broadcasts the ranked plans;
4. **certify** (:mod:`~shardwise.auto.certify`): on long runs, the ranked plans are compared in
   order with one process on a shrunken copy of the model and the first batches of the data (the
   parity engine of :mod:`shardwise.verify`); the first that passes is the plan.

The package sits below ``train/`` and above ``plan/``, ``parallel/``, ``verify/`` and
``calibrate/`` (docs/architecture.md). This file imports nothing, so ``shardwise plan --script``
loads ``auto/measure.py`` alone.
"""
