"""slime-core hooks for on-policy distillation (OPD): a teacher scores the student's own samples and its per-token
log-probs become an extra advantage term, ``A_t - opd_kl_coef * (logp_old_t - teacher_logp_t)`` (the maths and
SGLang message shapes are in ``slime_opd.distill``).

Where each part runs:
- rollout process: ``slime_startup`` starts the teachers given as checkpoints (``--opd-teacher NAME=PATH``) with
  the policy's own engine launcher (embedded on CPU, SGLang on GPU, ``--rollout-engine``), each with its own
  ``--opd-teacher-num-gpus`` / ``--opd-teacher-num-gpus-per-engine``; teachers given as URLs
  (``--opd-teacher-urls NAME=URL``) are external. A wrapper around ``slime_generate`` scores every finished
  training sample as soon as it is generated: the sample's teacher is ``metadata[--opd-teacher-key]`` (else
  ``default``, else the only teacher), asked through SGLang's ``/generate`` by prefill; the answer is stored in
  ``sample.train_columns`` (``teacher_log_probs``, or ``opd_reverse_kl`` for the top-k variant). A teacher that
  is down, times out or answers anything but a log-prob per response token fails the sample (FAILED, not
  trained, ``metadata["opd_error"]``), counted as ``rollout/opd_teacher_failures``; nothing is filled with zeros.
- train process: a wrapper around ``slime_compute_advantages`` (the algorithm plugin's, e.g. grpo) adds the OPD
  term to the actor's advantages, on the recomputed old-policy log-probs (asked through ``slime_train_inputs``);
  a wrapper around ``slime_loss`` reports its mean as ``train/opd_reverse_kl`` (slime's metric: the student's
  sampled-token reverse KL to the teacher). ``--opd-only`` zeroes the task reward's advantage (pure
  distillation, as slime's OPD example returns 0 rewards).

A teacher in the trainer instead (``--opd-teacher-load CKPT``, slime's ``--opd-type megatron``): a checkpoint of the
student's architecture that every train rank keeps as a CPU copy and scores the batch with in its no-grad pass
(``slime_scoring_weights``: the core fills ``teacher_log_probs`` before the advantages); no teacher engines and no
rollout-time scoring, the same advantage term and metrics (not the per-teacher rollout metric, nor top-k OPD).
"""

from __future__ import annotations

import inspect
import itertools
import logging
from pathlib import Path

from slimecore import hookimpl
from slimecore.checkpoint_layout import megatron_lm_checkpoint
from slimecore.config import Config, ConfigError, Option, check_weights_dir
from slimecore.types import Status
from slime_opd.distill import (DEFAULT_TEACHER, STRATEGIES, WEIGHT_MODES, TeacherError, needs_student_top,
                               needs_teacher_top, parse_teacher_urls, position_maps, route, sampled_log_probs,
                               score_body, student_scores_teacher_ids, teacher_scores_student_ids, topk_reverse_kl)

NAME = "opd"
log = logging.getLogger("slimecore.opd")
FAILURES_LOGGED = 3

# rollout process state: teacher name -> its engines' base URLs (round robin), the engines this run started
_teachers: dict[str, itertools.cycle] = {}
_started: list[tuple[object, object]] = []  # (launcher, actor)
_failures_logged = 0


@hookimpl
def slime_options():
    return [
        Option("opd_teacher", str, None, "Teachers the run starts, NAME=HF_CHECKPOINT (a bare path is the "
               "'default' teacher); served by the policy's engine kind (--rollout-engine).", nargs="+"),
        Option("opd_teacher_load", str, None, "The teacher in the trainer (slime's --opd-type megatron): a "
               "checkpoint of the student's architecture (an HF directory; on --train-backend megatron also a "
               "torch_dist one, slime-core's or a Megatron-LM root) that each train rank keeps as a CPU copy (one "
               "more copy of the model in host memory) and runs forward over the batch once a step; no teacher "
               "engines."),
        Option("opd_teacher_ckpt_step", int, None, "With --opd-teacher-load a Megatron-LM checkpoint root: the "
               "iteration to read (its iter_N folder) instead of the one its latest_checkpointed_iteration.txt "
               "names (slime's flag; megatron)."),
        Option("opd_teacher_urls", str, None, "External teachers, NAME=URL (SGLang servers or routers; Miles' "
               "flag). 'default' takes samples whose teacher name is missing or unknown.", nargs="+"),
        Option("opd_teacher_key", str, "opd_teacher", "Sample metadata key naming a sample's teacher."),
        Option("opd_teacher_num_gpus", int, 1, "GPUs of each started teacher (embedded on CPU: engines = this / "
               "--opd-teacher-num-gpus-per-engine)."),
        Option("opd_teacher_num_gpus_per_engine", int, 1, "GPUs (tensor-parallel size) of one teacher engine."),
        Option("opd_teacher_timeout", float, 120.0, "Seconds one teacher request may take."),
        Option("opd_teacher_max_retries", int, 2, "Retries of a teacher request after a connection error or 5xx."),
        Option("opd_kl_coef", float, 1.0, "Weight of the OPD term: A_t - coef * (logp_student - logp_teacher)."),
        Option("opd_log_prob_top_k", int, 0, "Top-k OPD over K tokens per position (0: the sampled token only)."),
        Option("opd_top_k_strategy", str, "only-student", "Token set of top-k OPD.", choices=STRATEGIES),
        Option("opd_reward_weight_mode", str, "student_p", "Weights of top-k OPD's tokens.", choices=WEIGHT_MODES),
        Option("opd_only", bool, False, "Pure distillation: the task reward's advantage is 0, the OPD term is the "
               "only signal."),
    ]


