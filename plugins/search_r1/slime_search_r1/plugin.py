"""Search-R1 for slime-core: multi-turn search-tool RL (slime's ``examples/search-r1``).

Hooks:
- ``slime_generate``: up to ``--max-turns`` model turns (default 2, as slime's example), each stopped at
  ``</search>`` or ``</answer>`` (``slimecore.rollout.turns.run_turns``). The turn's first ``<search>..</search>`` or
  ``<answer>..</answer>`` (Search-R1's regex) is the action: a search appends
  ``\\n\\n<information>{docs}</information>\\n\\n`` (loss mask 0, log-prob 0), an answer ends the episode,
  anything else appends Search-R1's fixed "My previous action is invalid..." text. Documents come from a
  Search-R1 retrieval server (``--search-url``) or from BM25 over ``--search-corpus`` (default: the shipped
  corpus); ``--search-topk`` per search.
- ``slime_reward``: Search-R1's EM with format scores (``reward.py``) on the response.
- ``slime_data_source``: ``--prompt-data`` as the built-in does; without it, the shipped QA set with
  ``--search-prompt`` (default: Search-R1's prompt plus one worked episode), and ``slime_quickstart_options``
  sizes such a run for a CPU (plain-text prompts, 64 tokens per turn, groups of 8).
- ``slime_log_rollout``: ``search_r1/*`` metrics (searches and turns per sample, EM, valid format).
- ``slime_validate_config``, ``slime_options``, ``slime_datasets``.

Departures from slime's example, each for a reason given where it is implemented: turns are sent as
token ids, not re-tokenised text (``slimecore.rollout.turns``); no search runs after the last turn (nothing would
read it); ``--rollout-max-context-len``, when set, bounds prompt + response; a failing search server is an
error after retries, not an empty result (``retrieval.py``); the reward reads the model's answer in the
response, not in the prompt or in the invalid-action reply (``reward.py``). Like slime, partial rollout is
not supported (a start-up error).
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

from slimecore import hookimpl
from slimecore.config import ConfigError, Option
from slimecore.data.dataset import read_rows
from slimecore.data.source import PromptDataSource, prompts_from_rows
from slimecore.rollout.turns import parse_tag_call, run_tool, run_turns

from slime_search_r1.dataset import CORPUS_PATH, DATASETS, QA_PATH, golden_answers, make_prompt
from slime_search_r1.retrieval import Bm25Retriever, HttpRetriever, format_passages
from slime_search_r1.reward import compute_score, em_check, extract_answer, is_valid_sequence

log = logging.getLogger("slime_search_r1")
NAME = "search_r1"
STOP = ("</search>", "</answer>")
DEFAULT_MAX_TURNS = 2  # slime's example; --max-turns overrides
INVALID_ACTION = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
                  "</search>. If I want to give the final answer, I should put the answer between <answer> and "
                  "</answer>. Let me try again.\n")
_RETRIEVERS: dict[tuple, object] = {}  # one per process and settings: the BM25 index is built once


@hookimpl
def slime_options():
    return [
        Option("search_url", str, None, "Full URL of a Search-R1 retrieval server endpoint (POST, e.g. "
               "http://127.0.0.1:8000/retrieve). Unset: BM25 over --search-corpus in this process."),
        Option("search_corpus", str, None, "Corpus for the BM25 retriever, Search-R1's format (one "
               "{\"id\", \"contents\": \"\\\"Title\\\"\\ntext\"} per line). Default: the shipped 66-passage corpus."),
        Option("search_topk", int, 3, "Documents returned per search."),
        Option("search_timeout", float, 60.0, "Seconds one request to --search-url may take."),
        Option("search_max_retries", int, 3, "Retries of a failed --search-url request (connection error, timeout, "
               "HTTP 5xx), with exponential backoff from 0.5 s."),
        Option("structure_format_score", float, 0.2, "Search-R1's reward for a well-formed episode with a wrong "
               "answer, and the deduction for a right answer in a malformed one."),
        Option("final_format_score", float, 0.1, "Search-R1's reward for a wrong answer in a malformed episode."),
        Option("retrieval_score", float, 0.0, "Search-R1's bonus for a well-formed, wrong episode whose retrieved "
               "documents contain a golden answer."),
        Option("search_prompt", str, "one_shot", "Prompt of the shipped QA set (no --prompt-data): one_shot = "
               "Search-R1's instruction with one worked search episode before the question (small models follow "
               "the protocol only with an example); search_r1 = Search-R1's prompt word for word.",
               choices=("one_shot", "search_r1")),
    ]


# With the shipped QA set: Search-R1's base template as plain text (no chat template), turns long enough for a
# <think> block and a query, groups of 8 so that a rare success still gives a GRPO signal; sized for a CPU.
QUICKSTART = {"rollout_batch_size": 4, "n_samples_per_prompt": 8, "num_rollout": 12, "rollout_max_response_len": 64,
              "apply_chat_template": False, "lr": 1e-5, "micro_batch_size": 8}


@hookimpl
def slime_quickstart_options():
    return QUICKSTART


@hookimpl
def slime_validate_config(config):
    opts = config.plugin(NAME)
    if config.max_turns is not None and config.max_turns < 1:
        raise ConfigError(f"--max-turns must be >= 1, got {config.max_turns}")
    if opts.search_topk < 1:
        raise ConfigError(f"--search-topk must be >= 1 (plugin search_r1), got {opts.search_topk}")
    if opts.search_timeout <= 0 or opts.search_max_retries < 0:
        raise ConfigError("--search-timeout must be > 0 and --search-max-retries >= 0 (plugin search_r1)")
    if opts.search_url and opts.search_corpus:
        raise ConfigError("--search-url and --search-corpus exclude each other (plugin search_r1): the server "
                          "searches its own corpus; give one")
    if opts.search_url and not opts.search_url.startswith(("http://", "https://")):
        raise ConfigError(f"--search-url {opts.search_url!r} is not an http(s) URL; give the full endpoint, e.g. "
                          "http://127.0.0.1:8000/retrieve")
    if opts.search_corpus and not Path(opts.search_corpus).is_file():
        raise ConfigError(f"--search-corpus {opts.search_corpus}: no such file (plugin search_r1)")
    if config.partial_rollout:
        raise ConfigError("--partial-rollout is not supported by plugin search_r1 (as in slime's example): an "
                          "aborted tool episode cannot be resumed mid-turn; drop the flag")
    if config.prompt_data and not config.label_key:
        raise ConfigError("plugin search_r1 scores answers against the labels of --prompt-data, but --label-key is "
                          "not set; give the key that holds the golden answers (e.g. --label-key label)")


@hookimpl
def slime_datasets():
    return {name: str(path) for name, path in DATASETS.items()}


@hookimpl
def slime_data_source(config, tokenizer, buffer_filter):
    """``--prompt-data`` as the built-in reads it; without it, the shipped QA set (``--task`` is not used)."""
    if config.prompt_data is not None:
        source = PromptDataSource.from_config(config, tokenizer, buffer_filter=buffer_filter)
        where = config.prompt_data
    else:
        rows = read_rows(str(QA_PATH))
        if config.plugin(NAME).search_prompt == "one_shot":
            rows = [(where, {**row, "input": make_prompt(row["metadata"]["question"], one_shot=True)})
                    for where, row in rows]
        records, filtered = prompts_from_rows(config, tokenizer, rows, str(QA_PATH), input_key="input",
                                              label_key="label", apply_chat_template=config.apply_chat_template)

        source = PromptDataSource(records, config.n_samples_per_prompt, shuffle=config.rollout_shuffle,
                                  seed=config.rollout_seed, buffer_filter=buffer_filter,
                                  num_filtered=filtered)
        where = str(QA_PATH)
        log.info("search_r1: no --prompt-data, training on the shipped QA set (%d questions)", len(records))
    for number, record in enumerate(source.records, start=1):
        golden_answers(record["label"], f"{where}, prompt {number}")  # fail at start-up, not as reward failures
    return source


def _retriever(opts):
    key = (opts.search_url, opts.search_corpus, opts.search_timeout, opts.search_max_retries)
    if key not in _RETRIEVERS:
        _RETRIEVERS[key] = (HttpRetriever(opts.search_url, opts.search_timeout, opts.search_max_retries)
                            if opts.search_url else Bm25Retriever.from_jsonl(opts.search_corpus or CORPUS_PATH))
    return _RETRIEVERS[key]


@hookimpl
async def slime_generate(config, sample, sampling_params, client):
    opts = config.plugin(NAME)
    retriever = _retriever(opts)
    stats = sample.metadata["search_r1"] = {"searches": 0, "invalid_actions": 0}

    async def act(text: str, turn: int) -> str | None:
        call = parse_tag_call(text, ("search", "answer"))
        if call is None:
            stats["invalid_actions"] += 1
            return INVALID_ACTION
        if call.name == "answer":
            return None
        stats["searches"] += 1
        docs = await run_tool(retriever.search, call.content, opts.search_topk)
        return f"\n\n<information>{format_passages(docs).strip()}</information>\n\n"

    budget = None if config.rollout_max_context_len is None else config.rollout_max_context_len - sample.prompt_length
    return await run_turns(sample, client, sampling_params, act, max_turns=config.max_turns or DEFAULT_MAX_TURNS,
                           stop=STOP, max_response_len=budget)


@hookimpl
async def slime_reward(config, sample):
    opts = config.plugin(NAME)
    golden = golden_answers(sample.label, f"sample {sample.index}")
    answer = extract_answer(sample.response.replace(INVALID_ACTION, ""))
    stats = sample.metadata.setdefault("search_r1", {})
    stats["em"] = float(answer is not None and em_check(answer, golden))
    stats["valid_format"] = float(is_valid_sequence(sample.response)[0])
    return compute_score(sample.response, golden, opts.structure_format_score, opts.final_format_score,
                         opts.retrieval_score, not_answers=(INVALID_ACTION,))


@hookimpl
def slime_log_rollout(samples, metrics):
    stats = [s.metadata.get("search_r1", {}) for s in samples]
    for key, name in (("searches", "searches_per_sample"), ("invalid_actions", "invalid_actions_per_sample"),
                      ("em", "em"), ("valid_format", "valid_format")):
        values = [st[key] for st in stats if key in st]
        if values:
            metrics[f"search_r1/{name}"] = statistics.fmean(values)
    turns = [s.metadata["turns"] for s in samples if "turns" in s.metadata]
    if turns:
        metrics["search_r1/turns_per_sample"] = statistics.fmean(turns)
