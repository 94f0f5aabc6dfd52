"""Every hook of slime-core, grouped by stage.

A plugin implements a hook by defining a function of the same name decorated with
``slimecore.hookimpl``; it may accept any subset of the parameters listed. Hooks are called with
keyword arguments only, so a spec can gain parameters without breaking old plugins.

Kinds (pluggy's own semantics decide: the core calls ``hooks.slime_xxx(...)`` on the ``slimecore.plugins.Hooks``
facade, which calls ``pm.hook.slime_xxx``):
- *all*: every active plugin's implementation is called; results are collected in a list.
- *one answer*: pluggy ``firstresult``; one active plugin answers. Built-in defaults are called last
  (``trylast``), so a non-default plugin's answer replaces the default's; two non-default plugins implementing
  it is a start-up error, except for a hook declared ``combined`` (``slime_reward``), whose answers from several
  plugins the core combines (a weighted sum, ``slimecore.rollout.rewards``). The answer must not be None: an
  implementation returning None passes the call on to the next (the default), and None from every one, or from an
  awaited async answer, is an error.
- *first answer*: pluggy ``firstresult``; implementations are tried in turn and the first non-None result
  wins (several plugins may coexist, each answering for the inputs it knows).
A plugin may also wrap a hook (``@hookimpl(wrapper=True)``, a generator that yields to get the inner answer,
an awaitable for async hooks) and order itself with ``tryfirst`` / ``trylast``, as in any pluggy project.

Where each hook runs: **driver** (the ``slime-core`` process), **rollout** (the RolloutManager Ray
actor), **train** (every training Ray actor, once per data-parallel rank).

The mapping from slime's ``--*-path`` flags to these hooks is in ``docs/hooks.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # only for type checkers; every name is the contract's own (config, protocols, types)
    import torch

    from slimecore.config import Config, Option
    from slimecore.protocols import (AgentHook, AgentSession, BufferFilter, ObservationHook, Reducer, RolloutClient,
                                     SampleHooks)
    from slimecore.types import (Advantages, DataSource, FilterResult, ModelOutputs, RolloutOutput, Sample, TrainBatch,
                                 TrainRole)

PROJECT = "slimecore"
hookspec = pluggy.HookspecMarker(PROJECT)


def spec(*, kind: str, required: bool = False, is_async: bool = False, combined: bool = False,
         single: bool | None = None):
    """Declare a hook. ``kind`` is ``all``, ``one`` (one answer) or ``first`` (first answer). ``combined``: a
    one-answer hook several plugins may answer, the core combining their answers. ``single``: at most one
    non-default plugin may implement it (checked at start-up); by default true for one-answer hooks that are
    not combined."""
    assert kind in ("all", "one", "first") and (kind == "one" or not combined)

    def decorate(func):
        func = hookspec(firstresult=kind != "all")(func)
        func.slime_kind, func.slime_required, func.slime_async = kind, required, is_async
        func.slime_combined = combined
        func.slime_single = (kind == "one" and not combined) if single is None else single
        return func

    return decorate


# ---------------------------------------------------------------------------------------------
# Options and lifecycle
# ---------------------------------------------------------------------------------------------


@spec(kind="all")
def slime_options() -> list[Option]:
    """Declare this plugin's own command-line / YAML options.

    Returns a list of ``slimecore.config.Option``. Values land in ``config.plugin(NAME)`` for the
    declaring plugin (namespaced), and are accepted as ``--flag`` on the command line or under the
    plugin's name in ``--config`` YAML. Two plugins may declare the same flag only with the same type
    and default; they then share the value.

    Called in: driver, rollout and train processes, when the config is built.
    """


@spec(kind="all")
def slime_implied_options() -> dict[str, Any]:
    """Core option values this plugin cannot run without, by option name: e.g. SFT returns
    ``{"engines": False, "n_samples_per_prompt": 1}`` (no engines; each conversation once).
    Options the user left unset take these values, over a built-in task's quick-start values; a different
    value on the command line or in ``--config``, or two plugins implying different values, is a
    start-up error naming the flag and the plugins.

    Called in: driver, once, while the config is parsed (before Ray starts).
    """


@spec(kind="all")
def slime_quickstart_options() -> dict[str, Any]:
    """Quick-start values of core options for a run on the prompts this plugin supplies itself (its data
    source, with no ``--prompt-data``): e.g. an environment whose episodes need more new tokens than a
    built-in task's. Options the user left unset take them instead of the built-in task's quick-start
    values, and the CLI prints them. Two active plugins answering is a start-up error.

    Called in: driver, once, while the config is parsed (before Ray starts).
    """


@spec(kind="all")
def slime_validate_config(config: Config) -> None:
    """Check option combinations; raise ``slimecore.config.ConfigError`` naming the flags.

    Called in: driver, once, before Ray starts.
    """


@spec(kind="all")
def slime_startup(config: Config, process: str) -> None:
    """A process finished loading plugins. ``process`` is ``driver``, ``rollout`` or ``train``.

    Called in: every process, once.
    """


@spec(kind="all")
def slime_step_end(config: Config, rollout_id: int, metrics: dict[str, float]) -> None:
    """One RL step finished; ``metrics`` may be read or extended in place before they are logged.

    Called in: driver, after each step.
    """


@spec(kind="all")
def slime_shutdown(config: Config, process: str) -> None:
    """The run is ending (normally or by an error). Release what ``slime_startup`` acquired.

    Called in: every process, once.
    """


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@spec(kind="one", required=True)
def slime_data_source(config: Config, tokenizer: Any, buffer_filter: BufferFilter) -> DataSource:
    """Build the prompt source: ``get_samples`` / ``add_samples`` / ``state_dict`` / ``load_state_dict``
    / ``len`` (``slimecore.types.DataSource``). The built-in reads ``--prompt-data`` (jsonl/parquet)
    or a built-in task. ``buffer_filter(buffer, num_groups)`` is the run's ``slime_buffer_filter`` (the oldest
    ``num_groups`` groups when no plugin chooses): a source with a buffer of aborted groups calls it to pick the
    groups to resume. slime: ``--data-source-path``.

    Called in: rollout, once.
    """


@spec(kind="first")
def slime_buffer_filter(config: Config, buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """Choose which buffered (aborted, partially generated) groups to resume; remove them from
    ``buffer`` and return them. Default: the first ``num_groups``. slime: ``--buffer-filter-path``.

    Called in: rollout, by the data source on each ``get_samples``.
    """


@spec(kind="all")
def slime_datasets() -> dict[str, str]:
    """Prompt data sets this plugin ships, by name: ``{name: path}`` to a ``.jsonl`` / ``.parquet`` file that
    ``--prompt-data`` reads. ``slime-core data --task NAME -o FILE`` writes one out (of every installed plugin).

    Called in: driver, by ``slime-core data`` only.
    """


# ---------------------------------------------------------------------------------------------
# Rollout
# ---------------------------------------------------------------------------------------------


@spec(kind="one", required=True, is_async=True)
async def slime_rollout(
    config: Config, rollout_id: int, data_source: DataSource, client: RolloutClient, sample_hooks: SampleHooks,
    evaluation: bool
) -> RolloutOutput:
    """Produce one step's prompt groups (``RolloutOutput``). The built-in draws groups from the data
    source, runs each sample and group through ``sample_hooks`` (``slimecore.protocols.SampleHooks``:
    ``generate``, ``process_sample``, ``reward`` or ``group_reward``, ``filter_group``, i.e. ``slime_generate``
    ... ``slime_filter_group`` bound to the run's plugins), over-samples and aborts, and handles partial
    rollout. With ``evaluation=True`` it runs every prompt of ``data_source`` once.
    slime: ``--rollout-function-path`` / ``--eval-function-path``.

    Called in: rollout, once per step (and per eval with ``evaluation=True``).
    """


@spec(kind="one", required=True, is_async=True)
async def slime_generate(
    config: Config, sample: Sample, sampling_params: dict, client: RolloutClient, evaluation: bool,
    observation: ObservationHook | None, agent: AgentHook | None
) -> Sample | list[Sample]:
    """Generate the response for one sample through ``client`` (never a hand-built URL). May run many
    turns (use ``Sample.append_response_tokens``) and may fan out into several samples sharing
    ``rollout_id``. ``observation`` and ``agent`` are the run's ``slime_observation`` and ``slime_agent`` hooks
    (async, called with those hooks' keyword arguments), or None when no active plugin implements them: the
    built-in runs turns with the first and agent episodes with the second. With ``--use-rollout-routing-replay``
    call ``client.keep_routed_experts(sample, out["meta_info"])`` after each ``client.generate`` (the built-in
    does). slime: ``--custom-generate-function-path``.

    Called in: rollout, once per sample, concurrently.
    """


@spec(kind="first")
def slime_observation(config: Config, sample: Sample, text: str, turn: int) -> str | None:
    """Multi-turn environments for the built-in generate: after model turn ``turn`` (from 0) whose text is
    ``text``, return the observation to append (tokenised, loss mask 0, log-prob 0), or None to end the
    episode. With an implementation active, the built-in ``slime_generate`` runs up to ``--max-turns``
    turns (``slimecore.rollout.turns.run_turns``); put the tool call's closing tags in ``--rollout-stop``. May be
    async. The first active plugin that implements it answers.

    Called in: rollout, after each model turn but the last.
    """


@spec(kind="first", is_async=True, single=True)
async def slime_agent(config: Config, sample: Sample, session: AgentSession) -> float | dict | None:
    """Play one episode of an agent that talks to the policy through the OpenAI or Anthropic API. With an
    implementation active, the built-in ``slime_generate`` opens a session per sample and awaits this hook;
    ``session`` (``slimecore.protocols.AgentSession``) has ``base_url`` / ``anthropic_base_url``,
    ``api_key`` and ``model`` for any OpenAI or Anthropic client, ``openai_client()`` /
    ``anthropic_client()``, ``env()`` (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``,
    ``ANTHROPIC_API_KEY`` ...) and ``await session.run(args)`` for a subprocess agent with those set. Every
    model call is recorded with exact tokens; at the end the session becomes one sample per branch of its
    history (a client that rewrote its history forks), all sharing one ``rollout_id``. Return a reward (float
    or dict) for every sample of the episode, or None to let ``slime_reward`` score them. It runs under
    ``--agent-timeout``; raising or timing out marks the sample FAILED (not trained). One active plugin may
    implement it (two are a start-up error).

    Called in: rollout, once per sample, concurrently (the agent's HTTP calls reach the session server on its
    own thread of the same process).
    """


@spec(kind="all")
def slime_process_sample(config: Config, sample: Sample, rollout_id: int, evaluation: bool) -> None:
    """Inspect or edit a generated sample before its reward; may be async (it is awaited).
    slime: ``--rollout-sample-hook-path``.

    Called in: rollout, once per generated sample.
    """


@spec(kind="one", required=True, is_async=True, combined=True)
async def slime_reward(config: Config, sample: Sample) -> float | dict:
    """Score one finished sample; return a float or a dict (pick the key with ``--reward-key``).
    The built-in dispatches on ``sample.metadata["rm_type"]`` then ``--rm-type``; a plugin's answer replaces it.
    Several plugins may answer: their rewards are then summed, weighted by ``--reward-weights`` (TRL's
    ``reward_funcs`` / ``reward_weights``), and each is logged as ``rollout/reward/<plugin>``.
    slime: ``--custom-rm-path`` / ``--rm-type``.

    Called in: rollout, once per sample (unless ``--group-rm``).
    """


@spec(kind="one", is_async=True)
async def slime_group_reward(config: Config, samples: list[Sample]) -> list[float | dict]:
    """Score a whole prompt group at once (``--group-rm``); return one reward per sample.

    Called in: rollout, once per group when ``--group-rm`` is set.
    """


@spec(kind="all")
def slime_filter_group(config: Config, samples: list[Sample]) -> FilterResult | bool | None:
    """Dynamic sampling: keep or drop a finished prompt group. Return ``FilterResult`` (with a drop
    reason, counted as ``rollout/dynamic_filter/drop_<reason>``), a bool, or None (no opinion). A group
    is kept only if no plugin drops it. slime: ``--dynamic-sampling-filter-path``.

    Called in: rollout, once per finished group.
    """


@spec(kind="one", required=True)
def slime_post_process_rewards(config: Config, samples: list[Sample]) -> tuple[list[float], list[float]]:
    """Turn per-sample rewards into training rewards: return ``(raw_rewards, rewards)`` aligned with
    ``samples`` (e.g. group normalisation). The built-in returns the raw rewards twice.
    slime: ``--custom-reward-post-process-path``.

    Called in: rollout, once per step on the flattened batch.
    """


@spec(kind="all")
def slime_log_rollout(config: Config, rollout_id: int, samples: list[Sample], metrics: dict[str, float]) -> None:
    """Add or change rollout metrics in place. slime: ``--custom-rollout-log-function-path``.

    Called in: rollout, once per step.
    """


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@spec(kind="all")
def slime_train_roles(config: Config) -> list[TrainRole | str]:
    """Declare training roles beside the actor (``slimecore.types.TrainRole``): each one's model
    (``policy`` or ``value``: the backbone with a scalar head), its feeds (another role's ``scores``, a value
    model's ``values`` before any role trains, or ``outputs``, what it trained, e.g. the actor's ``returns``),
    its own options (``lr``, ``hf_checkpoint`` ...) and its first updating rollout. A role trains through
    ``slime_loss`` with ``role=<its name>``; a value role's ``outputs`` hold ``values``. Declaring ``actor``
    gives the actor feeds or a later first update. A bare name is a policy role with no feeds. Every role has
    the actor's number of ranks; the union over plugins is placed. slime: ``--use-critic`` (PPO's critic).

    Called in: driver, once, before the placement group is made; train, once per rank as its trainer is built.
    """


@spec(kind="all")
def slime_train_inputs(config: Config, role: str) -> list[str]:
    """Name the extra per-token inputs the loss needs before training: any of ``log_probs`` (old policy,
    recomputed), ``ref_log_probs`` (reference model, a CPU snapshot in the same process), ``values``
    (critic), ``entropy``. The union over plugins is computed.

    Called in: train, once per step.
    """


@spec(kind="all")
def slime_scoring_weights(config: Config, role: str) -> dict[str, str]:
    """Per-token log-prob columns the trainer computes under other weights of the policy's own architecture:
    ``{column: checkpoint}``, e.g. the opd plugin's ``{"teacher_log_probs": TEACHER}``. The trainer of ``role``
    keeps each checkpoint's weights as a CPU copy beside the policy's (as it keeps the reference policy's for
    ``ref_log_probs``: one more copy of the model in host memory per entry), swaps it in for a no-grad forward of
    every sample each step, and puts the log-probs (at the rollout temperature, ``(R_i,)`` per sample) in the
    batch under ``column`` before ``slime_compute_advantages``. A checkpoint is what the backend's ``--ref-load``
    reads: an HF directory, or on megatron also a torch_dist checkpoint. The answers of all plugins are merged;
    two plugins naming one column, or a column the trainer fills itself (``log_probs``, ``ref_log_probs`` ...), is
    a start-up error. Checked before Ray (the checkpoint is readable and of the policy's architecture); not with
    ``--use-lora``, nor for a value role.

    Called in: driver, once, before Ray starts (the checks); train, once per rank as its trainer is built.
    """


@spec(kind="one", required=True)
def slime_compute_advantages(config: Config, role: str, batch: TrainBatch) -> Advantages:
    """Return ``{"advantages": [...], "returns": [...]}``: one float tensor per sample over its response
    tokens (shape ``(response_length,)``). ``batch`` (``slimecore.types.TrainBatch``, this rank's samples)
    holds ``rewards``, ``loss_masks``, ``response_lengths`` and whatever ``slime_train_inputs`` asked for.
    slime: ``--advantage-estimator`` / ``--custom-advantage-function-path``.

    Called in: train, once per step on this rank's samples.
    """


@spec(kind="all")
def slime_rollout_data_postprocess(config: Config, rollout_id: int, batch: TrainBatch) -> None:
    """Edit the training batch (``slimecore.types.TrainBatch``, this rank's samples) in place after advantages,
    before the optimizer steps.
    slime: ``--rollout-data-postprocess-path``.

    Called in: train, once per step.
    """


@spec(kind="one", required=True)
def slime_loss(
    config: Config, role: str, batch: TrainBatch, outputs: ModelOutputs, reducer: Reducer
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch. ``batch`` is the micro-batch's rows of the ``TrainBatch`` (tensors on the
    trainer's device). ``outputs`` (``slimecore.types.ModelOutputs``) holds the current model's per-sample
    tensors with gradient (``log_probs``, ``entropy`` for the actor; ``values`` for a value role).
    ``reducer(list_of_tensors)`` (``slimecore.ops.reducers.Reducer``)
    turns per-token values into this micro-batch's share of the step objective (slime's
    ``sum_of_sample_mean`` already divided by the step's rollout count), so shares add up exactly across
    micro-batches and DP ranks. Return ``(loss, metrics)``; metrics must be reduced with ``reducer`` too.
    slime: ``--loss-type`` / ``--custom-loss-function-path``.

    Called in: train, once per micro-batch.
    """


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


@spec(kind="first")
def slime_model_bridge(config: Config, hf_config: Any) -> Any:
    """Return a bridge for this HF architecture (``hf_config.architectures``), or None if unknown. A
    bridge builds the trainer's model and maps weight names for the engines (see
    ``slimecore.trainers``). slime: ``--custom-model-provider-path`` / mbridge.

    Called in: train, once.
    """
