"""Search-R1's EM reward with format scores, by hand (verl/utils/reward_score/qa_em_format.py), through the hook."""

import asyncio

import pytest

from slime_search_r1.dataset import golden_answers, make_prompt
from slime_search_r1.plugin import INVALID_ACTION
from slime_search_r1.reward import (compute_score, em_check, extract_answer, is_valid_sequence, normalize_answer,
                                    retrieval_correct)
from slimecore.config import Config
from slimecore.plugins import HookCallError, load_plugins
from slimecore.types import Sample

SEARCH = "<think> I need the city </think>\n<search> capital of France </search>\n\n"
INFO = "<information>Doc 1(Title: \"Paris\") Paris is the capital of France.\n</information>\n\n"
GOOD = SEARCH + INFO + "<think> it is Paris </think>\n<answer> Paris </answer>"


def test_normalisation_is_squad_style():
    assert normalize_answer("  The Eiffel-Tower! ") == "eiffeltower"  # lower, punctuation out, article out
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("Theatre of the Absurd") == "theatre of absurd"  # only whole-word articles
    assert em_check("Paris.", ["paris"]) and em_check("the Seine", ["Seine", "x"])
    assert not em_check("Paris France", ["Paris"]) and not em_check("", ["Paris"])


def test_valid_sequence_follows_think_search_information_think_answer():
    assert is_valid_sequence(GOOD) == (True, "valid")
    assert is_valid_sequence("<think>x</think><answer>y</answer>")[0]  # answering without a search is fine
    cases = {
        "<answer>Paris</answer>": "unexpected <answer> in state start",  # no <think> first
        "<think>x</think> so <answer>y</answer>": "outside a tag",
        "<think>x</think><answer>y": "1 <answer> but 0 </answer>",
        SEARCH + INFO: "ends in state information",  # stopped after a search
        SEARCH + INFO + "<answer>Paris</answer>": "unexpected <answer> in state information",  # must think again
        GOOD + " done": "outside a tag",
    }
    for text, reason in cases.items():
        valid, why = is_valid_sequence(text)
        assert not valid and reason in why, (text, why)


def test_score_branches_by_hand():
    kw = dict(structure_format_score=0.2, final_format_score=0.1, retrieval_score=0.1)
    assert compute_score(GOOD, ["Paris"], **kw) == 1.0  # EM, valid format
    assert compute_score("<answer>Paris</answer>", ["Paris"], **kw) == pytest.approx(0.8)  # EM, malformed
    wrong = GOOD.replace("<answer> Paris", "<answer> Lyon")
    assert compute_score(wrong, ["Paris"], **kw) == pytest.approx(0.3)  # valid, wrong, gold in the documents
    assert compute_score(wrong, ["Marseille"], **kw) == pytest.approx(0.2)  # valid, wrong, gold not retrieved
    assert compute_score("<answer>Lyon</answer>", ["Paris"], **kw) == pytest.approx(0.1)  # malformed, wrong
    assert compute_score(SEARCH + INFO, ["Paris"], **kw) == 0.0  # no answer at all
    assert compute_score("<answer>Lyon</answer> <answer>Paris</answer>", ["Paris"], **kw) == pytest.approx(0.8)
    assert compute_score(GOOD, ["Paris"]) == 1.0 and compute_score(wrong, ["Paris"]) == 0.0  # slime's effective EM
    assert retrieval_correct(GOOD, ["paris"]) and not retrieval_correct("<answer>Paris</answer>", ["Paris"])


def test_the_response_is_scored_not_the_prompt():
    """Search-R1 scores prompt + response and skips one <answer> block, but its prompt has two, so an unanswered
    response would be graded as answering "Beijing". Scoring the response avoids that."""
    prompt = make_prompt("Which city is the capital of China")
    assert prompt.endswith("Question: Which city is the capital of China?\n")
    assert extract_answer(prompt + SEARCH) == "Beijing"  # what Search-R1 would grade
    assert extract_answer(SEARCH) is None and compute_score(SEARCH, ["Beijing"], 0.2, 0.1) == 0.0


def test_the_invalid_action_reply_is_not_an_answer():
    """Search-R1's reply to an invalid action says "between <answer> and </answer>", which its extraction reads
    as the answer "and": an invalid action would earn final_format_score where no answer earns 0."""
    response = "I think it is Paris.<|im_end|>" + INVALID_ACTION + "Paris, surely."
    assert extract_answer(response) == "and"
    assert compute_score(response, ["Paris"], 0.2, 0.1) == pytest.approx(0.1)  # Search-R1's value
    assert compute_score(response, ["Paris"], 0.2, 0.1, not_answers=(INVALID_ACTION,)) == 0.0
    fixed = response + "<answer> Paris </answer>"  # the model's own answer still counts, in a malformed episode
    assert compute_score(fixed, ["Paris"], 0.2, 0.1, not_answers=(INVALID_ACTION,)) == pytest.approx(0.8)
    hooks, config = _config()
    sample = Sample(index=0, response=response, label="Paris")
    assert asyncio.run(hooks.slime_reward(config=config, sample=sample)) == 0.0
    assert sample.metadata["search_r1"]["em"] == 0.0


def test_golden_answers_accept_search_r1_and_slime_labels():
    assert golden_answers("Paris", "x") == ["Paris"]
    assert golden_answers(["Paris", "City of Light"], "x") == ["Paris", "City of Light"]
    assert golden_answers({"target": ["Paris"]}, "x") == ["Paris"]  # Search-R1's ground_truth
    assert golden_answers({"ground_truth": {"target": ["Paris"]}}, "x") == ["Paris"]  # slime's label
    with pytest.raises(ValueError, match=r"qa.jsonl, prompt 3: it has no label: with --prompt-data, set --label-key"):
        golden_answers(None, "qa.jsonl, prompt 3")
    with pytest.raises(ValueError, match=r"sample 4: its label \{'answer': 1\} holds no golden answer"):
        golden_answers({"answer": 1}, "sample 4")
    with pytest.raises(ValueError, match="holds no golden answer"):
        golden_answers([], "sample 4")


def _config(**values):
    hooks = load_plugins(["search_r1"])
    defaults = {o.name: o.default for o in hooks.slime_options()["search_r1"]}
    return hooks, Config.make(plugins=["search_r1"], plugin_values={"search_r1": defaults | values})


def test_reward_hook_scores_the_response_and_records_em():
    hooks, config = _config()
    sample = Sample(index=0, prompt=make_prompt("What is the capital of France"), response=GOOD,
                    label={"target": ["Paris"]})
    assert asyncio.run(hooks.slime_reward(config=config, sample=sample)) == 1.0
    assert sample.metadata["search_r1"] == {"em": 1.0, "valid_format": 1.0}
    sample.response = "<answer>Lyon</answer>"
    assert asyncio.run(hooks.slime_reward(config=config, sample=sample)) == pytest.approx(0.1)  # --final-format-score
    hooks, config = _config(final_format_score=0.0, structure_format_score=0.0)
    assert asyncio.run(hooks.slime_reward(config=config, sample=sample)) == 0.0
    sample.label = None
    with pytest.raises(HookCallError, match="plugin 'search_r1' raised in slime_reward: .*sample 0: it has no label"):
        asyncio.run(hooks.slime_reward(config=config, sample=sample))
