"""Complete a run's config once, before Ray starts: the settings derived from others and from the data.

``finalize`` is the one place these are computed; the CLI calls it after parsing and ``slimecore.loop.run``
calls it first (a second call does nothing), so a ``Config.make(...)`` handed to ``run`` from Python is
completed exactly as ``slime-core train`` completes its flags:

- ``--hf-checkpoint``: the default model's converted checkpoint when none is given;
- ``--num-rollout``: ``--num-epoch`` (default 1) passes over the prompts, ``len(data source) //
  --rollout-batch-size`` steps each, counted with the run's own data source (the file the preflight reads, or
  a plugin's source), and only when ``--num-rollout`` is not given;
- ``--train-iters`` (the learning-rate schedule's length): the optimizer steps of ``--num-rollout`` rollouts.

Quick-start values are applied while parsing, where it is known which flags the user gave
(``slimecore.config.apply_task_recommendations``). It reads the ``--eval-config`` YAML too (which
``slimecore.config`` cannot import without a circle); the data files' checks are ``slimecore.preflight``'s.
"""

from __future__ import annotations

from slimecore.config import Config, ConfigError


def finalize(config: Config, hooks) -> Config:
    """Fill in every derived setting of ``config`` (in place; returned for convenience)."""
    if config.__dict__.get("finalized"):
        return config
    from slimecore.hf_checkpoint import resolve_checkpoint

    config.hf_checkpoint = str(resolve_checkpoint(config.hf_checkpoint))
    if config.eval_config:
        from slimecore.rollout.evaluation import eval_datasets

        eval_datasets(config)  # a bad eval YAML fails as the flags are read, before the run folder is made
    if config.num_rollout is None:
        config.num_rollout = rollouts_per_epoch(config, hooks) * (config.num_epoch or 1)
    if config.train_iters is None and config.rollout_batch_size:
        samples = config.rollout_batch_size * config.n_samples_per_prompt
        config.train_iters = config.num_rollout * samples // (config.global_batch_size or samples)
    config.__dict__["finalized"] = True
    return config


def rollouts_per_epoch(config: Config, hooks) -> int:
    """Steps in one pass over the data source the rollout manager will build (``slime_data_source``)."""
    if not config.rollout_batch_size:
        raise ConfigError("--num-rollout is needed when --rollout-batch-size is not given (the steps of an epoch "
                          "are the prompts divided by the batch size)")
    from slimecore.data.dataset import DataError
    from slimecore.preflight import check_hf_checkpoint
    from slimecore.rollout.hook_args import buffer_filter

    tokenizer = check_hf_checkpoint(config)
    try:
        source = hooks.slime_data_source(config=config, tokenizer=tokenizer, buffer_filter=buffer_filter(hooks, config))
        size = len(source)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    if size < config.rollout_batch_size:
        raise ConfigError(f"the prompts ({size}) do not fill one step of --rollout-batch-size "
                          f"{config.rollout_batch_size}; lower it, add prompts, or give --num-rollout")
    return size // config.rollout_batch_size
