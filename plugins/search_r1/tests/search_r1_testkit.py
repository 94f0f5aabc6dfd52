"""Test data for the search_r1 tests: a small corpus and QA set short enough for the tiny model's 512
positions, and a tiny model taught to act in the Search-R1 format (so that searches really happen).

The tiny model is random, so it never writes ``<search>``. ``taught_checkpoint`` fine-tunes it (150 Adam
steps, a few seconds) on whole episodes (prompt, ``<think>..</think><search> query </search>``, the real BM25
observation, then ``<think>..</think><answer> city </answer>``; one episode starts with an invalid action
instead), with the loss on the model's turns only, until it reproduces them. The episodes are built exactly as ``slimecore.rollout.turns.run_turns`` builds samples (each segment tokenised
on its own), so the generate hook then drives a real engine through real searches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_search_r1.plugin import INVALID_ACTION
from slime_search_r1.retrieval import Bm25Retriever, format_passages
from slimecore.testing import mask_runs
from slimecore.rollout.turns import parse_tag_call

CITIES = {"France": "Paris", "Australia": "Canberra", "Canada": "Ottawa", "Kenya": "Nairobi"}
CORPUS = [{"id": str(i), "contents": f'"{city}"\n{city} is the capital of {country}.'}
          for i, (country, city) in enumerate(CITIES.items())]


def question(country: str) -> str:
    return f"Capital of {country}? Search, then answer."


def observation(query: str, corpus_path: Path, topk: int = 1) -> str:
    docs = Bm25Retriever.from_jsonl(corpus_path).search(query, topk)
    return f"\n\n<information>{format_passages(docs).strip()}</information>\n\n"


INVALID_FIRST = "Kenya"  # this episode starts with an invalid action (no <answer> before </answer>)


def episode(country: str, corpus_path: Path) -> list[tuple[str, bool]]:
    """The taught episode after the prompt: (text, trained) segments. Every country but ``INVALID_FIRST``:
    search, read, answer; ``INVALID_FIRST``: an invalid action, Search-R1's fixed reply, then the answer."""
    city = CITIES[country]
    if country == INVALID_FIRST:
        first, reply = (f"<think> I know it </think> {city} </answer>", INVALID_ACTION)
    else:
        query = f"capital of {country}"
        first, reply = f"<think> search </think><search> {query} </search>", observation(query, corpus_path)
    return [(first, True), (reply, False), (f"<think> found </think><answer> {city} </answer>", True)]


def write_data(directory: Path) -> tuple[Path, Path]:
    """(corpus.jsonl, qa.jsonl) in ``directory``; labels in Search-R1's {"target": [...]} form."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus, qa = directory / "corpus.jsonl", directory / "qa.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
    qa.write_text("".join(json.dumps({"input": question(c), "label": {"target": [city]}}) + "\n"
                          for c, city in CITIES.items()))
    return corpus, qa


def teach(base: Path, out: Path, corpus_path: Path, steps: int = 150, lr: float = 1e-2) -> Path:
    """Fine-tune the tiny checkpoint at ``base`` on the taught episodes; save it to ``out``."""
    from transformers import AutoTokenizer

    from slimecore.testing.tiny import teach_tiny

    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = []
    for country in CITIES:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question(country)}], tokenize=False,
                                               add_generation_prompt=True)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        trained = [False] * len(ids)
        for text, train in episode(country, corpus_path):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, trained = ids + piece, trained + [train] * len(piece)
        rows.append((ids, trained))
    return teach_tiny(base, out, rows, steps=steps, lr=lr, batched=False)


def check_episode(sample, tokenizer, corpus) -> list[str]:
    """Every model turn (mask 1) is followed by exactly the observation its action calls for (mask 0, log-prob 0);
    returns the actions."""
    sample.check_aligned()
    assert len(sample.tokens) == sample.prompt_length + sample.response_length
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    response, actions = sample.response_tokens, []
    spans = mask_runs(sample.loss_mask)
    assert [v for v, _, _ in spans] == [1, 0] * (len(spans) // 2) + [1] * (len(spans) % 2)  # model turn first and last
    for i, (value, start, end) in enumerate(spans):
        if value == 0:
            continue
        text = tokenizer.decode(response[start:end])
        call = parse_tag_call(text, ("search", "answer"))
        actions.append(call.name if call else "invalid")
        if i + 1 < len(spans):  # the observation this turn earned
            _, o_start, o_end = spans[i + 1]
            expected = INVALID_ACTION if call is None else observation(call.content, corpus)
            assert response[o_start:o_end] == tokenizer(expected, add_special_tokens=False)["input_ids"]
            assert sample.rollout_log_probs[o_start:o_end] == [0.0] * (o_end - o_start)
        assert all(lp <= 0 for lp in sample.rollout_log_probs[start:end])  # log-probs of the engine's tokens
    return actions


@pytest.fixture(scope="session")
def search_data(tmp_path_factory) -> tuple[Path, Path]:
    return write_data(tmp_path_factory.mktemp("search_r1_data"))


@pytest.fixture(scope="session")
def taught_checkpoint(tiny_hf_checkpoint, search_data, tmp_path_factory) -> Path:
    return teach(tiny_hf_checkpoint, tmp_path_factory.mktemp("taught"), search_data[0])


class RetrievalServer:
    """A Search-R1 retrieval server on 127.0.0.1 (``POST /retrieve``, its request and answer format) over BM25,
    on its own thread, with faults to order: ``delay`` seconds before answering, ``fail`` answers of HTTP 500
    first (-1: always), ``garbage`` to answer non-JSON. ``requests`` holds every body received."""

    def __init__(self, corpus_path: Path):
        self.retriever = Bm25Retriever.from_jsonl(corpus_path)
        self.requests: list[dict] = []
        self.delay, self.fail, self.garbage = 0.0, 0, False

    async def _retrieve(self, request):
        import asyncio

        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            if self.fail > 0:
                self.fail -= 1
            return web.Response(status=500, text="retriever index not loaded")
        if self.garbage:
            return web.Response(text="<html>proxy error</html>")
        result = []
        for query in body["queries"]:
            hits = self.retriever.scored(query, body.get("topk") or 3)
            result.append([{"document": d, "score": s} for d, s in hits] if body.get("return_scores")
                          else [d for d, _ in hits])
        return web.json_response({"result": result})

    def __enter__(self) -> "RetrievalServer":
        import asyncio
        import socket
        import threading

        from aiohttp import web

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/retrieve"
        started = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/retrieve", self._retrieve)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.SockSite(self.runner, sock).start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert started.wait(30), "the test retrieval server did not start"
        return self

    def __exit__(self, *exc) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
