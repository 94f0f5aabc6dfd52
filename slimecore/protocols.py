"""What hooks are given, as protocols: the part of each argument a plugin may use, without the class behind it.

The hook specs (``slimecore.hookspecs``) name these types, so the contract imports nothing of the processes
that call the hooks. Each protocol is met by one class of the core:

| protocol | given to | met by |
|---|---|---|
| ``RolloutClient`` | ``slime_rollout``, ``slime_generate`` | ``slimecore.rollout.client.RolloutClient`` |
| ``SampleHooks`` | ``slime_rollout`` | ``slimecore.rollout.hook_args.SampleHooks`` |
| ``ObservationHook``, ``AgentHook`` | ``slime_generate`` | the ``slime_observation`` / ``slime_agent`` hooks |
| ``AgentSession`` | ``slime_agent`` | ``slimecore.agents.session.AgentSession`` |
| ``BufferFilter`` | ``slime_data_source`` | ``slimecore.rollout.hook_args.buffer_filter`` |
| ``Reducer`` | ``slime_loss`` | ``slimecore.ops.reducers`` |
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, Sequence

from slimecore.types import BufferFilter, FilterResult, Sample  # noqa: F401 (BufferFilter: a plain alias, in types)

if TYPE_CHECKING:
    import torch

    from slimecore.config import Config
    from slimecore.types import AgentProcess

# ``reducer(per_sample_tensors)``: this micro-batch's share of the step objective (``slimecore.ops.reducers``)
Reducer = Callable[[Sequence["torch.Tensor"]], "torch.Tensor"]


class RolloutClient(Protocol):
    """The router, as a rollout hook reaches it (never through a hand-built URL)."""

    url: str  # the router's address
    tokenizer: Any  # the rollout's tokenizer, for hooks that encode or decode next to their calls
    policy_version: int  # the weight version the engines serve

    async def generate(self, input_ids: Sequence[int] | None = None, sampling_params: dict | None = None, *,
                       text: str | None = None, return_logprob: bool = True, rid: str | None = None,
                       routing_key: str | None = None, **extra: Any) -> dict:
        """SGLang's ``POST /generate`` through the router: ``text``, ``output_ids``, ``meta_info``."""

    def keep_routed_experts(self, sample: Sample, meta_info: dict) -> None:
        """With ``--use-rollout-routing-replay``: keep the answer's routed experts on ``sample`` (whose tokens
        already hold the answer's output); a generate hook calls it after each ``generate``. Otherwise nothing."""


class ObservationHook(Protocol):
    def __call__(self, *, config: Config, sample: Sample, text: str, turn: int) -> Awaitable[str | None]: ...


class AgentHook(Protocol):
    def __call__(self, *, config: Config, sample: Sample, session: AgentSession) -> Awaitable[float | dict | None]: ...


class SampleHooks(Protocol):
    """The hooks a rollout calls for each sample and prompt group, bound to the run's plugins: ``generate`` ->
    ``process_sample`` -> ``reward`` (or ``group_reward`` when ``scores_groups``) -> ``filter_group``. Each
    takes the (per eval set, possibly changed) config of the call."""

    async def generate(self, *, config: Config, sample: Sample, sampling_params: dict, client: RolloutClient,
                       evaluation: bool) -> Sample | list[Sample]:
        """``slime_generate``, given the run's ``slime_observation`` and ``slime_agent`` when a plugin has them."""

    async def process_sample(self, *, config: Config, sample: Sample, rollout_id: int, evaluation: bool) -> None:
        """``slime_process_sample`` of every plugin."""

    async def reward(self, *, config: Config, sample: Sample) -> float | dict:
        """``slime_reward``: the one answering plugin's, or the weighted sum of several (``--reward-weights``)."""

    def scores_groups(self, config: Config, evaluation: bool) -> bool:
        """Whether ``--group-rm`` scores whole groups (``group_reward``) instead of each sample (``reward``)."""

    async def group_reward(self, *, config: Config, samples: list[Sample]) -> list[float | dict]:
        """``slime_group_reward``: one reward per sample of the group."""

    def filter_group(self, *, config: Config, samples: list[Sample]) -> tuple[FilterResult, str | None]:
        """The first rejecting verdict of the group filters, with the plugin that gave it (None: all keep)."""

    def answering(self, hook: str) -> str:
        """The plugin that answers the one-answer ``hook`` (for messages)."""


class AgentSession(Protocol):
    """One agent episode's end of the session server: OpenAI and Anthropic endpoints that record every model
    call with exact tokens (``slime_agent``'s docstring)."""

    id: str
    model: str
    api_key: str
    base_url: str  # OpenAI's, ending in /v1
    anthropic_base_url: str

    def env(self) -> dict[str, str]:
        """``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL`` ... pointing at this session."""

    def openai_client(self, **options: Any) -> Any:
        """An ``openai.AsyncOpenAI`` for this session."""

    def anthropic_client(self, **options: Any) -> Any:
        """An ``anthropic.AsyncAnthropic`` for this session."""

    def alias(self, key: str) -> None:
        """Also record requests that name ``key`` as their session in this one."""

    async def run(self, args: Sequence[str], *, input: str | bytes | None = None, cwd: str | None = None,
                  env: dict[str, str] | None = None, check: bool = True) -> AgentProcess:
        """Run a program with ``env()`` set and wait for it."""
