"""OPD without a training run: the advantage against slime's and Miles' own functions (``oracle/slime_vectors.json``,
made by ``oracle/make_vectors.py``), routing, request bodies against SGLang's own classes, scoring through a real
embedded engine, and a down or junk teacher failing (and counting) its sample."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from slimecore import hookimpl
from slimecore.config import Config, ConfigError
from slimecore.plugins import load_plugins
from slimecore.rollout.client import RolloutClient
from slimecore.sglang_schema import class_fields, sglang_root
from slimecore.testing.reference import read_vectors
from slimecore.types import Sample, Status
from slime_opd import plugin
from slime_opd.distill import (STRATEGIES, TeacherError, needs_teacher_top, parse_teacher_urls, position_maps, route,
                               sampled_log_probs, score_body, student_scores_teacher_ids, teacher_scores_student_ids,
                               topk_reverse_kl)

VECTORS = read_vectors(Path(__file__).parent / "oracle" / "slime_vectors.json")["cases"]
DEFAULTS = {o.name: o.default for o in load_plugins(["opd"]).slime_options()["opd"]}


def _config(**options) -> Config:
    return Config.make(plugins=["opd"], plugin_values={"opd": DEFAULTS | options})


class FixedAdvantages:
    """Stands for the algorithm plugin: answers slime_compute_advantages with given advantages."""

    def __init__(self, advantages):
        self.advantages = advantages

    @hookimpl
    def slime_compute_advantages(self, config, role, batch):
        return {"advantages": [a.clone() for a in self.advantages], "returns": self.advantages}


def _close(ours, theirs):
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float32),
                               torch.as_tensor(theirs, dtype=torch.float32), rtol=1e-5, atol=1e-6)


def test_sampled_token_advantage_equals_slime():
    case = next(c for c in VECTORS if c["kind"] == "sampled")
    teacher = [sampled_log_probs(s["answer"], s["response_length"], s["tokens"]) for s in case["samples"]]
    for ours, slimes in zip(teacher, case["teacher_log_probs"]):
        _close(ours, slimes)
    advantages = [torch.tensor(a) for a in case["advantages"]]
    hooks = load_plugins(["opd"], extra=[FixedAdvantages(advantages)])
    n = [s["response_length"] for s in case["samples"]]
    batch = {"response_lengths": n, "loss_masks": [torch.ones(k) for k in n], "sample_indices": [0, 1],
             "log_probs": [torch.tensor(x) for x in case["student_log_probs"]], "teacher_log_probs": teacher}
    out = hooks.slime_compute_advantages(config=_config(opd_kl_coef=case["opd_kl_coef"]), role="actor", batch=batch)
    for ours, slimes in zip(out["advantages"], case["new_advantages"]):
        _close(ours, slimes)
    for ours, slimes in zip(batch["opd_reverse_kl"], case["reverse_kl"]):
        _close(ours, slimes)
    assert out["returns"] is advantages  # as slime: returns keep the algorithm's values


@pytest.mark.parametrize("case", [c for c in VECTORS if c["kind"] == "topk"],
                         ids=lambda c: f"{c['strategy']}-{c['weight_mode']}")
def test_topk_advantage_equals_miles(case):
    n, strategy = case["response_length"], case["strategy"]
    none = [{} for _ in range(n)]
    student_top = position_maps(case["student_answer"], "input_top_logprobs", n)
    teacher_top = position_maps(case["teacher_answer"], "input_top_logprobs", n) if needs_teacher_top(strategy) else none
    t_on_s = (position_maps(case["teacher_answer"], "input_token_ids_logprobs", n)
              if teacher_scores_student_ids(strategy) else none)
    s_on_t = (position_maps(case["student_answer"], "input_token_ids_logprobs", n)
              if student_scores_teacher_ids(strategy) else none)
    if strategy == "only-teacher":
        student_top = none
    rkl = topk_reverse_kl(strategy, case["weight_mode"], student_top, teacher_top, t_on_s, s_on_t)
    _close(rkl, case["reverse_kl"])
    hooks = load_plugins(["opd"], extra=[FixedAdvantages([torch.tensor(case["advantages"])])])
    batch = {"response_lengths": [n], "loss_masks": [torch.ones(n)], "sample_indices": [0], "opd_reverse_kl": [rkl]}
    out = hooks.slime_compute_advantages(config=_config(opd_log_prob_top_k=case["k"], opd_kl_coef=case["opd_kl_coef"]),
                                         role="actor", batch=batch)
    _close(out["advantages"][0], case["new_advantages"])


def test_routing_by_metadata_with_default_and_failures():
    assert route(["a", "b"], {"opd_teacher": "b"}, "opd_teacher") == "b"
    assert route(["a", "default"], {"opd_teacher": "zz"}, "opd_teacher") == "default"
    assert route(["a", "default"], {}, "opd_teacher") == "default"
    assert route(["only"], {}, "opd_teacher") == "only"  # one teacher takes every sample that names none
    with pytest.raises(TeacherError, match="names none of the teachers"):
        route(["a", "b"], {"opd_teacher": "c"}, "opd_teacher")
    with pytest.raises(TeacherError, match="no metadata"):
        route(["a", "b"], {}, "opd_teacher")
    assert parse_teacher_urls(["m=http://h:1/generate", "c=http://h:2/"]) == {"m": "http://h:1", "c": "http://h:2"}
    for bad, match in ((["m"], "not NAME=URL"), (["m=h:1"], "http://"), (["m=http://a", "m=http://b"], "twice")):
        with pytest.raises(ValueError, match=match):
            parse_teacher_urls(bad)


def test_flags_are_checked_before_ray(tmp_path, tiny_hf_checkpoint):
    hooks = load_plugins(["grpo", "opd"])
    hooks.check()
    grpo = {o.name: o.default for o in hooks.slime_options()["grpo"]}

    def validate(**options):
        config = Config.make(plugins=["grpo", "opd"], plugin_values={"grpo": grpo, "opd": DEFAULTS | options})
        hooks.slime_validate_config(config=config)

    validate(opd_teacher=[f"a={tiny_hf_checkpoint}"], opd_teacher_urls=["b=http://127.0.0.1:1"])
    validate(opd_teacher_load=str(tiny_hf_checkpoint))
    in_trainer = {"opd_teacher_load": str(tiny_hf_checkpoint)}
    for options, match in (({}, "needs a teacher"),
                           (in_trainer | {"opd_teacher_urls": ["a=http://h"]}, "^--opd-teacher-load \\(the teacher in "
                            "the trainer\\) and --opd-teacher / --opd-teacher-urls .* exclude each other; keep one$"),
                           (in_trainer | {"opd_teacher": [f"a={tiny_hf_checkpoint}"]}, "exclude each other"),
                           (in_trainer | {"opd_log_prob_top_k": 4}, "^--opd-log-prob-top-k with --opd-teacher-load: "
                            "the trainer's teacher scores the sampled token only"),
                           ({"opd_teacher_load": str(tmp_path)},
                            f"^--opd-teacher-load {tmp_path}: not an HF checkpoint directory"),
                           ({"opd_teacher": [str(tmp_path)]}, "no config.json"),
                           ({"opd_teacher": [f"a={tiny_hf_checkpoint}"], "opd_teacher_urls": ["a=http://h"]},
                            "both --opd-teacher and --opd-teacher-urls"),
                           ({"opd_teacher_urls": ["a=http://h"], "opd_kl_coef": 0.0}, "--opd-kl-coef must be > 0"),
                           ({"opd_teacher_urls": ["a=http://h"], "opd_log_prob_top_k": 4}, "--rollout-engine sglang")):
        with pytest.raises(ConfigError, match=match) as err:
            validate(**options)
        assert "\n" not in str(err.value)


def test_a_trainer_teacher_is_the_trainers_column(tiny_hf_checkpoint):
    """--opd-teacher-load: the actor's trainer is asked to fill teacher_log_probs (slime_scoring_weights); no teacher
    engine is started."""
    hooks = load_plugins(["opd"])
    config = _config(opd_teacher_load=str(tiny_hf_checkpoint))
    assert hooks.slime_scoring_weights(config=config, role="actor") == {"teacher_log_probs": str(tiny_hf_checkpoint)}
    assert hooks.slime_scoring_weights(config=config, role="critic") == {}
    assert hooks.slime_scoring_weights(config=_config(opd_teacher_urls=["a=http://h"]), role="actor") == {}
    assert plugin.teacher_specs(config.plugin("opd")) == ({}, {})  # slime_startup starts no engine


def test_request_bodies_are_sglang_generate_requests():
    if sglang_root() is None:
        pytest.skip("the sglang package is not installed")
    fields = class_fields("srt.managers.io_struct", "GenerateReqInput")
    params = class_fields("srt.sampling.sampling_params", "SamplingParams")
    for body in (score_body([1, 2, 3], 1.0), score_body([1, 2, 3], 0.7, top_k=4),
                 score_body([1, 2, 3], 1.0, top_k=4, token_ids=[5, 9]), score_body([1, 2], 1.0, token_ids=[5])):
        assert set(body) <= set(fields), set(body) - set(fields)
        assert set(body["sampling_params"]) <= set(params)
        assert body["sampling_params"]["max_new_tokens"] == 0 and body["logprob_start_len"] == 0  # prefill scoring
        assert body["return_logprob"] is True
    assert score_body([1], 1.0, top_k=4, token_ids=[5])["top_logprobs_num"] == 4


class _Junk(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"meta_info": {"input_token_logprobs": [[None, 1, None], [0.5, 2, None]]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_teacher_scores_by_prefill_and_a_down_or_junk_teacher_fails_the_sample(tiny_engine, monkeypatch):
    junk = ThreadingHTTPServer(("127.0.0.1", 0), _Junk)
    threading.Thread(target=junk.serve_forever, daemon=True).start()
    teachers = {"good": tiny_engine.url, "down": "http://127.0.0.1:9", "junk": f"http://127.0.0.1:{junk.server_port}"}
    monkeypatch.setattr(plugin, "_teachers", {k: itertools.cycle([v]) for k, v in teachers.items()})
    config = _config(opd_teacher_urls=[f"{k}={v}" for k, v in teachers.items()], opd_teacher_max_retries=0,
                     opd_teacher_timeout=30)

    async def run():
        student = RolloutClient(tiny_engine.url)
        out = await student.generate([5, 6, 7, 8], {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
        samples = []
        for name in teachers:
            s = Sample(index=len(samples), tokens=[5, 6, 7, 8], metadata={"opd_teacher": name})
            s.append_response_tokens(out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]],
                                     finish_reason="length")
            await plugin.score_sample(config, s, student)
            samples.append(s)
        await student.close()
        return samples

    try:
        good, down, bad = asyncio.run(run())
    finally:
        junk.shutdown()
    # the teacher is the student's own model: its prefill log-probs are the ones it sampled with
    _close(good.train_columns["teacher_log_probs"], good.rollout_log_probs)
    assert good.status == Status.TRUNCATED and "opd_error" not in good.metadata
    for sample, why in ((down, "failed after 1 attempts"), (bad, "covers 1 input tokens")):
        assert sample.status == Status.FAILED and sample.remove_sample and sample.reward == 0.0
        assert why in sample.metadata["opd_error"] and "teacher_log_probs" not in sample.train_columns
    metrics = {}
    plugin.slime_log_rollout(config=config, rollout_id=0, samples=[good, down, bad], metrics=metrics)
    assert metrics["rollout/opd_teacher_failures"] == 2.0


def test_a_trained_sample_without_teacher_log_probs_is_an_error_and_a_failed_one_adds_nothing():
    batch = {"response_lengths": [2, 2], "loss_masks": [torch.zeros(2), torch.ones(2)], "sample_indices": [3, 4],
             "log_probs": [torch.zeros(2), torch.zeros(2)], "teacher_log_probs": [None, [-1.0, -2.0]]}
    assert [r.tolist() for r in plugin.reverse_kl_columns(_config(), batch)] == [[0.0, 0.0], [1.0, 2.0]]
    batch["loss_masks"][0] = torch.ones(2)
    with pytest.raises(RuntimeError, match="sample 3 is trained but has no teacher_log_probs"):
        plugin.reverse_kl_columns(_config(), batch)


def test_pure_distillation_zeroes_the_task_reward_only():
    hooks = load_plugins(["grpo", "opd"])
    grpo = {o.name: o.default for o in hooks.slime_options()["grpo"]}
    samples = [Sample(group_index=0, reward=r) for r in (1.0, 0.0)]
    for only, trained in ((False, [0.7071, -0.7071]), (True, [0.0, 0.0])):
        config = Config.make(plugins=["grpo", "opd"], n_samples_per_prompt=2,
                             plugin_values={"grpo": grpo, "opd": DEFAULTS | {"opd_only": only}})
        raw, rewards = hooks.slime_post_process_rewards(config=config, samples=samples)
        assert raw == [1.0, 0.0] and rewards == pytest.approx(trained, abs=1e-4)


def test_strategies_cover_miles():
    assert set(STRATEGIES) == {c["strategy"] for c in VECTORS if c["kind"] == "topk"}


def test_train_columns_become_training_columns():
    from slimecore.rollout.manager import convert_samples

    hooks = load_plugins([])
    samples = [Sample(index=i, tokens=[1, 2, 3], response_length=2, reward=1.0) for i in range(2)]
    samples[0].train_columns["teacher_log_probs"] = [-1.0, -2.0]
    data = convert_samples(hooks, Config.make(), samples)
    assert data["teacher_log_probs"] == [[-1.0, -2.0], None]  # None: the sample the plugin did not score
    samples[1].train_columns["rewards"] = 1.0
    with pytest.raises(ValueError, match="would replace the core's training column 'rewards'"):
        convert_samples(hooks, Config.make(), samples)
