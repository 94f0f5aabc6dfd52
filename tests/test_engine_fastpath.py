"""The embedded engine's own decode step (slimecore.engines.fastpath) against HF: greedy tokens equal to
``model.generate()`` on an untouched copy of the model, log-probs equal to the trainer's unpadded forward,
fused weights that follow every weight update and a memory release/resume, and HF's forward kept for
the architectures the fast step does not cover."""

from __future__ import annotations

import pytest
import torch

from slimecore.engines.embedded import EmbeddedServer
from slimecore.engines import fastpath
from slimecore.engines.fastpath import FastDecoder
from slimecore.testing import timeout as scaled
from slimecore.testing.tiny import make_tiny_checkpoint

PROMPTS = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15], [3, 4], list(range(20, 32)) + [40]]


def fresh_model(path, state=None):
    """What the trainer holds: the checkpoint loaded anew (plain, unfused weights), ``state`` loaded over it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model


def run_wave(server, prompts=PROMPTS, new_tokens=10):
    reqs = [server.submit(server.new_request({"input_ids": p, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": new_tokens + i, "ignore_eos": True}})) for i, p in enumerate(prompts)]
    for req in reqs:
        assert req.done.wait(scaled(60))
    return reqs


def generate_expected(model, pad_id, prompts=PROMPTS, new_tokens=10):
    """``model.generate`` on the left-padded batch, row i cut to its own ``new_tokens + i``."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = (ids != -1).long()
    for i, p in enumerate(prompts):
        mask[i, :width - len(p)] = 0
    model.generation_config.eos_token_id = None  # as ignore_eos
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens + len(prompts) - 1,
                             do_sample=False, pad_token_id=pad_id)[:, width:].tolist()
    return [row[:new_tokens + i] for i, row in enumerate(out)]


def assert_trainer_logprobs(model, reqs):
    for req in reqs:
        with torch.no_grad():
            logits = model(torch.tensor([req.input_ids + req.output_ids])).logits[0, len(req.input_ids) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(req.output_ids)[:, None]).squeeze(1)
        assert (expected - torch.tensor(req.logprobs)).abs().max().item() < 1e-4


@pytest.fixture
def serve(monkeypatch):
    """Start engines on a tiny checkpoint; its weights are packed although they are below the size that gains
    (the path a real model's decode takes), unless a test turns packing off."""
    monkeypatch.setattr(fastpath, "PACK_MIN_ELEMENTS", 0)
    servers = []

    def start(path):
        server = EmbeddedServer(path, max_batch_size=8)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_fast_step_equals_model_generate_and_the_trainer(serve, tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    server = serve(path)
    assert isinstance(server.fast, FastDecoder)
    steps = []
    step = server.fast.step
    server.fast.step = lambda *a: steps.append(1) or step(*a)
    reqs = run_wave(server)
    assert steps  # the decode ran through the fast step
    trainer = fresh_model(path)
    assert [r.output_ids for r in reqs] == generate_expected(trainer, server.pad_id)
    assert_trainer_logprobs(trainer, reqs)


def test_fused_weights_follow_updates_and_a_memory_release(serve, tmp_path):
    path = make_tiny_checkpoint(tmp_path / "qwen2")
    server = serve(path)
    attn = server.model.model.layers[0].self_attn
    fused = server.fast.layers[0][1].weight  # q, k and v stacked; the modules' weights are its rows
    assert attn.k_proj.weight.data_ptr() == fused[attn.q_proj.weight.shape[0]:].data_ptr()
    assert attn.q_proj.weight.is_contiguous() and set(server.model.state_dict()) == set(fresh_model(path).state_dict())
    before = [r.output_ids for r in run_wave(server)]
    assert not server.fast.stale and server.fast.layers[0][1].packed is not None  # the step read packed weights

    new = {k: v * 1.5 for k, v in fresh_model(path).state_dict().items()}
    server.load_weights(new, "2")  # the object-store / disk path: copy_ into the parameters
    assert torch.equal(fused[:attn.q_proj.weight.shape[0]], new["model.layers.0.self_attn.q_proj.weight"])
    assert server.fast.stale  # packed again at the next step
    reqs = run_wave(server)
    assert [r.output_ids for r in reqs] != before
    trainer = fresh_model(path, new)
    assert [r.output_ids for r in reqs] == generate_expected(trainer, server.pad_id)
    assert_trainer_logprobs(trainer, reqs)

    half = {k: v * 0.5 for k, v in new.items()}  # a bucket of some weights at a time (tensor / distributed)
    for name in [k for k in half if "mlp" in k]:
        server.load_weights([(name, half[name])], "3", complete=False)
    mixed = {**new, **{k: v for k, v in half.items() if "mlp" in k}}
    assert_trainer_logprobs(fresh_model(path, mixed), run_wave(server))

    server.release_memory_occupation(["weights"])
    server.resume_memory_occupation(["weights"])
    server.load_weights(half, "4")
    assert server.fast.layers[0][1].weight.data_ptr() == server.model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    reqs = run_wave(server)
    trainer = fresh_model(path, half)
    assert [r.output_ids for r in reqs] == generate_expected(trainer, server.pad_id)
    assert_trainer_logprobs(trainer, reqs)


@pytest.mark.parametrize("off", ["env", "small"])
def test_without_packed_weights_the_step_reads_the_fused_weights(serve, tmp_path, monkeypatch, off):
    if off == "env":
        monkeypatch.setenv("SLIMECORE_ENGINE_PACKED_WEIGHTS", "0")
    else:  # the tiny model's weights, at the real threshold, are too small to gain from packing
        monkeypatch.setattr(fastpath, "PACK_MIN_ELEMENTS", 1 << 19)
    path = make_tiny_checkpoint(tmp_path / "qwen2")
    server = serve(path)
    reqs = run_wave(server)
    assert server.fast.layers[0][1].packed is None and server.fast.head.packed is None
    trainer = fresh_model(path)
    assert [r.output_ids for r in reqs] == generate_expected(trainer, server.pad_id)
    assert_trainer_logprobs(trainer, reqs)


def test_other_architectures_keep_the_hf_forward(serve, tmp_path, monkeypatch):
    path = make_tiny_checkpoint(tmp_path / "mistral", arch="mistral")
    server = serve(path)
    assert server.fast is None and "mistral" in FastDecoder.supports(server.model)
    reqs = run_wave(server)
    trainer = fresh_model(path)
    assert [r.output_ids for r in reqs] == generate_expected(trainer, server.pad_id)
    assert_trainer_logprobs(trainer, reqs)

    monkeypatch.setenv("SLIMECORE_ENGINE_FAST_DECODE", "0")
    assert serve(make_tiny_checkpoint(tmp_path / "llama", arch="llama")).fast is None
    sliding = fresh_model(path).config
    sliding.model_type, sliding.layer_types = "qwen2", ["sliding_attention", "full_attention"]
    monkeypatch.delenv("SLIMECORE_ENGINE_FAST_DECODE")
    assert FastDecoder.supports(type("M", (), {"config": sliding})) == "sliding-window layers"
