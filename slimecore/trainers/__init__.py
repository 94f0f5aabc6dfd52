"""Training side: ``trainer`` (the training step, the same for every backend), ``backend`` (what a backend
provides), the ``fsdp`` and ``megatron`` backends (``megatron_model``: the bridged Megatron model, also used by
``slime-core convert``), ``schedule`` (the DP plan, built on the rollout manager) and ``actor`` (the Ray actors
that host a trainer per data-parallel rank)."""
