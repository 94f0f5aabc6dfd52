"""On-policy distillation maths and SGLang message shapes, without I/O (the plugin's hooks do the HTTP).

What slime (``slime/rollout/on_policy_distillation.py``, ``apply_opd_kl_to_advantages`` in
``slime/backends/megatron_utils/loss.py``) and Miles (``miles/rollout/on_policy_distillation.py``,
``loss_hub/opd.py``) compute, in their terms:

- the teacher scores the student's sample by prefill: SGLang ``/generate`` with the sample's ``input_ids``
  (prompt + response), ``max_new_tokens`` 0, ``return_logprob`` and ``logprob_start_len`` 0, at the rollout
  temperature (slime 624b824); ``meta_info.input_token_logprobs[1:]`` (the first entry is SGLang's placeholder),
  last ``response_length`` entries, are ``teacher_logp_t``;
- sampled-token OPD: ``rkl_t = logp_old_t - teacher_logp_t`` (the old student policy's log-prob of the sampled
  token, no gradient) and the advantage becomes ``A_t - opd_kl_coef * rkl_t``;
- top-k OPD (Miles' ``--opd-log-prob-top-k K``): per response position a token set ``S_t`` from the student's
  and/or the teacher's top-K (``--opd-top-k-strategy``: only-student, only-teacher, intersection, union, xor),
  each side's log-prob of every token of ``S_t`` (from its own top-K, else from scoring those ids with
  ``token_ids_logprob``), weights ``w`` from ``--opd-reward-weight-mode`` (student_p, teacher_p: the softmax of
  that side's log-probs over ``S_t``; none: uniform; xor: ``exp(logp)`` unnormalised), and
  ``rkl_t = sum_{v in S_t} w_v (logp_s(v) - logp_t(v))``, used in place of the sampled-token ``rkl_t``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")
WEIGHT_MODES = ("student_p", "teacher_p", "none")
DEFAULT_TEACHER = "default"  # Miles' reserved route for samples with no or an unknown teacher name


class TeacherError(RuntimeError):
    """A teacher could not score a sample, or answered something that is not a log-prob per response token."""


def needs_student_top(strategy: str) -> bool:
    return strategy != "only-teacher"


def needs_teacher_top(strategy: str) -> bool:
    return strategy != "only-student"


def teacher_scores_student_ids(strategy: str) -> bool:
    """The teacher must also score the student's top ids (they may be outside its own top-K)."""
    return strategy in ("only-student", "union", "xor")


def student_scores_teacher_ids(strategy: str) -> bool:
    return strategy in ("only-teacher", "union", "xor")


def parse_teacher_urls(values: Iterable[str] | None) -> dict[str, str]:
    """``NAME=URL`` entries -> ``{name: base URL}`` (a trailing ``/generate`` is dropped: the base is what the
    client posts to). Raises ValueError naming the entry that is malformed or repeated."""
    out: dict[str, str] = {}
    for value in values or ():
        name, sep, url = value.partition("=")
        name, url = name.strip(), url.strip()
        if not sep or not name or not url:
            raise ValueError(f"--opd-teacher-urls entry {value!r} is not NAME=URL")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--opd-teacher-urls entry {value!r}: the URL must start with http:// or https://")
        if name in out:
            raise ValueError(f"--opd-teacher-urls names teacher {name!r} twice")
        url = url.rstrip("/")
        out[name] = url[: -len("/generate")] if url.endswith("/generate") else url
    return out


def route(names: Iterable[str], metadata: dict | None, key: str) -> str:
    """The teacher for a sample: ``metadata[key]`` when it names one; else ``default``; else the only teacher.
    Raises TeacherError (the sample fails) when the name is unknown and there is no ``default`` to fall back to."""
    names = list(names)
    name = (metadata or {}).get(key)
    if name is not None and str(name) in names:
        return str(name)
    if DEFAULT_TEACHER in names:
        return DEFAULT_TEACHER
    if name is None and len(names) == 1:
        return names[0]
    what = f"metadata[{key!r}] = {name!r}" if name is not None else f"no metadata[{key!r}]"
    raise TeacherError(f"sample has {what}, which names none of the teachers {sorted(names)}, and there is no "
                       f"{DEFAULT_TEACHER!r} teacher to fall back to")


