"""CISPO, plain REINFORCE and the current-policy TIS weight against slime's and Miles' own functions: the vectors
in ``oracle/slime_vectors.json`` were computed by their code on fixed inputs (``oracle/make_vectors.py`` says which
commits and how). Each case runs through the grpo plugin's ``slime_loss`` hook as a run calls it, with a summing
reducer, so the loss, the clip fraction and the gradient per token are compared (rtol 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slimecore.config import Config
from slimecore.plugins import load_plugins
from slimecore.testing.reference import read_vectors

VECTORS = read_vectors(Path(__file__).parent / "oracle" / "slime_vectors.json")["cases"]
HOOKS = load_plugins(["grpo"])
DEFAULTS = {o.name: o.default for o in HOOKS.slime_options()["grpo"]}


def _run(case: dict, **options):
    config = Config.make(plugins=["grpo"], plugin_values={"grpo": DEFAULTS | options})
    t = {k: torch.tensor(v) for k, v in case.items() if isinstance(v, list)}
    log_probs = t["log_probs"].clone().requires_grad_(True)
    halves = [log_probs[:10], log_probs[10:]]  # two samples, as a micro-batch holds them

    def split(x):
        return [x[:10], x[10:]]

    batch = {"advantages": split(t["advantages"]), "log_probs": split(t["old_log_probs"]),
             "loss_masks": split(torch.ones_like(t["log_probs"]))}
    if "rollout_log_probs" in t:
        batch["rollout_log_probs"] = split(t["rollout_log_probs"])
    loss, metrics = HOOKS.slime_loss(config=config, role="actor", batch=batch, outputs={"log_probs": halves},
                                     reducer=lambda xs: torch.cat(list(xs)).sum())
    loss.backward()
    return t, loss, metrics, log_probs.grad


def _close(ours, theirs):
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float32), torch.as_tensor(theirs), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("case", [c for c in VECTORS if c["kind"] == "cispo"], ids=lambda c: f"eps{c['eps_clip']}")
def test_cispo_equals_slime(case):
    t, loss, metrics, grad = _run(case, advantage_estimator="cispo", eps_clip=case["eps_clip"],
                                  eps_clip_high=case["eps_clip_high"])
    assert 0 < t["clipfrac"].sum() < len(t["clipfrac"])  # the case clips some tokens, not all
    _close(loss.item(), t["pg_loss"].sum())
    _close(metrics["pg_clipfrac"], t["clipfrac"].sum())
    _close(grad, t["grad"])  # clipped tokens keep their gradient: -sg(clip(ratio)) * A


@pytest.mark.parametrize("case", [c for c in VECTORS if c["kind"] == "reinforce"], ids=lambda c: str(c["advantages"][0]))
def test_reinforce_equals_slime(case):
    t, loss, metrics, grad = _run(case, advantage_estimator="reinforce")
    _close(loss.item(), t["pg_loss"].sum())
    _close(grad, t["grad"])
    assert metrics["pg_clipfrac"].item() == 0.0


@pytest.mark.parametrize("case", [c for c in VECTORS if c["kind"] == "tis_current"], ids=lambda c: str(c["tis_clip"]))
def test_current_policy_tis_equals_miles(case):
    t, loss, metrics, grad = _run(case, use_tis=True, tis_mode="current", tis_clip_low=case["tis_clip_low"],
                                  tis_clip=case["tis_clip"], eps_clip=case["eps_clip"])
    weights = t["ratio"].clamp(case["tis_clip_low"], case["tis_clip"])
    assert 0 < t["clipfrac"].sum() < len(t["clipfrac"])
    _close(loss.item(), t["pg_loss"].sum())
    _close(grad, t["grad"])  # the weight is a constant: no gradient through the current policy's ratio
    _close(metrics["tis"], weights.sum())
    _close(metrics["tis_clipfrac"], t["clipfrac"].sum())


def test_current_policy_tis_is_allowed_with_rollout_logprobs_and_others_are_not():
    from slimecore.config import ConfigError

    HOOKS.slime_validate_config(config=Config.make(plugins=["grpo"], plugin_values={"grpo": DEFAULTS | {
        "use_tis": True, "use_rollout_logprobs": True, "tis_mode": "current", "advantage_estimator": "reinforce"}}))
    with pytest.raises(ConfigError, match="--tis-mode current"):
        HOOKS.slime_validate_config(config=Config.make(plugins=["grpo"], plugin_values={"grpo": DEFAULTS | {
            "use_tis": True, "use_rollout_logprobs": True}}))
