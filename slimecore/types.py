"""Small data contracts shared by every process: ``Sample``, ``FilterResult``, ``RolloutOutput``, the training
batch forms, the training-role declarations (``TrainRole``, ``Feed``) and a finished agent program (``AgentProcess``).

Field names and status values follow slime's ``slime/utils/types.py`` so custom code ports over. slime's fields
for features slime-core does not have (top-p replay, per-sample train metadata; on-policy distillation is a
plugin's) are not declared: a slime function that sets one still may (it becomes a plain attribute, which
slime-core ignores), and ``from_dict`` keeps such keys as attributes.
A ``Sample`` holds one prompt and its response as token ids; everything the trainer needs is a list
aligned with the response tokens (``loss_mask``, ``rollout_log_probs``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypedDict

if TYPE_CHECKING:
    import numpy as np
    import torch


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


_FINISH_TO_STATUS = {"length": Status.TRUNCATED, "abort": Status.ABORTED, "stop": Status.COMPLETED}


class SampleError(ValueError):
    """A Sample whose token, mask and log-prob lists disagree."""


@dataclass
class Sample:
    """One prompt and (after generation) one response.

    ``tokens`` = prompt ids + response ids; the response is the last ``response_length`` ids.
    ``loss_mask`` and ``rollout_log_probs`` have exactly ``response_length`` entries when set.
    """

    Status = Status

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict] = ""
    tokens: list[int] = field(default_factory=list)
    # slime's generate (which custom generate functions start from) reads these two; slime-core serves text
    # only, so they stay None here
    multimodal_inputs: dict | None = None
    multimodal_train_inputs: dict | None = None
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    # slime-core: [[weight version, token count], ...] over the response tokens in order, the version of the
    # policy that generated each span (None: tokens the model did not generate, a tool's output); a partial
    # rollout's sample continued under new weights has a span per version
    weight_version_spans: list[list] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    session_id: str | None = None
    # per-sample training columns a plugin adds for its own training hooks (e.g. a per-token list aligned with the
    # response): a key any sample of a step sets becomes a ``TrainBatch`` column of that name (None where a
    # sample lacks it); dropped with the response (``reset_response``)
    train_columns: dict = field(default_factory=dict)
    # --use-rollout-routing-replay: the experts each MoE layer routed tokens[:-1] to in the engine, a numpy array
    # (len(tokens) - 1, layers, top-k) of small unsigned ints (slimecore.routing_replay); dropped with the response
    rollout_routed_experts: np.ndarray | None = None

    # -- derived -----------------------------------------------------------------------------
    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def get_reward_value(self, reward_key: str | None = None) -> float:
        """The scalar reward; ``reward_key`` picks a field of a dict reward (slime's ``--reward-key``). slime's
        call ``get_reward_value(args)`` works too: the key is then ``args.reward_key``."""
        if reward_key is not None and not isinstance(reward_key, str):
            reward_key = getattr(reward_key, "reward_key", None)
        reward = self.reward
        if isinstance(reward, dict):
            if not reward_key:
                raise SampleError(
                    f"sample {self.index} has a dict reward with keys {sorted(reward)}; "
                    "set --reward-key to choose which one to train on"
                )
            if reward_key not in reward:
                raise SampleError(f"sample {self.index}: --reward-key {reward_key!r} not in reward keys {sorted(reward)}")
            reward = reward[reward_key]
        if reward is None:
            raise SampleError(f"sample {self.index} has no reward; the reward hook must set one")
        return float(reward)

    # -- multi-turn building -----------------------------------------------------------------
    def append_response_tokens(
        self,
        new_tokens: list[int] | None = None,
        log_probs: list[float] | None = None,
        *,
        trainable: bool = True,
        text: str | None = "",
        finish_reason: dict | str | None = None,
        weight_version: str | None = None,
        tokens: list[int] | None = None,
        meta_info: dict | None = None,
        update_terminal_info: bool = True,
        args: Any = None,
    ) -> None:
        """Append response tokens (model output or tool observation) keeping every list aligned.

        Trainable tokens get loss mask 1 and need their log-probs; non-trainable tokens (tool output,
        chat-template glue) get mask 0 and log-prob 0.0. ``finish_reason`` (SGLang's
        ``meta_info.finish_reason`` or its ``type``) sets ``status``: length -> TRUNCATED,
        abort -> ABORTED, stop -> COMPLETED.

        slime's form ``append_response_tokens(args, tokens=..., log_probs=..., trainable=..., meta_info=...,
        text=...)`` is accepted as well: the first argument is then slime's ``args`` (unused), and
        ``meta_info`` (SGLang's) gives the finish reason and weight version unless ``update_terminal_info`` is
        False.
        """
        if tokens is None:
            tokens = new_tokens
        if meta_info is not None and update_terminal_info:
            finish_reason = finish_reason or meta_info.get("finish_reason")
            weight_version = weight_version or meta_info.get("weight_version")
        tokens = [int(t) for t in tokens or ()]
        text = text or ""
        if trainable:
            if log_probs is None:
                raise SampleError("append_response_tokens(trainable=True) needs the log-probs of the new tokens")
            if len(log_probs) != len(tokens):
                raise SampleError(
                    f"append_response_tokens: {len(tokens)} tokens but {len(log_probs)} log-probs; "
                    "they must be aligned one to one"
                )
            new_lp = [float(x) for x in log_probs]
            if any(math.isnan(x) for x in new_lp):
                raise SampleError("append_response_tokens: a log-prob is NaN")
        else:
            new_lp = [0.0] * len(tokens)
        kind = finish_reason.get("type") if isinstance(finish_reason, dict) else finish_reason
        if kind is not None and kind not in _FINISH_TO_STATUS:
            raise SampleError(f"unknown finish_reason type {kind!r}; expected one of {sorted(_FINISH_TO_STATUS)}")
        self.check_aligned()
        if self.loss_mask is None:
            self.loss_mask = [1] * self.response_length
        if self.rollout_log_probs is None:
            if self.response_length and trainable:
                raise SampleError(
                    "append_response_tokens: this sample already has response tokens without log-probs"
                )
            self.rollout_log_probs = [0.0] * self.response_length
        self.tokens.extend(tokens)
        self.response_length += len(tokens)
        self.loss_mask.extend([1 if trainable else 0] * len(tokens))
        self.rollout_log_probs.extend(new_lp)
        self.response += text
        if weight_version is not None:
            self.weight_versions.append(str(weight_version))
        if tokens:
            version = str(weight_version) if trainable and weight_version is not None else None
            if self.weight_version_spans and self.weight_version_spans[-1][0] == version:
                self.weight_version_spans[-1][1] += len(tokens)
            else:
                self.weight_version_spans.append([version, len(tokens)])
        if kind is not None:
            self.status = _FINISH_TO_STATUS[kind]
        self.check_aligned()

    def oldest_weight_version(self) -> str | None:
        """The oldest policy version that generated any of the response's tokens (what its staleness is
        measured from); the last version reported when none is numeric (an engine's initial ``default``)."""
        versions = [v for v, _ in self.weight_version_spans if v is not None] or self.weight_versions
        numeric = [int(v) for v in versions if str(v).lstrip("-").isdigit()]
        return str(min(numeric)) if numeric else (versions[-1] if versions else None)

    def check_aligned(self) -> None:
        """Raise SampleError if lengths of tokens / loss_mask / rollout_log_probs disagree."""
        if self.response_length < 0 or self.response_length > len(self.tokens):
            raise SampleError(
                f"sample {self.index}: response_length {self.response_length} outside 0..{len(self.tokens)} tokens"
            )
        for name in ("loss_mask", "rollout_log_probs"):
            value = getattr(self, name)
            if value is not None and len(value) != self.response_length:
                raise SampleError(
                    f"sample {self.index}: {name} has {len(value)} entries but response_length is {self.response_length}"
                )

    def reset_response(self) -> None:
        """Drop the response (used before re-generating a sample from scratch)."""
        self.tokens = self.prompt_tokens
        self.response, self.response_length = "", 0
        self.loss_mask = self.rollout_log_probs = None
        self.reward, self.status = None, Status.PENDING
        self.weight_versions, self.weight_version_spans = [], []
        self.train_columns = {}
        self.rollout_routed_experts = None

    # -- serialisation (debug dumps, checkpoints of the buffer) ----------------------------------
    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Sample":
        data = dict(data)
        names = {f.name for f in dataclasses.fields(cls)}
        extra = {k: data.pop(k) for k in list(data) if k not in names}
        if "status" in data:
            data["status"] = Status(data["status"])
        sample = cls(**data)
        for key, value in extra.items():
            setattr(sample, key, value)
        return sample


@dataclass
class FilterResult:
    """Answer of a group filter (dynamic sampling). slime calls this ``DynamicFilterOutput``."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


@dataclass
class RolloutOutput:
    """What a rollout returns: prompt groups of samples plus rollout-level metrics."""

    samples: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)
    # the data-source state to checkpoint after this step, when the rollout holds groups outside the data
    # source (the fully-async worker's queue); None: the data source's own state_dict()
    data_state: dict | None = None


class DataSource:
    """Where prompts come from, and where aborted groups wait to be resumed (slime's DataSource).

    ``get_samples(n)`` returns ``n`` groups of ``n_samples_per_prompt`` fresh copies each, buffer first.
    ``state_dict()`` must capture everything needed to continue with the same order after a resume,
    the buffer included.
    """

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        raise NotImplementedError

    def add_samples(self, groups: list[list[Sample]]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


# ``buffer_filter(buffer, num_groups)``, given to ``slime_data_source``: the run's ``slime_buffer_filter``; removes
# the chosen groups from ``buffer`` and returns them
BufferFilter = Callable[[list[list[Sample]], int], list[list[Sample]]]


# ---------------------------------------------------------------------------------------------
# The training batch, stage by stage
# ---------------------------------------------------------------------------------------------
#
# TypedDicts, not a dataclass: every stage stays the plain ``dict`` it is at run time (it crosses Ray pickled,
# the trainers slice it by key, slime's functions read ``rollout_data[key]`` and set new keys), so declaring the
# keys changes no code that makes or reads a batch; type checkers and readers get the columns and their types.
# The four forms, where each is made and who reads it:
#   1. RolloutColumns: made by ``convert_samples`` (rollout manager), read by the data-parallel schedule;
#   2. RankData: made by the schedule's ``split_for_ranks``, one per DP rank through the Ray object store, read
#      by each training rank's ``train``;
#   3. TrainBatch: made by the trainer from its RankData (tensors, old/reference log-probs, the critic's values,
#      then advantages and returns), read by ``slime_compute_advantages`` and ``slime_rollout_data_postprocess``;
#   4. the micro-batch: the TrainBatch rows of one micro-batch (tensors on the trainer's device), read by
#      ``slime_loss`` together with ``ModelOutputs`` and a ``slimecore.ops.reducers.Reducer``.
# Per-sample columns are lists aligned with the samples; per-token ones hold ``response_length`` entries each.


class _EngineLogProbs(TypedDict, total=False):
    rollout_log_probs: list[list[float]]  # the engine's log-probs, when every sample has them
    rollout_routed_experts: list[Any]  # --use-rollout-routing-replay: Sample.rollout_routed_experts (numpy arrays)


class RolloutColumns(_EngineLogProbs):
    """One step's samples as training columns, the keys of slime's ``_convert_samples_to_train_data`` that
    slime-core produces (optional keys sit in ``total=False`` bases, so ``__required_keys__`` is right at run
    time). slime's ``raw_reward`` is ``raw_rewards`` here (the slime adapter hands slime's functions slime's
    name). slime columns not produced: ``round_number``, ``rollout_top_p_token_ids`` /
    ``rollout_top_p_token_offsets``, ``metadata``, ``multimodal_train_inputs``, ``source_names`` (no engine here
    returns those, and no loss reads them); ``rollout_routed_experts`` comes with ``--use-rollout-routing-replay``.
    Plugins add their own columns through ``Sample.train_columns`` (the opd plugin's ``teacher_log_probs``)."""

    tokens: list[list[int]]  # prompt + response ids
    response_lengths: list[int]
    loss_masks: list[list[int]]  # per response token; all zeros for ``remove_sample``
    rewards: list[float]  # after ``slime_post_process_rewards`` (e.g. group-normalised)
    raw_rewards: list[float]  # before it
    rollout_ids: list[int]  # ``Sample.rollout_id``, or a fresh id: samples of one rollout share one loss weight
    sample_indices: list[int | None]
    truncated: list[int]  # 1 where the response hit the length limit
    weight_versions: list[str | None]  # slime-core: the oldest policy version that generated a token of each sample


class StepSchedule(TypedDict):
    """One optimizer step of one rank (``slimecore.rollout.schedule``)."""

    micro_batches: list[list[int]]  # local sample indices per micro-batch; an empty one keeps ranks in step
    num_rollouts: int  # B: the step's rollouts with a trainable token, over all ranks (sample-mean reducer)
    num_tokens: int  # N: the step's loss-mask tokens over all ranks (token-mean reducer)


class _OtherRoles(TypedDict, total=False):
    values: list[torch.Tensor]  # the critic's, for the actor
    returns: list[torch.Tensor]  # the actor's, for the critic (which then skips advantages)


class RankData(RolloutColumns, _OtherRoles):
    """One DP rank's share: its samples' rows of every per-sample column (whole-batch values copied), plus the
    schedule's columns (slime-core's, where slime keeps ``partition`` / ``micro_batch_indices``) and what another
    training role adds for this rank (``values``, ``returns``)."""

    rollout_mask_sums: list[float]  # D_i: loss-mask tokens of every sample of sample i's rollout
    steps: list[StepSchedule]


class _StepInputs(TypedDict, total=False):
    rollout_log_probs: list[torch.Tensor]
    # the inputs ``slime_train_inputs`` asked for, computed by the trainer before advantages (no gradient):
    log_probs: list[torch.Tensor]  # old policy
    entropy: list[torch.Tensor]
    ref_log_probs: list[torch.Tensor]  # reference model
    values: list[torch.Tensor]  # the critic's (with a critic role)
    # set by ``slime_compute_advantages`` (or, for the critic, received from the actor):
    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]


class TrainBatch(_StepInputs):
    """The batch the training hooks see: a rank's ``RankData`` without ``steps``, with ``loss_masks``,
    ``rollout_log_probs``, ``values`` and ``returns`` as float32 tensors per sample, plus what the step adds
    (the optional keys, listed in ``_StepInputs``). ``slime_loss`` gets the rows of one micro-batch under the
    same keys. The slime adapter renames it to slime's ``rollout_data`` (``to_slime_batch``: ``raw_reward``,
    ``unconcat_tokens``, ``total_lengths``)."""

    tokens: list[list[int]]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    rewards: list[float]
    raw_rewards: list[float]
    rollout_ids: list[int]
    sample_indices: list[int | None]
    truncated: list[int]
    weight_versions: list[str | None]
    rollout_mask_sums: list[float]


class Advantages(TypedDict):
    """What ``slime_compute_advantages`` returns; the trainer merges it into the ``TrainBatch``."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]


class ModelOutputs(TypedDict, total=False):
    """The current model's per-sample tensors of one micro-batch, with gradient, that ``slime_loss`` gets:
    ``log_probs`` and ``entropy`` for the actor, ``values`` for a value role."""

    log_probs: list[torch.Tensor]
    entropy: list[torch.Tensor] | None
    values: list[torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Training roles (``slime_train_roles``; checked and ordered by ``slimecore.trainers.roles``)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Feed:
    """What a role receives from ``source``: its ``"scores"`` (before any role trains) or ``"outputs"``."""

    source: str
    kind: str = "outputs"


@dataclass(frozen=True)
class TrainRole:
    """One training role: its ``model`` (``"policy"`` or ``"value"``), its ``feeds`` from other roles, the core
    ``options`` its ranks read with another value, and ``update_from``, its first updating rollout
    (``slimecore.trainers.roles`` says more)."""

    name: str
    model: str = "policy"
    feeds: tuple[Feed, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    update_from: int = 0

    def __post_init__(self):
        object.__setattr__(self, "feeds", tuple(self.feeds))
        object.__setattr__(self, "options", dict(self.options))

    def __hash__(self) -> int:
        return hash((self.name, self.model, self.feeds, tuple(sorted(self.options.items())), self.update_from))

    def configure(self, config):
        """``config`` (a ``slimecore.config.Config``) as this role's ranks read it: its own options (those not
        None) over the run's."""
        own = {name: value for name, value in self.options.items() if value is not None}
        if not own:
            return config
        copy = type(config).from_dict(config.to_dict())
        for name, value in own.items():
            setattr(copy, name, value)
        return copy

    def updates(self, rollout_id: int) -> bool:
        return rollout_id >= self.update_from


@dataclass
class AgentProcess:
    """A finished subprocess agent (``AgentSession.run``): exit code and its decoded output."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
