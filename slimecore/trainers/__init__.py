"""Training side: ``schedule`` (the DP plan, built on the rollout manager), ``fsdp`` (the HF/torch backend)
and ``actor`` (the Ray actors that host a backend per data-parallel rank)."""
