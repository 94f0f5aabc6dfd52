"""Training side: ``trainer`` (the training step, the same for every backend), ``backend`` (what a backend
provides), the ``fsdp`` and ``megatron`` backends (``megatron_model``: the bridged Megatron model, also used by
``slime-core convert``), ``roles`` (the training roles plugins declare) and ``ray_actors`` (the Ray actors that host a
trainer per data-parallel rank, and the driver's groups of them). The DP plan they train on is built on the
rollout manager (``slimecore.rollout.schedule``)."""
