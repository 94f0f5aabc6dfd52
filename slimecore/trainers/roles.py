"""Training roles: which models the driver trains, in which order, and what each one hands another.

The actor (the policy the engines serve) is always there. A plugin asks for more with ``slime_train_roles``,
answering :class:`TrainRole` declarations (PPO: a ``critic``, a value model). A declaration is all the core
knows of a role, so no role name but ``actor`` appears in the core:

- ``model``: ``"policy"`` (a causal LM, as the actor) or ``"value"`` (the backbone with a scalar head).
- ``feeds``: what the role receives from other roles, merged into its batch on every rank; Ray passes each
  source rank's result to the same rank of the receiver, never through the driver.
  ``Feed(source, "scores")``: the source value model's ``{"values": ...}`` on the batch, computed before any
  role trains. ``Feed(source, "outputs")``: what the source's training produced (``{"returns": ...}``); the
  receiver trains after its source.
- ``options``: core options this role's ranks read with another value (``lr``, ``lr_warmup_iters``,
  ``hf_checkpoint`` ...); None keeps the actor's. A plugin's own flags (``--critic-lr``) fill them.
- ``update_from``: the first rollout on which the role's optimizer steps; before it the role computes its
  advantages and outputs only.

A plugin may declare ``actor`` too, to give it feeds or a later ``update_from``. The same role declared
differently by two plugins is an error naming both. Every role has the actor's number of ranks and, colocated,
shares its bundles (``slimecore.raytools.create_placement``).

The declarations (``TrainRole``, ``Feed``) are part of the contract, in ``slimecore.types`` (importable from here
too); this module checks and orders them, and training ranks read their own role here;
``slimecore.trainers.ray_actors.RoleGroups`` starts and trains the roles from the driver.
"""

from __future__ import annotations

from slimecore.config import CORE_BY_NAME, Config
from slimecore.errors import PluginError
from slimecore.types import Feed, TrainRole  # declared in the contract, importable from here

ACTOR = "actor"
MODELS = ("policy", "value")
FEED_KINDS = ("scores", "outputs")
# what a training rank reads per role: the model it starts from and its optimizer and schedule
ROLE_OPTIONS = frozenset({"hf_checkpoint", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "weight_decay",
                          "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"})


def declared_roles(config: Config, hooks) -> list[TrainRole]:
    """The run's roles in training order: the actor, then the others as declared, each after the sources of
    its ``outputs`` feeds. Declarations are checked here (before Ray starts); errors name the plugin."""
    declared: dict[str, tuple[TrainRole, str | None]] = {ACTOR: (TrainRole(ACTOR), None)}
    for plugin, answer in hooks.slime_train_roles(config=config):
        for item in answer:
            role = TrainRole(item) if isinstance(item, str) else item
            if not isinstance(role, TrainRole):
                raise PluginError(f"plugin {plugin!r}: slime_train_roles must return TrainRole declarations "
                                  f"(slimecore.trainers.roles) or role names, got {type(item).__name__}")
            _check_role(role, plugin)
            earlier, by = declared.get(role.name, (None, None))
            if by is not None and earlier != role:
                raise PluginError(f"plugins {by!r} and {plugin!r} declare training role {role.name!r} differently "
                                  f"({earlier} vs {role}); activate only one of them")
            declared[role.name] = (role, plugin)
    roles = {name: role for name, (role, _) in declared.items()}
    for role in roles.values():
        for feed in role.feeds:
            source = roles.get(feed.source)
            who = f"plugin {declared[role.name][1]!r}: role {role.name!r}"
            if source is None or source is role:
                raise PluginError(f"{who} is fed by role {feed.source!r}, which no active plugin declares "
                                  f"(roles: {sorted(roles)}); add the plugin that declares it")
            if feed.kind == "scores" and source.model != "value":
                raise PluginError(f"{who} takes the scores of role {feed.source!r}, which is a {source.model} model; "
                                  "only value models score a batch")
    return _training_order(roles, {name: plugin for name, (_, plugin) in declared.items()})


def _check_role(role: TrainRole, plugin: str) -> None:
    where = f"plugin {plugin!r}: slime_train_roles role {role.name!r}"
    if not role.name or not role.name.isidentifier():
        raise PluginError(f"{where}: a role name must be an identifier (it names metrics and checkpoint folders)")
    if role.model not in MODELS:
        raise PluginError(f"{where}: model must be one of {MODELS}, got {role.model!r}")
    if role.name == ACTOR and (role.model != "policy" or role.options):
        raise PluginError(f"{where}: the actor is the policy the engines serve; its model and options are the run's")
    for feed in role.feeds:
        if not isinstance(feed, Feed) or feed.kind not in FEED_KINDS:
            raise PluginError(f"{where}: feeds must be Feed(source, kind) with kind in {FEED_KINDS}, got {feed!r}")
    unknown = sorted(set(role.options) - ROLE_OPTIONS)
    if unknown:
        what = "not core options" if set(unknown) - set(CORE_BY_NAME) else "options every role shares"
        raise PluginError(f"{where}: options {unknown} are {what}; a role may set {sorted(ROLE_OPTIONS)}")
    if not isinstance(role.update_from, int) or role.update_from < 0:
        raise PluginError(f"{where}: update_from must be an integer >= 0, got {role.update_from!r}")


def _training_order(roles: dict[str, TrainRole], owners: dict[str, str | None]) -> list[TrainRole]:
    order: list[TrainRole] = []
    waiting = list(roles.values())
    while waiting:
        ready = next((r for r in waiting if all(f.source in {o.name for o in order}
                                                for f in r.feeds if f.kind == "outputs")), None)
        if ready is None:
            raise PluginError("training roles feed each other's outputs in a circle ("
                              + "; ".join(f"{r.name} (plugin {owners[r.name]!r}) <- {[f.source for f in r.feeds]}"
                                          for r in waiting)
                              + "); one of them must take scores, or nothing, instead")
        order.append(ready)
        waiting.remove(ready)
    return order


def role_config(config: Config, hooks, role: str) -> tuple[TrainRole, Config]:
    """For a training rank: its role's declaration and the config it trains with."""
    spec = next((r for r in declared_roles(config, hooks) if r.name == role), None)
    if spec is None:
        raise PluginError(f"training role {role!r} is not declared by any active plugin (slime_train_roles)")
    return spec, spec.configure(config)


__all__ = ["ACTOR", "Feed", "TrainRole", "declared_roles", "role_config"]
