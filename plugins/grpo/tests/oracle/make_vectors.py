"""Generate ``slime_vectors.json``: CISPO, plain REINFORCE and the current-policy TIS weight computed by slime's
and Miles' own functions on fixed inputs (``slimecore.testing.reference``).

    python plugins/grpo/tests/oracle/make_vectors.py --slime /path/to/slime/git --miles-corrections FILE

- ``compute_cispo_loss`` and ``compute_policy_loss``: ``slime/utils/ppo_utils.py`` at THUDM/slime 624b824.
- plain REINFORCE (slime PR #2083, Miles PR #1343, ``-A * logp``) is not in either tree at these commits; its
  vectors are slime's ``compute_cispo_loss`` at ratio 1 (old = current policy), which is that surrogate exactly.
- ``off_policy_is_function`` (the current-policy TIS hook, slime PR #2084 / Miles PR #1344): not merged in slime;
  ``miles/backends/training_utils/loss_hub/corrections.py`` at radixark/miles 10944efb (the PR's head) is passed
  as a file. Its bounds are ``[1 - eps_clip, 1 + eps_clip_high]``; slime's PR uses ``[tis_clip_low, tis_clip]``:
  the vectors are made with ``eps_clip = 1 - tis_clip_low``, ``eps_clip_high = tis_clip - 1``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from slimecore.testing.reference import git_show, load_functions, write_vectors

SLIME_COMMIT = "624b824a8"
MILES_COMMIT = "10944efbe6224c9a40907b9804ea3553d873348f"


def _inputs(seed: int, n: int = 24):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g) * 4 - 0.05
    old = logp + (torch.rand(n, generator=g) - 0.5) * 1.2  # ratios from ~0.55 to ~1.8: both clips bind
    rollout = logp + (torch.rand(n, generator=g) - 0.5) * 2.0
    adv = torch.randn(n, generator=g)
    return logp, old, rollout, adv


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slime", required=True, help="a clone (or bare git dir) of THUDM/slime")
    parser.add_argument("--miles-corrections", required=True, help="Miles' loss_hub/corrections.py at 10944efb")
    args = parser.parse_args()
    ppo = load_functions(git_show(args.slime, SLIME_COMMIT, "slime/utils/ppo_utils.py"),
                         ["compute_cispo_loss", "compute_policy_loss"])
    miles = load_functions(Path(args.miles_corrections).read_text(), ["off_policy_is_function"])
    cases = []
    for seed, (eps, eps_high) in enumerate([(0.2, 0.28), (1.0, 0.28), (0.1, 0.1)]):
        logp, old, rollout, adv = _inputs(seed)
        x = logp.clone().requires_grad_(True)
        loss, clipfrac = ppo["compute_cispo_loss"](old - x, x, adv, eps, eps_high)
        loss.sum().backward()
        cases.append({"kind": "cispo", "eps_clip": eps, "eps_clip_high": eps_high, "log_probs": logp,
                      "old_log_probs": old, "advantages": adv, "pg_loss": loss.detach(), "clipfrac": clipfrac,
                      "grad": x.grad})
    for seed in (10, 11):
        logp, old, rollout, adv = _inputs(seed)
        x = logp.clone().requires_grad_(True)
        loss, clipfrac = ppo["compute_cispo_loss"](x.detach() - x, x, adv, 0.2, 0.28)  # ratio 1: -A * logp
        loss.sum().backward()
        cases.append({"kind": "reinforce", "log_probs": logp, "old_log_probs": old, "advantages": adv,
                      "pg_loss": loss.detach(), "clipfrac": clipfrac, "grad": x.grad})
    for seed, (low, high) in zip((20, 21), [(0.0, 2.0), (0.8, 1.25)]):
        logp, old, rollout, adv = _inputs(seed)
        x = logp.clone().requires_grad_(True)
        pg, _ = ppo["compute_policy_loss"](old - x, adv, 0.2, 0.2)
        opts = argparse.Namespace(eps_clip=1.0 - low, eps_clip_high=high - 1.0)
        weighted, _, metrics = miles["off_policy_is_function"](opts, pg_loss=pg, cur_log_probs=[x],
                                                               rollout_log_probs=[rollout], loss_masks=[None])
        weighted.sum().backward()
        cases.append({"kind": "tis_current", "tis_clip_low": low, "tis_clip": high, "eps_clip": 0.2,
                      "log_probs": logp, "old_log_probs": old, "rollout_log_probs": rollout, "advantages": adv,
                      "pg_loss": weighted.detach(), "ratio": metrics["is_weight"],
                      "clipfrac": metrics["is_clipfrac"], "grad": x.grad})
    write_vectors(Path(__file__).with_name("slime_vectors.json"),
                  {"slime": f"THUDM/slime@{SLIME_COMMIT} slime/utils/ppo_utils.py",
                   "miles": f"radixark/miles@{MILES_COMMIT} miles/backends/training_utils/loss_hub/corrections.py",
                   "generator": "plugins/grpo/tests/oracle/make_vectors.py"}, cases)


if __name__ == "__main__":
    main()