def teacher_specs(o) -> tuple[dict[str, str], dict[str, str]]:
    """``(started {name: checkpoint}, external {name: url})`` from the options; ConfigError on a bad entry."""
    started: dict[str, str] = {}
    for value in o.opd_teacher or ():
        name, sep, path = value.partition("=")
        name, path = (name.strip(), path.strip()) if sep else (DEFAULT_TEACHER, value.strip())
        if not name or not path:
            raise ConfigError(f"--opd-teacher entry {value!r} is not NAME=HF_CHECKPOINT")
        if name in started:
            raise ConfigError(f"--opd-teacher names teacher {name!r} twice")
        started[name] = path
    try:
        external = parse_teacher_urls(o.opd_teacher_urls)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    both = sorted(set(started) & set(external))
    if both:
        raise ConfigError(f"teacher name(s) {both} given by both --opd-teacher and --opd-teacher-urls; rename one")
    return started, external


@hookimpl
def slime_validate_config(config):
    o = config.plugin(NAME)
    started, external = teacher_specs(o)
    if not started and not external and not o.opd_teacher_load:
        raise ConfigError("--plugin opd needs a teacher: --opd-teacher NAME=HF_CHECKPOINT (the run starts it), "
                          "--opd-teacher-urls NAME=URL (a running SGLang server) or --opd-teacher-load CKPT (in the "
                          "trainer)")
    if o.opd_teacher_load:
        if started or external:
            raise ConfigError("--opd-teacher-load (the teacher in the trainer) and --opd-teacher / --opd-teacher-urls "
                              "(teachers served by engines) exclude each other; keep one")
        if o.opd_log_prob_top_k:
            raise ConfigError("--opd-log-prob-top-k with --opd-teacher-load: the trainer's teacher scores the sampled "
                              "token only; top-k OPD needs --opd-teacher or --opd-teacher-urls")
        check_weights_dir(config, "--opd-teacher-load", o.opd_teacher_load, o.opd_teacher_ckpt_step,
                          "--opd-teacher-ckpt-step")
    elif o.opd_teacher_ckpt_step is not None:
        raise ConfigError("--opd-teacher-ckpt-step picks an iteration of --opd-teacher-load's Megatron-LM checkpoint "
                          "root; give --opd-teacher-load ROOT too")
    for name, path in started.items():
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"--opd-teacher {name}={path}: no config.json there; give an HF checkpoint directory")
    if not config.starts_engines:
        raise ConfigError("--plugin opd scores generated samples; it cannot run without engines (--no-engines, SFT)")
    if o.opd_kl_coef <= 0:
        raise ConfigError(f"--opd-kl-coef must be > 0 (got {o.opd_kl_coef})")
    if o.opd_log_prob_top_k < 0:
        raise ConfigError(f"--opd-log-prob-top-k must be >= 0 (got {o.opd_log_prob_top_k})")
    if o.opd_log_prob_top_k and config.rollout_engine != "sglang":
        raise ConfigError("--opd-log-prob-top-k needs --rollout-engine sglang: the student is scored on its top-k "
                          "and on the teacher's, and the embedded engine returns no top-k or per-id log-probs")
    if o.opd_teacher_num_gpus < 1 or o.opd_teacher_num_gpus_per_engine < 1:
        raise ConfigError("--opd-teacher-num-gpus and --opd-teacher-num-gpus-per-engine must be >= 1")


# -- rollout process ----------------------------------------------------------------------------------------------

