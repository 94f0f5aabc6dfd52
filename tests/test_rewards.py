"""The reward hub (``--rm-type``): math equivalence on a table checked against math-verify, each rule-based
type, the boxed_ prefix and per-sample rm_type, remote_rm against a real local HTTP server, start-up errors,
and rewards through the built-in rollout (dict reward with --reward-key, a failing group reward)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time

import pytest
from aiohttp import web

from slimecore import hookimpl
from slimecore.config import Config, ConfigError
from slimecore.data.source import PromptDataSource, load_prompts
from slimecore.hf_checkpoint import load_tokenizer
from slimecore.plugins import HookCallError, load_plugins
from slimecore.rewards import math as math_rewards
from slimecore.rewards.dapo import dapo_reward
from slimecore.rewards.deepscaler import deepscaler_reward
from slimecore.rewards.f1 import f1_reward
from slimecore.rewards.gpqa import gpqa_reward
from slimecore.rewards.math import answers_match, math_reward
from slimecore.rewards.remote import RemoteRewardError, close_session
from slimecore.rewards.sympy_judge import JUDGE, is_safe
from slimecore.rollout.client import RolloutClient
from slimecore.rollout.hook_args import SampleHooks
from slimecore.rollout.manager import convert_samples
from slimecore.types import Sample, Status
from slimecore.testing import timeout as scaled

# (gold, given, equivalent?) -- every verdict is also math-verify's (checked below when it is installed).
# Where slime's grader differs: it rejects 2/4 for 1/2 and 6/2 for 3, and strips % (50\% != 0.5).
MATH_TABLE = [
    # integers, decimals, powers
    ("3", "3", True), ("3", "3.0", True), ("3", "6/2", True), ("3", "4", False), ("-7", "-7", True),
    ("-3", "\u22123", True), ("0", "-0", True), ("20", "20.00", True), ("12", "12.0001", False),
    ("12", "11.9999999", False), ("1000000", "10^6", True), ("1000", "10^{3}", True), ("1024", "2^{10}", True),
    ("2^{-1}", "\\frac{1}{2}", True), ("-2", "- 2", True), ("4", "four", False), ("3!", "6", True),
    # fractions
    ("1/2", "0.5", True), ("\\frac{1}{2}", "2/4", True), ("\\dfrac{3}{4}", "0.75", True), ("\\tfrac34", "3/4", True),
    ("\\frac34", "0.75", True), ("\\frac{1}{2}", "\\frac12", True), ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{-1}{2}", "-1/2", True), ("\\frac{1}{3}", "0.333", False), ("1\\frac{1}{2}", "3/2", True),
    ("1\\frac{1}{2}", "\\frac{3}{2}", True), (".5", "0.5", True), ("\\frac{2}{3}", "\\frac{3}{2}", False),
    ("\\frac{9}{4}", "2.25", True), ("1.25", "\\frac{5}{4}", True), ("\\frac{5}{12}", "5/12", True),
    # boxed and math delimiters
    ("\\boxed{5}", "5", True), ("$5$", "5", True), ("\\boxed{\\frac{1}{2}}", "0.5", True),
    # units, degrees, percentages, money
    ("5 \\text{ cm}", "5", True), ("5\\text{ cm}", "5", True), ("5 cm", "5", True), ("6", "6 \\text{ inches}", True),
    ("10", "10 \\mbox{ cm}^2", True), ("12", "12 square feet", True), ("3", "3 \\text{ apples}", True),
    ("90^\\circ", "90", True), ("90^{\\circ}", "90", True), ("\\$5", "5", True), ("5 \\text{ dollars}", "5", True),
    ("1000.5", "\\$1,000.50", True), ("50\\%", "50", True), ("50\\%", "0.5", True), ("50", "50\\%", True),
    ("10\\%", "0.1", True), ("\\dfrac{1}{4}", "25\\%", True), ("50\\%", "5", False),
    # thousands separators
    ("1,000", "1000", True), ("1{,}000", "1000", True), ("1,000,000", "1000000", True), ("100", "1,00", False),
    # radicals, pi, expressions
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True), ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}", True),
    ("2\\sqrt{3}", "\\sqrt{12}", True), ("\\sqrt{18}", "3\\sqrt{2}", True), ("4\\sqrt{3}", "\\sqrt{48}", True),
    ("2", "\\sqrt[3]{8}", True), ("\\frac{1}{\\sqrt{3}}", "\\frac{\\sqrt{3}}{3}", True),
    ("1+\\sqrt{2}", "\\sqrt{2}+1", True),
    ("\\sqrt{3}", "3", False), ("5\\sqrt{2}", "7.07", False), ("\\pi", "3.14", False), ("2\\pi", "\\pi \\cdot 2", True),
    ("\\frac{\\pi}{4}", "\\pi/4", True), ("3\\pi", "3 \\pi", True), ("360", "2\\pi", False),
    ("x^2+2x+1", "(x+1)^2", True), ("x^2+2x+1", "(x-1)^2", False), ("x^2-1", "(x-1)(x+1)", True),
    ("x^{2}", "x^2", True), ("\\frac{x}{y}", "x/y", True), ("\\frac{a}{b}", "\\frac{b}{a}", False),
    ("a+b", "b+a", True),
    ("2x+3", "3+2x", True), ("\\frac{x}{2}", "\\frac{1}{2}x", True), ("e^2", "e^{2}", True),
    ("\\sin^2 x + \\cos^2 x", "1", True), ("\\binom{5}{2}", "10", True),
    # equations
    ("x=3", "3", True), ("3", "x=3", True), ("y = 2x + 1", "2x+1", True), ("y=x^2", "x^2", True),
    ("f(x) = 2x", "2x", True), ("k=4", "5", False),
    # intervals, tuples, sets
    ("(1,2]", "(1,2]", True), ("(1,2]", "(1,2)", False), ("[0, 1]", "[0,1)", False), ("(1,2)", "(2,1)", False),
    ("[2,5)", "\\left[ 2, 5 \\right)", True), ("(-\\infty, 2)", "(-\\infty,2)", True),
    ("(0, \\infty)", "(0,\\infty)", True),
    ("(-\\infty, 2) \\cup (3, \\infty)", "(3,\\infty)\\cup(-\\infty,2)", True),
    ("\\left( 1, 2 \\right)", "(1,2)", True),
    ("(1,2,3)", "(1, 2, 3)", True), ("(\\frac{1}{2}, 3)", "(0.5, 3)", True), ("\\{1,2\\}", "\\{2,1\\}", True),
    ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}", True), ("1,2", "2,1", True), ("2, 3", "x = 2, 3", True),
    ("\\emptyset", "\\{\\}", True),
    # text and multiple choice
    ("\\text{east}", "east", True), ("\\text{Monday}", "monday", True), ("\\text{east}", "west", False),
    ("\\text{(A)}", "A", True), ("B", "(B)", True), ("\\text{B}", "B", True), ("C", "\\textbf{C}", True),
    ("A", "B", False), ("5.", "5", True),
    # near misses
    ("\\frac{1}{2}", "\\frac{1}{3}", False), ("(1,2)", "(1,2,3)", False), ("x+1", "x-1", False),
    ("10\\%", "10.1", False),
    ("1,000", "100", False), ("-5", "5", False), ("2\\pi", "\\pi", False), ("\\{1,2\\}", "\\{1,3\\}", False),
    ("[0,1]", "(0,1)", False), ("2x", "x^2", False), ("\\sqrt{2}", "1.414", False),
    ("(-\\infty, 2)", "(-\\infty, 3)", False),
    ("1,2", "1,2,3", False), ("x=3", "x=4", False),
]


def test_the_table_is_big_and_has_both_verdicts():
    assert len(MATH_TABLE) >= 50
    assert sum(v for *_, v in MATH_TABLE) >= 90 and sum(not v for *_, v in MATH_TABLE) >= 30


@pytest.mark.parametrize("gold, given, expected", MATH_TABLE, ids=[f"{g} ~ {a}" for g, a, _ in MATH_TABLE])
def test_math_equivalence_table(gold, given, expected):
    assert answers_match(given, gold) is expected
    # the same through the reward: the response's last \boxed{} against the label
    assert math_reward(f"We compute. Hence \\boxed{{{given}}}.", gold) == float(expected)


def test_math_table_agrees_with_math_verify():
    math_verify = pytest.importorskip("math_verify")
    disagree = [(gold, given, expected) for gold, given, expected in MATH_TABLE
                if math_verify.verify(math_verify.parse(f"${gold}$"), math_verify.parse(f"${given}$")) is not expected]
    assert not disagree


def test_math_reward_reads_the_last_box_of_the_response_and_the_label():
    assert math_reward("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("first \\boxed{0.5} then \\boxed{1}", "0.5") == 0.0  # the last box counts
    assert math_reward("the answer is 0.5", "0.5") == 0.0  # no box: 0, as slime
    assert math_reward("\\fbox{7}", "7") == 1.0 and math_reward("\\boxed {7}", "7") == 1.0
    assert math_reward("\\boxed{\\frac{\\sqrt{3}}{2}}", "The answer is $\\boxed{\\frac{\\sqrt3}{2}}$") == 1.0
    assert math_reward("\\boxed{3}", ["4", "3"]) == 1.0  # any of a list label
    assert math_reward("\\boxed{3}", "") == 0.0 and math_reward("\\boxed{3}", None) == 0.0
    assert math_reward("\\boxed{3", "3") == 0.0  # unclosed box


def test_sympy_has_a_hard_time_limit():
    assert answers_match("x(x+1)", "x^2+x")  # warm a worker, so the timing below is the comparison alone
    timeouts = JUDGE.timeouts
    for pathological in ("(\\sin x)^{30}(\\cos x)^{30}", "9^{9^{9^{9}}}"):  # minutes of simplify; a huge power
        start = time.monotonic()
        assert not answers_match(pathological, "1", time_limit=1.0)
        assert time.monotonic() - start < 3.0, pathological
    assert JUDGE.timeouts == timeouts + 2
    assert answers_match("\\frac{\\pi}{4}", "\\pi/4")  # a fresh worker replaces the killed one


def test_the_time_limit_covers_the_whole_answer(monkeypatch):
    monkeypatch.setattr(math_rewards, "SYMPY_TIME_LIMIT", 1.0)
    slow = "(\\sin x)^{30}(\\cos x)^{30}"
    start = time.monotonic()
    assert math_reward(f"\\boxed{{({slow}, {slow}, {slow})}}", "(1, 1, 1)") == 0.0
    assert time.monotonic() - start < 3.0


def test_answers_are_never_evaluated_as_python(tmp_path):
    marker = tmp_path / "owned"
    attack = f"__import__('os').system('touch {marker}')"
    assert not is_safe(attack) and not is_safe("(1).real") and not is_safe("east")
    assert math_reward(f"\\boxed{{{attack}}}", "0") == 0.0
    assert not marker.exists()


def test_deepscaler_reads_after_the_reasoning():
    assert deepscaler_reward("<think>maybe \\boxed{3}</think> so \\boxed{4}", "4") == 1.0
    assert deepscaler_reward("<think>\\boxed{4}</think> I am not sure", "4") == 0.0  # no box after </think>
    assert deepscaler_reward("###Response: it is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert deepscaler_reward("\\boxed{4}", "4") == 0.0  # neither </think> nor ###Response
    assert deepscaler_reward("</think>\\boxed{4}", "") == 0.0
    assert deepscaler_reward("</think>\\boxed{4}", "\\boxed{4}") == 1.0


def test_dapo_returns_a_dict_with_minus_one_for_wrong():
    assert dapo_reward("Let me think... Answer: 42", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert dapo_reward("Answer: 41\n", "42") == {"score": -1.0, "acc": False, "pred": "41"}
    assert dapo_reward("Answer: 1\nanswer: $\\boxed{1,000}$ dollars", "1000") == {"score": 1.0, "acc": True,
                                                                                  "pred": "1000"}
    assert dapo_reward("no final line", "42") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert dapo_reward("Answer: 42" + " filler" * 50, "42")["pred"] == "[INVALID]"  # only the last 300 chars
    assert dapo_reward("Answer: x = 7", "7.0")["acc"]  # what follows the last "=", the label as an integer
    assert dapo_reward("Answer: \\frac{1}{2}", "\\frac{1}{2}")["acc"]  # a non-integer label compares as text


def test_f1_is_token_overlap():
    assert f1_reward("The cat sat on the mat.", "a cat sat") == pytest.approx(2 / 3)  # p = 2/4, r = 2/2
    assert f1_reward("Paris", "paris!") == 1.0 and f1_reward("London", "Paris") == 0.0
    assert f1_reward("yes it is", "yes") == 0.0 and f1_reward("No.", "no") == 1.0
    assert f1_reward(None, "x") == 0.0


def test_gpqa_finds_the_chosen_letter():
    meta = {"choices": ["red", "green", "blue", "black"]}
    assert gpqa_reward("<think>A? no.</think> The answer is (C).", "C", meta) == 1.0
    assert gpqa_reward("The answer is (C).", "B", meta) == 0.0
    assert gpqa_reward("Final answer: B", 1, meta) == 1.0  # label as a 0-based index
    assert gpqa_reward("B is correct", "green", meta) == 1.0  # label as a choice's text
    assert gpqa_reward("It must be green.", "green", meta) == 1.0  # no letter: the correct choice's text
    assert gpqa_reward("The answer is definitely C", "C", meta) == 1.0  # slime reads the "d" of "definitely"
    assert gpqa_reward("answer: D", "A", {"correct_letter": "D"}) == 1.0
    assert gpqa_reward("The answer is E", "A", meta) == 0.0  # only A-D exist
    assert gpqa_reward("I considered everything.", "red", meta) == 0.0  # slime finds "red" in "considered"
    assert gpqa_reward("The answer is E", "E", {"valid_letters": ["A", "E"]}) == 1.0


# ---------------------------------------------------------------------------------------------
# Dispatch: per-sample rm_type, boxed_, errors, group reward
# ---------------------------------------------------------------------------------------------

HOOKS = load_plugins([])


def _reward(sample, **options):
    return asyncio.run(HOOKS.slime_reward(config=Config.make(**options), sample=sample))


def test_the_samples_rm_type_wins_and_boxed_cuts_the_response_first():
    assert _reward(Sample(response="\\boxed{0.5}", label="1/2", metadata={"rm_type": "math"}), rm_type="f1") == 1.0
    assert _reward(Sample(response="\\boxed{0.5}", label="1/2"), rm_type="f1") == 0.0
    # boxed_f1 scores only the box, so the words around it do not dilute the F1
    assert _reward(Sample(response="I think \\boxed{Paris France}", label="Paris France"), rm_type="boxed_f1") == 1.0
    assert _reward(Sample(response="I think \\boxed{Paris France}", label="Paris France"), rm_type="f1") < 1.0
    assert _reward(Sample(response="Nothing boxed, C", label="C"), rm_type="boxed_gpqa") == 0.0
    assert _reward(Sample(response="so \\boxed{C}", label="C"), rm_type="boxed_gpqa") == 1.0
    assert _reward(Sample(response="17, \\boxed{12}", label="12", metadata={"rm_type": "boxed_compare"})) == 1.0
    assert _reward(Sample(response="Answer: 3", label="3"), rm_type="dapo", reward_key="score")["score"] == 1.0
    assert _reward(Sample(response="x"), rm_type="random") in (0.0, 1.0)


def test_bad_reward_types_say_what_to_do():
    with pytest.raises(HookCallError, match="no built-in reward 'mathh' \\(--rm-type\\); did you mean 'math'"):
        _reward(Sample(response="\\boxed{1}", label="1"), rm_type="mathh")
    with pytest.raises(HookCallError, match="sample 5's metadata rm_type.*use 'math'"):
        _reward(Sample(index=5, response="\\boxed{1}", label="1", metadata={"rm_type": "boxed_math"}))
    with pytest.raises(HookCallError, match="--rm-url is not set"):
        _reward(Sample(response="x", metadata={"rm_type": "remote_rm"}))


@pytest.mark.parametrize("options, message", [
    (dict(rm_type="mathh"), "did you mean 'math'"),
    (dict(rm_type="boxed_dapo", reward_key="score"), "dapo reads its answer from the whole response"),
    (dict(rm_type="remote_rm"), "--rm-type remote_rm needs --rm-url"),
    (dict(rm_type="dapo"), "add --reward-key score"),
    (dict(rm_max_retries=0), "--rm-max-retries must be at least 1"),
    (dict(rm_timeout=0.0), "--rm-timeout must be > 0"),
])
def test_config_errors_at_start_up(options, message):
    with pytest.raises(ConfigError, match=message):
        HOOKS.slime_validate_config(config=Config.make(**options))


def test_valid_configs_pass_start_up():
    for options in (dict(), dict(rm_type="math"), dict(rm_type="boxed_f1"), dict(rm_type="dapo", reward_key="score"),
                    dict(rm_type="remote_rm", rm_url="http://127.0.0.1:1/score")):
        HOOKS.slime_validate_config(config=Config.make(**options))


def test_default_group_reward_scores_each_sample_by_its_type():
    samples = [Sample(response="\\boxed{2/4}", label="0.5", metadata={"rm_type": "math"}),
               Sample(response="Answer: 7", label="7", metadata={"rm_type": "dapo"}),
               Sample(response="cat", label="the cat", metadata={"rm_type": "f1"})]
    rewards = asyncio.run(HOOKS.slime_group_reward(config=Config.make(group_rm=True), samples=samples))
    assert rewards == [1.0, {"score": 1.0, "acc": True, "pred": "7"}, 1.0]


# ---------------------------------------------------------------------------------------------
# remote_rm against a real HTTP server on 127.0.0.1
# ---------------------------------------------------------------------------------------------

class RewardService:
    """An aiohttp app answering POST /score by a script of (status, body, delay) per request."""

    def __init__(self, script):
        self.script, self.requests = list(script), []

    async def handle(self, request):
        self.requests.append(await request.json())
        status, body, delay = self.script[min(len(self.requests), len(self.script)) - 1]
        await asyncio.sleep(delay)
        return web.Response(status=status, text=body if isinstance(body, str) else json.dumps(body),
                            content_type="application/json")


def _remote(script, sample, **options):
    """(reward or the raised exception, requests the service saw, seconds taken)."""
    service = RewardService(script)

    async def go():
        app = web.Application()
        app.router.add_post("/score", service.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        config = Config.make(**{"rm_type": "remote_rm", "rm_url": f"http://127.0.0.1:{port}/score",
                                "rm_retry_delay": 0.01, **options})
        start = time.monotonic()
        try:
            return await HOOKS.slime_reward(config=config, sample=sample), time.monotonic() - start
        except HookCallError as exc:
            return exc, time.monotonic() - start
        finally:
            await close_session()
            await runner.cleanup()

    result, seconds = asyncio.run(go())
    return result, service.requests, seconds


def _sample(**kw):
    return Sample(prompt=[{"role": "user", "content": "2+2?"}], response="4", label="4", **kw)


def test_remote_rm_posts_the_sample_and_returns_the_answer():
    reward, requests, _ = _remote([(200, 0.75, 0)], _sample())
    assert reward == 0.75
    assert requests == [{"prompt": [{"role": "user", "content": "2+2?"}], "response": "4", "label": "4"}]
    boxed = _sample(metadata={"rm_type": "boxed_remote_rm"})
    reward, requests, _ = _remote([(200, {"score": 1, "why": "ok"}, 0)], boxed)
    assert reward == {"score": 1, "why": "ok"} and requests[0]["response"] == ""  # boxed_: no box, empty response


def test_remote_rm_retries_a_server_error():
    reward, requests, _ = _remote([(500, "overloaded", 0), (200, 1.0, 0)], _sample(), rm_max_retries=3)
    assert reward == 1.0 and len(requests) == 2


def test_remote_rm_times_out_each_request():
    error, requests, seconds = _remote([(200, 1.0, 3.0)], _sample(), rm_timeout=0.3, rm_max_retries=2)
    assert isinstance(error.original, RemoteRewardError) and len(requests) == 2 and seconds < 2.5
    assert "failed after 2 attempt(s)" in str(error) and "no answer within --rm-timeout 0.3s" in str(error)


def test_remote_rm_final_failure_names_url_status_and_attempts(caplog):
    error, requests, _ = _remote([(503, "down for maintenance\n<html>" + "x" * 500, 0)], _sample(), rm_max_retries=3)
    assert len(requests) == 3
    message = str(error)
    assert "remote_rm: POST http://127.0.0.1:" in message and "/score failed after 3 attempt(s)" in message
    assert "HTTP 503: down for maintenance" in message
    url = message.split("POST ")[1].split(" failed")[0]
    said = [r.getMessage() for r in caplog.records if r.name == "slimecore.rewards"]
    assert len(said) == 1 and "\n" not in said[0]  # one line, at the first failed attempt, not one per retry
    assert said[0].startswith(f"remote_rm: POST {url} -> HTTP 503: 'down for maintenance <html>xxx")
    assert "x" * 121 not in said[0]  # the answer's first bytes only
    assert "retrying 2 more time(s) with backoff (about 0 s: --rm-max-retries 3, --rm-retry-delay 0.01)" in said[0]


def test_remote_rm_does_not_retry_what_retrying_cannot_fix():
    error, requests, _ = _remote([(400, "missing field", 0)], _sample(), rm_max_retries=5)
    assert len(requests) == 1 and "HTTP 400: missing field (not retried" in str(error)
    error, requests, _ = _remote([(200, "<html>", 0)], _sample(), rm_max_retries=5)
    assert len(requests) == 1 and "not JSON" in str(error)
    error, _, _ = _remote([(200, ["a", "list"], 0)], _sample())
    assert "must be a JSON number or object" in str(error)


# ---------------------------------------------------------------------------------------------
# Through the built-in rollout, against real engines behind the real router
# ---------------------------------------------------------------------------------------------

class WritesAnAnswer:
    """Stands in for a model that has learnt the answer format: even samples answer 42, odd ones 41."""

    @hookimpl
    def slime_process_sample(self, config, sample):
        sample.response = f"{sample.response} ... Answer: {42 if sample.index % 2 == 0 else 41}"


def _rollout(hooks, config, tokenizer, router):
    source = PromptDataSource(load_prompts(config, tokenizer, config.prompt_data)[0], config.n_samples_per_prompt)
    client = RolloutClient(router.url)

    async def go():
        try:
            return await hooks.slime_rollout(config=config, rollout_id=0, data_source=source, client=client,
                                             sample_hooks=SampleHooks(hooks), evaluation=False)
        finally:
            await client.close()
            await close_session()

    return asyncio.run(go())


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"What is 6 times 7? ({i})", "label": "42"}) + "\n" for i in range(4)))
    return str(path)


def _config(prompt_file, **kw):
    return Config.make(**{"prompt_data": prompt_file, "label_key": "label", "rollout_batch_size": 2,
                          "n_samples_per_prompt": 2, "rollout_max_response_len": 4, **kw})


def test_dapo_dict_reward_trains_on_the_reward_key(engines, tiny_checkpoint, prompt_file):
    _, router = engines
    config = _config(prompt_file, rm_type="dapo", reward_key="score")
    hooks = load_plugins([], extra=[WritesAnAnswer()])
    hooks.slime_validate_config(config=config)
    out = _rollout(hooks, config, load_tokenizer(tiny_checkpoint), router)
    samples = [s for group in out.samples for s in group]
    assert len(samples) == 4 and out.metrics["rollout/reward_failures"] == 0
    assert all(s.reward == {"score": 1.0 if s.index % 2 == 0 else -1.0, "acc": s.index % 2 == 0,
                            "pred": "42" if s.index % 2 == 0 else "41"} for s in samples)
    data = convert_samples(hooks, config, samples)
    assert data["raw_rewards"] == [1.0 if s.index % 2 == 0 else -1.0 for s in samples]


def test_a_failing_group_reward_marks_its_samples_and_is_counted(engines, tiny_checkpoint, prompt_file):
    _, router = engines
    # nothing listens on port 9 of 127.0.0.1: every remote_rm request is refused
    config = _config(prompt_file, rm_type="remote_rm", rm_url="http://127.0.0.1:9/score", rm_max_retries=2,
                     rm_retry_delay=0.01, group_rm=True)
    hooks = load_plugins([])
    out = _rollout(hooks, config, load_tokenizer(tiny_checkpoint), router)
    samples = [s for group in out.samples for s in group]
    assert out.metrics["rollout/reward_failures"] == 4
    assert all(s.status is Status.FAILED and s.remove_sample for s in samples)
    assert all("127.0.0.1:9/score failed after 2 attempt(s)" in s.metadata["reward_error"] for s in samples)
    data = convert_samples(hooks, config, samples)
    assert all(sum(mask) == 0 for mask in data["loss_masks"]) and not any(math.isnan(r) for r in data["rewards"])


# ---------------------------------------------------------------------------------------------
# Through the CLI: flags, start-up checks, and the sympy worker started inside the rollout's Ray actor
# ---------------------------------------------------------------------------------------------

ANSWER_PLUGIN = '''
from slimecore import hookimpl


@hookimpl
def slime_process_sample(config, sample):
    # even samples answer with an equivalent radical that only sympy can match, odd ones are wrong
    sample.response += "\\\\boxed{\\\\frac{\\\\sqrt2}{2}}" if sample.index % 2 == 0 else "\\\\boxed{2}"
'''


def _cli(*args: str, timeout: float = scaled(300)) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slimecore_cli", "train", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_rejects_a_bad_rm_type_before_ray():
    proc = _cli("--plugin", "grpo", "--rollout-batch-size", "2", "--rm-type", "mathh", timeout=scaled(120))
    assert proc.returncode == 2 and "did you mean 'math'" in " ".join(proc.stderr.split()), proc.stderr[-3000:]
    assert "Started a local Ray instance" not in proc.stderr


def test_cli_math_reward_in_the_rollout_actor(tiny_checkpoint, tmp_path):
    pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"Simplify 1/sqrt(2) ({i})", "label": "\\frac{1}{\\sqrt{2}}"})
                               + "\n" for i in range(4)))
    plugin = tmp_path / "answers.py"
    plugin.write_text(ANSWER_PLUGIN)
    log_dir = tmp_path / "run"
    proc = _cli("--plugin", "grpo", "--plugin", str(plugin), "--hf-checkpoint", str(tiny_checkpoint),
                "--prompt-data", str(prompts), "--label-key", "label", "--rm-type", "math",
                "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                "--num-rollout", "1", "--debug-rollout-only", "--log-dir", str(log_dir), "--no-use-tensorboard")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (step,) = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert step["rollout/raw_reward"] == 0.5 and step["rollout/reward_failures"] == 0
