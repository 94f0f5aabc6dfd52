"""A test algorithm with training roles the core has never heard of, declared only as data:

- ``baseline``: a value model (its own ``--lr 0.05``) whose scores reach the actor as ``values``; it trains
  on returns it computes itself;
- ``actor``: REINFORCE with the baseline (advantage = return - value); it updates from the second rollout on;
- ``shadow``: a value model trained after the actor on the actor's returns.

The actor's returns are the reward + 1 (the baseline's are the reward), so the shadow's targets show whose
returns it got. Loss metrics: ``fed_values`` (the values the actor received), ``target_mean`` (a value role's
targets)."""

import torch

from slimecore import hookimpl
from slimecore.trainers.roles import Feed, TrainRole

BASELINE_LR = 0.05


@hookimpl
def slime_train_roles(config):
    return [TrainRole("actor", feeds=[Feed("baseline", "scores")], update_from=1),
            TrainRole("baseline", model="value", options={"lr": BASELINE_LR}),
            TrainRole("shadow", model="value", feeds=[Feed("actor", "outputs")])]


@hookimpl
def slime_train_inputs(config, role):
    return ["values"] if role == "actor" else []


@hookimpl
def slime_compute_advantages(config, role, batch):
    shift = 1.0 if role == "actor" else 0.0
    returns = [torch.full((n,), float(r) + shift) for r, n in zip(batch["rewards"], batch["response_lengths"])]
    if role == "actor":
        return {"advantages": [ret - v for ret, v in zip(returns, batch["values"])], "returns": returns}
    return {"advantages": returns, "returns": returns}


@hookimpl
def slime_loss(config, role, batch, outputs, reducer):
    if role == "actor":
        log_probs = outputs["log_probs"]
        loss = reducer([-a.to(lp.device) * lp for a, lp in zip(batch["advantages"], log_probs)])
        fed = reducer([v.to(lp.device) for v, lp in zip(batch["values"], log_probs)])
        return loss, {"pg_loss": loss.detach(), "fed_values": fed.detach()}
    values = outputs["values"]
    targets = [r.to(v.device) for r, v in zip(batch["returns"], values)]
    loss = reducer([(v - t) ** 2 for v, t in zip(values, targets)])
    return loss, {"value_loss": loss.detach(), "target_mean": reducer(targets).detach()}