def teacher_config(config: Config, checkpoint: str) -> Config:
    """The run's config with the teacher's checkpoint and placement, for the policy's engine launcher."""
    o = config.plugin(NAME)
    data = config.to_dict()
    data["values"] = dict(data["values"], hf_checkpoint=checkpoint, rollout_num_gpus=o.opd_teacher_num_gpus,
                          rollout_num_gpus_per_engine=o.opd_teacher_num_gpus_per_engine)
    return Config.from_dict(data)


@hookimpl
def slime_startup(config, process):
    if process != "rollout":
        return
    from slimecore.engines.launch import EngineLauncher

    started, external = teacher_specs(config.plugin(NAME))
    urls: dict[str, list[str]] = {name: [url] for name, url in external.items()}
    for name, checkpoint in started.items():
        launcher = EngineLauncher(teacher_config(config, checkpoint))
        engines = launcher.start()
        _started.extend((launcher, actor) for actor, _ in engines)
        urls[name] = [url for _, url in engines]
        log.info("OPD teacher %r: %d %s engine(s) serving %s at %s", name, len(engines), config.rollout_engine,
                 checkpoint, ", ".join(urls[name]))
    _teachers.clear()
    _teachers.update({name: itertools.cycle(u) for name, u in urls.items()})


@hookimpl
def slime_shutdown(config, process):
    if process != "rollout":
        return
    while _started:
        launcher, actor = _started.pop()
        launcher.stop(actor)
    _teachers.clear()


async def _post(client, body: dict) -> dict:
    body = dict(body)
    return await client.generate(body.pop("input_ids"), body.pop("sampling_params"),
                                 return_logprob=body.pop("return_logprob"), **body)


def _ids(maps: list[dict[int, float]]) -> list[int]:
    return sorted({token for position in maps for token in position})


async def score_sample(config, sample, student) -> None:
    """Put the teacher's signal for ``sample`` in ``sample.train_columns``, or fail the sample (module docstring).
    ``student``: the policy's client, for the top-k variant's student scores."""
    from slimecore.rollout.client import EngineError, RolloutClient

    o = config.plugin(NAME)
    name = url = teacher = None
    try:
        name = route(_teachers, sample.metadata, o.opd_teacher_key)
        url = next(_teachers[name])
        # a client (HTTP session) per sample, closed below: samples of several event loops (fully async) share none
        teacher = RolloutClient(url, timeout=o.opd_teacher_timeout, max_retries=o.opd_teacher_max_retries)
        n, tokens, temperature = sample.response_length, sample.tokens, config.rollout_temperature
        k, strategy = o.opd_log_prob_top_k, o.opd_top_k_strategy
        if not k:
            answer = await _post(teacher, score_body(tokens, temperature))
            sample.train_columns["teacher_log_probs"] = sampled_log_probs(answer, n, tokens)
            return
        none = [{} for _ in range(n)]
        student_top = none
        if needs_student_top(strategy):
            student_top = position_maps(await _post(student, score_body(tokens, temperature, top_k=k)),
                                        "input_top_logprobs", n)
        answer = await _post(teacher, score_body(tokens, temperature, top_k=k if needs_teacher_top(strategy) else 0,
                                                 token_ids=_ids(student_top) if teacher_scores_student_ids(strategy)
                                                 else None))
        teacher_top = position_maps(answer, "input_top_logprobs", n) if needs_teacher_top(strategy) else none
        teacher_on_student = (position_maps(answer, "input_token_ids_logprobs", n)
                              if teacher_scores_student_ids(strategy) else none)
        student_on_teacher = none
        if student_scores_teacher_ids(strategy):
            student_on_teacher = position_maps(await _post(student, score_body(tokens, temperature,
                                                                               token_ids=_ids(teacher_top))),
                                               "input_token_ids_logprobs", n)
        sample.train_columns["opd_reverse_kl"] = topk_reverse_kl(strategy, o.opd_reward_weight_mode, student_top,
                                                                 teacher_top, teacher_on_student, student_on_teacher)
    except (TeacherError, EngineError) as exc:
        fail(sample, f"OPD teacher {name!r}" + (f" at {url}" if url else "") + f": {exc}")
    finally:
        if teacher is not None:
            await teacher.close()


def fail(sample, why: str) -> None:
    """The sample is not trained (FAILED, reward 0, loss mask 0) and says why; counted by ``slime_log_rollout``."""
    global _failures_logged
    _failures_logged += 1
    if _failures_logged <= FAILURES_LOGGED:
        log.warning("sample %s: %s (the sample is not trained)", sample.index, why)
    sample.status, sample.reward, sample.remove_sample = Status.FAILED, 0.0, True
    sample.train_columns.pop("teacher_log_probs", None)
    sample.train_columns.pop("opd_reverse_kl", None)
    sample.metadata["opd_error"] = why


