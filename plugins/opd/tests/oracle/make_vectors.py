"""Generate ``slime_vectors.json``: the OPD advantage computed by slime's and Miles' own functions on fixed inputs
(``slimecore.testing.reference``).

    python plugins/opd/tests/oracle/make_vectors.py --slime /path/to/slime/git --miles /path/to/miles/git

- sampled-token OPD: THUDM/slime 624b824, ``post_process_rewards`` of ``slime/rollout/on_policy_distillation.py``
  (teacher log-probs out of SGLang's ``/generate`` answer) and ``apply_opd_kl_to_advantages`` of
  ``slime/backends/megatron_utils/loss.py``;
- top-k OPD: radixark/miles 31f1ca961, ``_compute_topk_reverse_kl`` (and its helpers) of
  ``miles/rollout/on_policy_distillation.py`` and ``apply_opd_kl_to_advantages`` of
  ``miles/backends/training_utils/loss_hub/opd.py``, for every strategy and weight mode.
The SGLang answers are synthetic but shaped as SGLang returns them for ``logprob_start_len`` 0: one entry per input
token, the first a placeholder, entries ``[logprob, token_id, None]``, drawn from two fixed per-position
distributions (student, teacher) over a small vocabulary.
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import torch

from slimecore.testing.reference import git_show, load_functions, write_vectors

SLIME_COMMIT = "624b824a8"
MILES_COMMIT = "31f1ca961"
MILES_TOPK = ["_get_top_k_strategy", "_get_reward_weight_mode", "_top_entry_token_id", "_top_entry_logprob",
              "_top_entries_to_map", "_trim_input_field", "_input_logprob_maps", "_student_top_logprobs",
              "_unique_ids", "_ordered_unique", "_selected_token_ids", "_lookup_logprob", "_reward_weights",
              "_compute_topk_reverse_kl"]


def _entries(logp: torch.Tensor, ids) -> list:
    return [[float(logp[i]), int(i), None] for i in ids]


def _answer(field_rows: dict, prompt_len: int) -> dict:
    """SGLang's meta_info for a prefill-scored sequence: per field, a placeholder then one entry per later token."""
    return {"meta_info": {f: [None] + [[] for _ in range(prompt_len - 1)] + rows for f, rows in field_rows.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slime", required=True)
    parser.add_argument("--miles", required=True)
    args = parser.parse_args()
    slime_opd = load_functions(git_show(args.slime, SLIME_COMMIT, "slime/rollout/on_policy_distillation.py"),
                               ["post_process_rewards"])
    slime_loss = load_functions(git_show(args.slime, SLIME_COMMIT, "slime/backends/megatron_utils/loss.py"),
                                ["apply_opd_kl_to_advantages"])
    miles_topk = load_functions(git_show(args.miles, MILES_COMMIT, "miles/rollout/on_policy_distillation.py"), MILES_TOPK)
    miles_adv = load_functions(git_show(args.miles, MILES_COMMIT, "miles/backends/training_utils/loss_hub/opd.py"),
                               ["apply_opd_kl_to_advantages"])
    g = torch.Generator().manual_seed(0)
    cases = []

    # sampled-token OPD, two samples (prompt lengths 5 and 3, responses 4 and 6)
    samples, answers, student, advantages = [], [], [], []
    for prompt_len, n in ((5, 4), (3, 6)):
        tokens = torch.randint(0, 50, (prompt_len + n,), generator=g).tolist()
        teacher = (-torch.rand(prompt_len + n, generator=g) * 5).tolist()
        answer = {"meta_info": {"input_token_logprobs": [[None, tokens[0], None]] +
                                [[lp, t, None] for lp, t in zip(teacher[1:], tokens[1:])]}}
        samples.append(types.SimpleNamespace(response_length=n, get_reward_value=lambda a, ans=answer: ans))
        answers.append({"tokens": tokens, "response_length": n, "answer": answer})
        student.append(-torch.rand(n, generator=g) * 5)
        advantages.append(torch.randn(n, generator=g))
    slime_opd["post_process_rewards"](types.SimpleNamespace(), samples)
    teacher_lps = [s.teacher_log_probs for s in samples]
    adv = [a.clone() for a in advantages]
    rollout_data = {"teacher_log_probs": teacher_lps}
    opts = types.SimpleNamespace(opd_kl_coef=0.7, opd_type="sglang")
    slime_loss["apply_opd_kl_to_advantages"](opts, rollout_data, adv, student)
    cases.append({"kind": "sampled", "opd_kl_coef": 0.7, "samples": answers, "student_log_probs": student,
                  "advantages": advantages, "teacher_log_probs": teacher_lps, "new_advantages": adv,
                  "reverse_kl": rollout_data["opd_reverse_kl"]})

    # top-k OPD: per position, student and teacher distributions over 12 tokens; K = 3
    prompt_len, n, k, vocab = 4, 5, 3, 12
    s_logp = torch.log_softmax(torch.randn(n, vocab, generator=g) * 2, -1)
    t_logp = torch.log_softmax(torch.randn(n, vocab, generator=g) * 2, -1)
    s_top = [s_logp[i].topk(k).indices.tolist() for i in range(n)]
    t_top = [t_logp[i].topk(k).indices.tolist() for i in range(n)]
    s_ids = sorted({v for ids in s_top for v in ids})
    t_ids = sorted({v for ids in t_top for v in ids})
    student_top = [_entries(s_logp[i], s_top[i]) for i in range(n)]
    teacher_answer = _answer({"input_top_logprobs": [_entries(t_logp[i], t_top[i]) for i in range(n)],
                              "input_token_ids_logprobs": [_entries(t_logp[i], s_ids) for i in range(n)]}, prompt_len)
    student_answer = _answer({"input_top_logprobs": student_top,
                              "input_token_ids_logprobs": [_entries(s_logp[i], t_ids) for i in range(n)]}, prompt_len)
    advantages = torch.randn(n, generator=g)
    for strategy in ("only-student", "only-teacher", "intersection", "union", "xor"):
        for mode in ("student_p", "teacher_p", "none"):
            miles_args = types.SimpleNamespace(opd_top_k_strategy=strategy, opd_reward_weight_mode=mode,
                                               opd_kl_coef=0.5)
            sample = types.SimpleNamespace(response_length=n, metadata={"opd_student_top_logprobs": student_top})
            rkl = miles_topk["_compute_topk_reverse_kl"](miles_args, sample, {"teacher": teacher_answer,
                                                                               "student_on_teacher": student_answer})
            adv, data = [advantages.clone()], {"opd_reverse_kl": [rkl]}
            miles_adv["apply_opd_kl_to_advantages"](miles_args, data, adv, [torch.zeros(n)])
            cases.append({"kind": "topk", "strategy": strategy, "weight_mode": mode, "opd_kl_coef": 0.5, "k": k,
                          "response_length": n, "teacher_answer": teacher_answer, "student_answer": student_answer,
                          "advantages": advantages, "reverse_kl": rkl, "new_advantages": adv[0]})
    write_vectors(Path(__file__).with_name("slime_vectors.json"),
                  {"slime": f"THUDM/slime@{SLIME_COMMIT} slime/rollout/on_policy_distillation.py, "
                            "slime/backends/megatron_utils/loss.py",
                   "miles": f"radixark/miles@{MILES_COMMIT} miles/rollout/on_policy_distillation.py, "
                            "miles/backends/training_utils/loss_hub/opd.py",
                   "generator": "plugins/opd/tests/oracle/make_vectors.py"}, cases)


if __name__ == "__main__":
    main()
