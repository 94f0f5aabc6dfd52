"""search_r1 is installed and discoverable, its hooks fit the specs, and its shipped data is consistent:
every question's golden answer is written in the passage it names, and ``slime-core data`` writes the set out."""

import json

from click.testing import CliRunner

from slime_search_r1.dataset import CORPUS_PATH, QA_PATH, golden_answers, make_prompt
from slime_search_r1.reward import normalize_answer
from slimecore.plugins import installed_entry_points, load_plugins
from slimecore.testing.contract import check_plugin_contract
from slimecore_cli.main import cli

HOOKS = ["slime_data_source", "slime_datasets", "slime_generate", "slime_log_rollout", "slime_options",
         "slime_quickstart_options", "slime_reward", "slime_validate_config"]


def test_discovered_with_its_hooks_and_options():
    assert "search_r1" in installed_entry_points()
    hooks = load_plugins(["search_r1"])
    info = next(p for p in hooks.plugins if p.name == "search_r1")
    assert info.hooks == HOOKS and info.distribution == "slime-core-search-r1"
    assert check_plugin_contract("search_r1") == HOOKS
    options = {o.name: o.default for o in hooks.slime_options()["search_r1"]}
    assert options == {"search_url": None, "search_corpus": None, "search_topk": 3,
                       "search_timeout": 60.0, "search_max_retries": 3, "structure_format_score": 0.2,
                       "final_format_score": 0.1, "retrieval_score": 0.0, "search_prompt": "one_shot"}
    # the plugin answers the one-answer hooks in place of the built-ins
    for hook in ("slime_generate", "slime_reward", "slime_data_source"):
        assert hooks.plugin_name(hooks.answerer(hook)) == "search_r1"


def test_shipped_questions_are_answered_in_the_shipped_corpus():
    corpus = {d["id"]: d["contents"] for d in map(json.loads, CORPUS_PATH.read_text().splitlines())}
    rows = [json.loads(line) for line in QA_PATH.read_text().splitlines()]
    assert len(corpus) == 66 and len(rows) == 95
    assert len({r["metadata"]["question"] for r in rows}) == len(rows)
    for row in rows:
        question, doc = row["metadata"]["question"], corpus[row["metadata"]["doc_id"]]
        assert row["input"] == make_prompt(question)  # Search-R1's prompt, word for word
        answers = golden_answers(row["label"], question)
        assert any(normalize_answer(a) in normalize_answer(doc) for a in answers), question


def test_slime_datasets_and_the_data_command(tmp_path):
    hooks = load_plugins(["search_r1"], defaults=False)
    assert hooks.slime_datasets() == [{"search_r1_qa": str(QA_PATH)}]  # slime_datasets
    out = tmp_path / "qa.jsonl"
    result = CliRunner().invoke(cli, ["data", "--task", "search_r1_qa", "-n", "5", "-o", str(out)])
    assert result.exit_code == 0 and "wrote 5 rows of data set 'search_r1_qa' (plugin 'search_r1')" in result.output
    assert out.read_text().splitlines() == QA_PATH.read_text().splitlines()[:5]
    result = CliRunner().invoke(cli, ["data", "--task", "search_r1_q", "-o", str(out)])
    assert result.exit_code == 2 and "data sets of installed plugins: search_r1_qa" in result.output