@hookimpl(wrapper=True)
def slime_generate(config, sample, sampling_params, client, evaluation):
    """Score each finished training sample as soon as its generate hook returns it (see the module docstring)."""
    answer = yield
    if evaluation or config.plugin(NAME).opd_teacher_load:  # the trainer's teacher scores in the train step
        return answer

    async def scored():
        out = await answer if inspect.isawaitable(answer) else answer
        for s in out if isinstance(out, list) else [out]:
            if s.status in (Status.COMPLETED, Status.TRUNCATED) and s.response_length and not s.remove_sample:
                await score_sample(config, s, client)
        return out

    return scored()


@hookimpl
def slime_log_rollout(config, rollout_id, samples, metrics):
    metrics["rollout/opd_teacher_failures"] = float(sum("opd_error" in s.metadata for s in samples))
    per_teacher: dict[str, list[float]] = {}  # the sampled-token reverse KL at generation, on each teacher's samples
    for s in samples:
        teacher = s.train_columns.get("teacher_log_probs")
        if teacher and s.rollout_log_probs and "opd_error" not in s.metadata and _teachers:
            name = route(_teachers, s.metadata, config.plugin(NAME).opd_teacher_key)  # as score_sample routed it
            rkl = [a - b for a, b in zip(s.rollout_log_probs[-len(teacher):], teacher)]
            per_teacher.setdefault(name, []).append(sum(rkl) / len(rkl))
    for name, values in per_teacher.items():
        metrics[f"rollout/opd_reverse_kl/{name}"] = sum(values) / len(values)


@hookimpl(wrapper=True)
def slime_post_process_rewards(config, samples):
    raw, rewards = yield
    if config.plugin(NAME).opd_only:
        return raw, [0.0] * len(rewards)
    return raw, rewards


# -- train process ------------------------------------------------------------------------------------------------

@hookimpl
def slime_scoring_weights(config, role):
    """--opd-teacher-load: the trainer fills ``teacher_log_probs`` with the teacher's log-probs."""
    o = config.plugin(NAME)
    load = o.opd_teacher_load
    if load and o.opd_teacher_ckpt_step is not None:  # the root's iteration folder, which the trainer reads as given
        load = str(megatron_lm_checkpoint(load, o.opd_teacher_ckpt_step))
    return {"teacher_log_probs": load} if role == "actor" and load else {}


@hookimpl
def slime_train_inputs(config, role):
    """The sampled-token term needs the old policy's log-probs (slime's ``log_probs``)."""
    return ["log_probs"] if role == "actor" and not config.plugin(NAME).opd_log_prob_top_k else []


def reverse_kl_columns(config, batch) -> list:
    """Per sample, the (R,) tensor ``logp_old - teacher_logp`` (or the top-k variant's); zeros for a sample the
    rollout failed, whose loss mask is all zeros. RuntimeError if a trained sample has no teacher signal."""
    import torch

    key = "opd_reverse_kl" if config.plugin(NAME).opd_log_prob_top_k else "teacher_log_probs"
    column = batch.get(key) or [None] * len(batch["response_lengths"])
    out = []
    for i, (value, n, mask) in enumerate(zip(column, batch["response_lengths"], batch["loss_masks"])):
        if value is None:
            if float(torch.as_tensor(mask).sum()) > 0:
                raise RuntimeError(f"--plugin opd: sample {batch['sample_indices'][i]} is trained but has no "
                                   f"{key} (was it generated without the opd plugin's generate wrapper?)")
            out.append(torch.zeros(n))
            continue
        value = torch.as_tensor(value, dtype=torch.float32)
        out.append(value if key == "opd_reverse_kl" else batch["log_probs"][i].detach().float().cpu() - value)
    return out


@hookimpl(wrapper=True)
def slime_compute_advantages(config, role, batch):
    result = yield
    if role != "actor":
        return result
    o = config.plugin(NAME)
    rkl = reverse_kl_columns(config, batch)
    advantages = [a - o.opd_kl_coef * r.to(a.device, a.dtype) for a, r in zip(result["advantages"], rkl)]
    batch["opd_reverse_kl"] = rkl  # per sample, for the loss metric
    return {**result, "advantages": advantages}


@hookimpl(wrapper=True)
def slime_loss(config, role, batch, outputs, reducer):
    loss, metrics = yield
    if role == "actor" and batch.get("opd_reverse_kl") is not None:
        metrics = {**metrics, "opd_reverse_kl": reducer(list(batch["opd_reverse_kl"])).detach()}
    return loss, metrics
