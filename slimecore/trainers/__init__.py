"""Training side: ``schedule`` (the DP plan, built on the rollout manager), ``fsdp`` (the HF/torch backend),
``roles`` (the training roles plugins declare) and ``actor`` (the Ray actors that host a backend per
data-parallel rank, and the driver's groups of them)."""