def score_body(input_ids: list[int], temperature: float, top_k: int = 0,
               token_ids: list[int] | None = None) -> dict:
    """SGLang ``/generate`` body (``GenerateReqInput``) that scores ``input_ids`` by prefill, returning per-input-token
    log-probs (and the top ``top_k`` / the log-probs of ``token_ids`` at every position)."""
    body = {"input_ids": [int(t) for t in input_ids],
            "sampling_params": {"temperature": temperature, "max_new_tokens": 0, "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}
    if top_k > 0:
        body["top_logprobs_num"] = int(top_k)
    if token_ids:
        body["token_ids_logprob"] = [int(t) for t in token_ids]
    return body


def _finite_logprob(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TeacherError(f"{where}: log-prob {value!r} is not a number")
    value = float(value)
    if math.isnan(value) or value > 1e-4:  # -inf is a legal log-prob (a token the model rules out)
        raise TeacherError(f"{where}: {value!r} is not a log-prob")
    return value


def _response_field(response, field: str, response_length: int) -> list:
    """``meta_info[field][1:]``, last ``response_length`` entries (SGLang's first input position is a placeholder)."""
    meta = response.get("meta_info") if isinstance(response, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get(field), list):
        raise TeacherError(f"the answer has no meta_info.{field} list (is return_logprob honoured?)")
    values = meta[field][1:]
    if len(values) < response_length:
        raise TeacherError(f"meta_info.{field} covers {len(values)} input tokens after the first, fewer than the "
                           f"{response_length} response tokens")
    return values[len(values) - response_length:] if response_length else []


def sampled_log_probs(response: dict, response_length: int, input_ids: list[int] | None = None) -> list[float]:
    """Per-response-token log-probs from an ``input_token_logprobs`` answer (``[logprob, token_id, text]`` each).
    With ``input_ids``, each entry's token id must be the sample's token at that position."""
    entries = _response_field(response, "input_token_logprobs", response_length)
    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or not entry:
            raise TeacherError(f"input_token_logprobs entry {entry!r} is not [logprob, token_id, ...]")
        if input_ids is not None and len(entry) > 1 and entry[1] is not None:
            expected = input_ids[len(input_ids) - response_length + i]
            if int(entry[1]) != expected:
                raise TeacherError(f"response token {i}: the answer scores token {entry[1]}, the sample has {expected}")
        out.append(_finite_logprob(entry[0], f"response token {i}"))
    return out


def position_maps(response: dict, field: str, response_length: int) -> list[dict[int, float]]:
    """``input_top_logprobs`` / ``input_token_ids_logprobs`` as one ``{token_id: logprob}`` per response token."""
    maps = []
    for i, entries in enumerate(_response_field(response, field, response_length)):
        position = {}
        for entry in entries or ():
            if not isinstance(entry, (list, tuple)) or len(entry) < 2:
                raise TeacherError(f"{field} entry {entry!r} is not [logprob, token_id, ...]")
            position[int(entry[1])] = _finite_logprob(entry[0], f"{field} at response token {i}")
        maps.append(position)
    return maps


def selected_ids(strategy: str, student: list[int], teacher: list[int]) -> list[int]:
    """The token set of one position, in the order Miles forms it (student's first)."""
    in_student, in_teacher = set(student), set(teacher)
    if strategy == "only-student":
        return list(student)
    if strategy == "only-teacher":
        return list(teacher)
    if strategy == "intersection":
        return [t for t in student if t in in_teacher]
    if strategy == "union":
        return list(dict.fromkeys([*student, *teacher]))
    if strategy == "xor":
        return [t for t in [*student, *teacher] if (t in in_student) != (t in in_teacher)]
    raise ValueError(f"unknown --opd-top-k-strategy {strategy!r}; one of {STRATEGIES}")


def _weights(logps: list[float], normalise: bool) -> list[float]:
    if not logps:
        return []
    if not normalise:
        return [math.exp(x) for x in logps]
    top = max(logps)
    exps = [math.exp(x - top) for x in logps]
    total = sum(exps)
    return [e / total for e in exps] if total else [0.0] * len(exps)


def topk_reverse_kl(strategy: str, weight_mode: str, student_top: list[dict[int, float]],
                    teacher_top: list[dict[int, float]], teacher_on_student: list[dict[int, float]],
                    student_on_teacher: list[dict[int, float]]) -> list[float]:
    """Per response token ``sum_v w_v (logp_s(v) - logp_t(v))`` over the position's token set (module docstring).
    Each argument holds one ``{token_id: logprob}`` per response token (empty where the strategy needs none)."""
    out = []
    for t, (s_top, t_top) in enumerate(zip(student_top, teacher_top, strict=True)):
        ids = selected_ids(strategy, list(s_top), list(t_top))
        s_logp, t_logp = [], []
        for v in ids:
            s = s_top.get(v, student_on_teacher[t].get(v))
            te = t_top.get(v, teacher_on_student[t].get(v))
            if s is None or te is None:
                raise TeacherError(f"response token {t}: no {'student' if s is None else 'teacher'} log-prob for "
                                   f"token id {v}")
            s_logp.append(s)
            t_logp.append(te)
        basis = {"student_p": s_logp, "teacher_p": t_logp, "none": [0.0] * len(ids)}[weight_mode]
        w = _weights(basis, normalise=strategy != "xor")
        out.append(sum(wi * (s - te) for wi, s, te in zip(w, s_logp, t_logp)))
    return out


def add_opd_term(advantages, student_log_probs, teacher_log_probs, coef: float):
    """Sampled-token OPD: ``(A_t - coef * (logp_old_t - teacher_logp_t), logp_old_t - teacher_logp_t)`` per sample
    (tensors ``(R,)``). Students' log-probs enter without gradient."""
    new_adv, rkls = [], []
    for adv, student, teacher in zip(advantages, student_log_probs, teacher_log_probs, strict=True):
        rkl = student.detach().to(adv.device, adv.dtype) - teacher.to(adv.device, adv.dtype)
        new_adv.append(adv - coef * rkl)
        rkls.append(rkl)
    return new_adv, rkls
