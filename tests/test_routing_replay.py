"""Rollout routing replay (R3, ``--use-rollout-routing-replay``): SGLang's ``meta_info.routed_experts`` format, the
routers' replay (bit-identical on their own choice, for each router kind), the embedded engine's record, and the
fsdp trainer routing every token to the experts the engine used, through the real engine, rollout columns, DP
split and ``Trainer``; bad combinations stop before Ray. R2 (``--use-routing-replay``, the ``r2`` tests): the
old-policy pass's record replayed in training, on both backends."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from slimecore.config import Config, ConfigError
from slimecore.plugins import load_plugins
from slimecore.routers import ROUTERS, RouterReplay, find_routers
from slimecore.routing_replay import (REPLAYABLE_MODEL_TYPES, RoutingError, RoutingShape, check_config, decode,
                                      encode)
from slimecore.testing.tiny import make_tiny_checkpoint

SHAPE = RoutingShape(layers=2, topk=2, num_experts=4, model_type="qwen3_moe")
_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2)
ARCHITECTURES = {  # one tiny HF model per router class of slimecore.routers.ROUTERS
    "qwen2_moe": lambda: Qwen2MoeConfig(**_SMALL, num_experts=4, shared_expert_intermediate_size=16),
    "qwen3_moe": lambda: Qwen3MoeConfig(**_SMALL, num_experts=4, head_dim=8, norm_topk_prob=True),
    "deepseek_v3": lambda: DeepseekV3Config(**_SMALL, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                                            q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                            v_head_dim=8, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    "glm4_moe": lambda: Glm4MoeConfig(**_SMALL, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0,
                                      head_dim=8, n_group=1, topk_group=1, routed_scaling_factor=1.5),
}


def test_sglang_wire_format():
    """``meta_info.routed_experts`` as SGLang's detokenizer writes it (base64 of int32 rows for positions [start,
    tokens - 1)) decodes to the compact array; a missing, short or out-of-range answer is one clear error."""
    rows = np.random.default_rng(0).integers(0, 4, size=(9, 2, 2), dtype=np.int32)
    full = decode({"routed_experts": encode(rows)}, num_tokens=10, shape=SHAPE)
    assert full.dtype == np.uint8 and np.array_equal(full, rows)
    tail = decode({"routed_experts": encode(rows[6:]), "routed_experts_start_len": 6}, 10, SHAPE, previous=full[:6])
    assert np.array_equal(tail, rows)
    assert RoutingShape(1, 8, 257, "").dtype == np.uint16  # more experts than a byte holds
    with pytest.raises(RoutingError, match="no meta_info.routed_experts; start SGLang with --enable-return-routed"):
        decode({}, 10, SHAPE)
    with pytest.raises(RoutingError, match="holds 32 ids; 10 tokens from position 0 need 9 rows"):
        decode({"routed_experts": encode(rows[:8])}, 10, SHAPE)
    with pytest.raises(RoutingError, match=r"expert id 7 outside \[0, 4\)"):
        decode({"routed_experts": encode(np.full((9, 2, 2), 7))}, 10, SHAPE)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_replaying_a_routers_own_choice_changes_nothing(model_type):
    """Each router kind: the forward replaying the experts the router chose itself gives the same logits, bit for
    bit (the replayed weighting is the model's own); replaying other experts changes them."""
    assert set(ARCHITECTURES) == set(REPLAYABLE_MODEL_TYPES)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ARCHITECTURES[model_type]()).eval()
    assert {type(r).__name__ for _, r in find_routers(model)} <= set(ROUTERS)
    replay = RouterReplay(model)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        chosen = {layer: indices.clone() for layer, indices in replay.seen.items()}
        with replay.replaying(chosen):
            again = model(input_ids=ids).logits
        with replay.replaying({layer: (indices + 1) % 4 for layer, indices in chosen.items()}):
            other = model(input_ids=ids).logits
    assert torch.equal(own, again)
    assert not torch.allclose(own, other)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("moe"), arch="qwen3_moe"))


@pytest.fixture(scope="module")
def engine(moe_checkpoint):
    """The real embedded engine serving the tiny MoE in bf16 (the trainer is fp32, so a few routings differ),
    recording each token's experts."""
    from slimecore.engines.embedded import EmbeddedServer

    server = EmbeddedServer(moe_checkpoint, dtype="bfloat16", return_routed_experts=True)
    server.start()
    try:
        assert server.server_info()["enable_return_routed_experts"]
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def rollout(engine, moe_checkpoint):
    """Eight samples from the engine with their routing, through the real sglang-router (which drops
    return_routed_experts: the recording engine answers every request's routing) and the rollout client, as a run's
    generate hook gets them."""
    from slimecore.engines.router import Router
    from slimecore.rollout.client import RolloutClient, SharedRequests
    from slimecore.routing_replay import checkpoint_shape
    from slimecore.types import Sample

    router = Router([engine.url]).start()
    client = RolloutClient(router.url)
    client.routed_experts = checkpoint_shape(moe_checkpoint)
    rng = random.Random(0)

    async def one(index: int) -> Sample:
        sample = Sample(index=index, tokens=[rng.randint(3, 390) for _ in range(rng.randint(16, 24))], reward=1.0)
        out = await client.generate(input_ids=sample.tokens, sampling_params={
            "max_new_tokens": 48, "ignore_eos": True, "sampling_seed": index})
        meta = out["meta_info"]
        entries = meta["output_token_logprobs"]
        sample.append_response_tokens([e[1] for e in entries], [e[0] for e in entries],
                                      finish_reason=meta["finish_reason"])
        client.keep_routed_experts(sample, meta)
        return sample

    async def generate():
        with SharedRequests():  # one batched request, as a prompt group's samples go
            samples = await asyncio.gather(*(one(i) for i in range(8)))
        await client.close()
        return samples

    try:
        return asyncio.run(generate())
    finally:
        router.stop()


def _trainer_data(checkpoint: str, samples, replay: bool, use_kl_loss: bool = False, **core):
    """A grpo ``Trainer`` of ``checkpoint`` and its rank's data made from ``samples`` as a run makes them (rollout
    columns, DP split), with a hook keeping every router call's chosen experts."""
    from slimecore.rollout.manager import convert_samples
    from slimecore.rollout.schedule import split_rollout_data
    from slimecore.trainers.trainer import Trainer

    hooks = load_plugins(["grpo"])
    grpo = {o.name: o.default for o in hooks.slime_options()["grpo"]} | {"use_kl_loss": use_kl_loss}
    config = Config.make(plugins=["grpo"], plugin_values={"grpo": grpo}, hf_checkpoint=checkpoint, rollout_batch_size=8,
                         global_batch_size=8, use_rollout_routing_replay=replay, **core)
    [part] = split_rollout_data(config, convert_samples(hooks, config, samples), 1)
    trainer = Trainer(config, hooks)
    calls: dict[int, list[torch.Tensor]] = {}  # every router call's chosen experts, by layer
    for layer, router in find_routers(trainer.backend.model):
        router.register_forward_hook(lambda m, a, out, layer=layer: calls.setdefault(layer, []).append(out[2].clone()))
    return trainer, part, calls


def _rows_of(call: torch.Tensor, tokens: list[list[int]], width: int) -> list[np.ndarray]:
    """Each sequence's rows of one router call over sequences right-padded to ``width``, its last token left out."""
    return [call.view(len(tokens), width, -1)[i, :len(t) - 1].numpy() for i, t in enumerate(tokens)]


def test_slimes_own_generate_keeps_the_routing(engine, moe_checkpoint, monkeypatch):
    """slime's default generate (the adapter's port, which slime users' custom generate functions call) asks for
    and keeps the routing with the flag, as slime's does."""
    from slimecore.defaults.slime_compat import SHIM_ROOT, _build_args
    from slimecore.routing_replay import check_samples
    from slimecore.types import Sample

    monkeypatch.syspath_prepend(SHIM_ROOT)
    before = set(sys.modules)
    try:
        from slime.rollout.sglang_rollout import generate

        args = _build_args(Config.make(hf_checkpoint=moe_checkpoint, use_rollout_routing_replay=True,
                                       rollout_batch_size=1))
        args.sglang_router_ip, args.sglang_router_port = engine.host, engine.port
        sample = asyncio.run(generate(args, Sample(index=0, tokens=[5, 6, 7, 8, 9]), {"max_new_tokens": 6}))
    finally:
        for name in set(sys.modules) - before:  # the shim is importable as `slime` only where the adapter puts it
            if name == "slime" or name.startswith("slime."):
                del sys.modules[name]
    check_samples([sample])
    assert sample.response_length and sample.rollout_routed_experts.shape == (len(sample.tokens) - 1, 2, 2)


def test_engine_routing_is_the_routing_of_each_sample_alone(rollout, moe_checkpoint):
    """The engine's record (batched, prefix-shared, KV-cached, in bf16) equals each sample's own routing in a bf16
    HF forward of its tokens alone, for all but a handful of near-tie token-layers."""
    model = AutoModelForCausalLM.from_pretrained(moe_checkpoint, dtype=torch.bfloat16).eval()
    seen = {}
    for layer, router in find_routers(model):
        router.register_forward_hook(lambda m, a, out, layer=layer: seen.__setitem__(layer, out[2]))
    differing = total = 0
    for sample in rollout:
        assert sample.rollout_routed_experts.shape == (len(sample.tokens) - 1, 2, 2)
        with torch.no_grad():
            model(input_ids=torch.tensor([sample.tokens[:-1]]))
        alone = np.stack([seen[layer].numpy() for layer in sorted(seen)], axis=1)
        differing += int((np.sort(alone, -1) != np.sort(sample.rollout_routed_experts, -1)).any(-1).sum())
        total += alone.shape[0] * alone.shape[1]
    assert differing <= total // 100, (differing, total)


def test_training_routes_every_token_to_the_rollouts_experts(rollout, moe_checkpoint):
    """With replay, the trainer's routers choose exactly the engine's experts for every token and layer: in the
    old-policy log-prob pass (micro-batches of 3, right-padded) and in a training step's forward and its
    gradient-checkpointing recompute; the train/rollout log-prob gap is below the gap without replay, where the
    fp32 trainer routes some tokens elsewhere than the bf16 engine did."""
    engine = {sample.index: sample.rollout_routed_experts for sample in rollout}
    gaps = {}
    for replay in (True, False):
        trainer, part, calls = _trainer_data(moe_checkpoint, rollout, replay, micro_batch_size=3)
        log_probs = trainer.compute_log_probs(part)
        gaps[replay] = float(np.mean([float((lp - torch.tensor(r)).abs().mean())
                                      for lp, r in zip(log_probs, part["rollout_log_probs"])]))
        micro_batches = part["steps"][0]["micro_batches"]
        differing = 0
        for layer, layer_calls in calls.items():
            assert len(layer_calls) == len(micro_batches)
            for call, mb in zip(layer_calls, micro_batches):
                tokens = [part["tokens"][i] for i in mb]
                for got, i in zip(_rows_of(call, tokens, max(map(len, tokens))), mb):
                    expected = engine[part["sample_indices"][i]][:, layer]
                    if replay:
                        assert np.array_equal(got, expected), (layer, i)
                    differing += int((np.sort(got, -1) != np.sort(expected, -1)).any(-1).sum())
        if not replay:
            assert differing > 0  # what replay fixes: the fp32 trainer alone routes some tokens elsewhere
    assert gaps[True] < gaps[False]

    trainer, part, calls = _trainer_data(moe_checkpoint, rollout, True, micro_batch_size=8,
                                         gradient_checkpointing=True)
    trainer.train(0, part)
    [mb] = part["steps"][0]["micro_batches"]
    tokens = [part["tokens"][i] for i in mb]
    for layer, layer_calls in calls.items():
        assert len(layer_calls) >= 2  # the old-policy pass, the step's forward (and its recompute)
        for call in layer_calls:
            for got, i in zip(_rows_of(call, tokens, max(map(len, tokens))), mb):
                assert np.array_equal(got, engine[part["sample_indices"][i]][:, layer])


def test_reference_policy_routes_by_itself(rollout, moe_checkpoint):
    """The reference pass (the KL term's, under ``reference_weights``) takes its own routing, as slime's: before any
    update it gives the log-probs of a run without replay, not the replayed ones."""
    trainer, part, _ = _trainer_data(moe_checkpoint, rollout, True, micro_batch_size=8, use_kl_loss=True)
    replayed = trainer.compute_log_probs(part)
    with trainer.backend.reference_weights():
        reference = trainer.compute_log_probs(part)
    plain, plain_part, _ = _trainer_data(moe_checkpoint, rollout, False, micro_batch_size=8)
    own = plain.compute_log_probs(plain_part)
    assert all(torch.equal(a, b) for a, b in zip(reference, own))
    assert any(not torch.equal(a, b) for a, b in zip(reference, replayed))


def test_bad_combinations_stop_before_ray(tmp_path, moe_checkpoint):
    dense = make_tiny_checkpoint(tmp_path / "dense", arch="qwen3")
    with pytest.raises(ConfigError, match="drop the flag"):
        check_config(Config.make(hf_checkpoint=moe_checkpoint, use_rollout_routing_replay=True, engines=False))
    check_config(Config.make(hf_checkpoint=moe_checkpoint, use_rollout_routing_replay=True))  # passes
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text('{"model_type": "mixtral", "num_local_experts": 8, '
                                                      '"num_experts_per_tok": 2, "num_hidden_layers": 2}')
    with pytest.raises(ConfigError, match="cannot replay the router of model_type 'mixtral'"):
        check_config(Config.make(hf_checkpoint=str(tmp_path / "mixtral"), use_rollout_routing_replay=True))
    with pytest.raises(ConfigError, match="the installed sglang-router drops return_routed_experts"):
        check_config(Config.make(hf_checkpoint=moe_checkpoint, use_rollout_routing_replay=True,
                                 rollout_engine="sglang"))  # the upstream router here, not slime's fork
    from slimecore.trainers.megatron import MegatronSetupError, check_config as check_megatron

    with pytest.raises(MegatronSetupError, match="--use-rollout-routing-replay with --pipeline-model-parallel-size"):
        check_megatron(Config.make(hf_checkpoint=moe_checkpoint, train_backend="megatron",
                                   use_rollout_routing_replay=True, pipeline_model_parallel_size=2), world_size=2)
    _dense_checkpoint_stops_before_ray(tmp_path, dense, "--use-rollout-routing-replay")


def _dense_checkpoint_stops_before_ray(tmp_path, dense, flag: str) -> None:
    """``slime-core train FLAG`` of the dense checkpoint ``dense`` stops with one line, before the run folder."""
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--rollout-batch-size",
                           "2", "--hf-checkpoint", str(dense), flag], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if flag in line]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "is a dense model (model_type 'qwen3', no routed experts" in lines[0]
    assert not (tmp_path / "runs").exists()  # stopped before the run folder, Ray, or a model


def _megatron_routing(rank: int, world: int, checkpoint: str, part: dict) -> dict:
    """One rank under megatron-core's CPU shim: the experts every TopKRouter call chose (its routing map), in the
    old-policy pass and in a training step with full activation recompute."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "megatron"))
    import cpu_shim

    cpu_shim.install()
    from megatron.core.transformer.moe.router import TopKRouter

    from slimecore.trainers.trainer import Trainer

    hooks = load_plugins(["grpo", "models"])
    grpo = {o.name: o.default for o in hooks.slime_options()["grpo"]}
    config = Config.make(plugins=["grpo", "models"], plugin_values={"grpo": grpo}, hf_checkpoint=checkpoint,
                         train_backend="megatron", rollout_batch_size=8, global_batch_size=8, micro_batch_size=3,
                         use_rollout_routing_replay=True, recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
    trainer = Trainer(config, hooks, rank=rank, world_size=world, backend="megatron")
    calls: dict[int, list] = {}  # layer -> the experts chosen per row, of every router call in order

    def keep(module, args, out, layer):
        calls.setdefault(layer, []).append(np.sort(out[1].nonzero()[:, 1].view(-1, module.topk).numpy(), -1))

    for module in trainer.backend.modules.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(lambda m, a, out, layer=module.layer_number - 1: keep(m, a, out, layer))
    trainer.compute_log_probs(part)
    trainer.train(0, part)
    return calls


def test_megatron_routes_every_token_to_the_rollouts_experts(rollout, moe_checkpoint):
    """The megatron backend (megatron-core's CPU shim, one rank): megatron-core's own RouterReplay, fed the
    rollout's experts, makes every router call choose the engine's experts for every real token: the log-prob pass
    over micro-batches of 3 packed samples, then a training step's forwards, each followed by its recompute in
    backward (full activation recompute)."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("slime_models")
    from slimecore.rollout.manager import convert_samples
    from slimecore.rollout.schedule import split_rollout_data
    from slimecore.testing import timeout as scaled
    from slimecore.testing.distributed import run_ranks

    hooks = load_plugins(["grpo"])
    config = Config.make(plugins=["grpo"], plugin_values={"grpo": {o.name: o.default for o in
                                                                   hooks.slime_options()["grpo"]}},
                         hf_checkpoint=moe_checkpoint, rollout_batch_size=8, global_batch_size=8, micro_batch_size=3,
                         use_rollout_routing_replay=True)
    [part] = split_rollout_data(config, convert_samples(hooks, config, rollout), 1)
    [result] = run_ranks(_megatron_routing, moe_checkpoint, part, world=1, timeout=scaled(300))  # ~20 s
    engine = {sample.index: np.sort(sample.rollout_routed_experts, -1) for sample in rollout}
    micro_batches = part["steps"][0]["micro_batches"]

    def replays(call: np.ndarray, mb: list[int], layer: int) -> bool:
        """Whether a router call over micro-batch ``mb``'s packed stream chose the engine's experts."""
        lengths = [len(part["tokens"][i]) for i in mb]
        if len(call) != sum(lengths):
            return False
        starts = np.cumsum([0] + lengths)
        return all(np.array_equal(call[a:a + n - 1], engine[part["sample_indices"][i]][:, layer])
                   for i, a, n in zip(mb, starts, lengths))

    expected = micro_batches + [mb for mb in micro_batches for _ in ("forward", "recompute")]
    for layer, layer_calls in result.items():
        assert len(layer_calls) == len(expected)
        assert all(replays(call, mb, layer) for call, mb in zip(layer_calls, expected))



# -- R2, --use-routing-replay: the old-policy pass records, training replays ------------------------------------

@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    """A tiny GLM-4.5-style MoE: a dense first layer, then two MoE layers whose sigmoid router chooses on its
    scores plus a correction bias (``e_score_correction_bias``; megatron-core's ``expert_bias``) that steers the
    choice only, not the chosen experts' weights."""
    from slimecore.testing.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("glm")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Glm4MoeConfig(
        vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True,
        architectures=["Glm4MoeForCausalLM"])).to(torch.float32)
    with torch.no_grad():  # random routers: the tokens choose the experts (the default init is near-uniform)
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def _r2_config(checkpoint: str, plugins: list[str], replay: bool, **core) -> Config:
    """grpo on eight samples in one optimizer step of micro-batches of 3 (grpo alone would reuse the step's own
    forward as the old policy and skip the log-prob pass)."""
    hooks = load_plugins(["grpo"])
    grpo = {o.name: o.default for o in hooks.slime_options()["grpo"]}
    return Config.make(plugins=plugins, plugin_values={"grpo": grpo}, hf_checkpoint=checkpoint, rollout_batch_size=8,
                       global_batch_size=8, micro_batch_size=3, use_routing_replay=replay, **core)


def _r2_part(checkpoint: str) -> dict:
    """One rank's data of eight random samples, as a run makes it."""
    from slimecore.rollout.manager import convert_samples
    from slimecore.rollout.schedule import split_rollout_data
    from slimecore.types import Sample

    rng = random.Random(0)
    samples = []
    for index in range(8):
        sample = Sample(index=index, tokens=[rng.randint(3, 390) for _ in range(rng.randint(8, 14))],
                        reward=float(index % 2))
        response = [rng.randint(3, 390) for _ in range(rng.randint(6, 12))]
        sample.append_response_tokens(response, [-1.0] * len(response))
        samples.append(sample)
    config = _r2_config(checkpoint, ["grpo"], replay=True)
    [part] = split_rollout_data(config, convert_samples(load_plugins(["grpo"]), config, samples), 1)
    return part


BIAS_SHIFT = torch.tensor([1.5, -1.5, 0.75, -0.75])  # moves every router's choice, not the chosen experts' weights


def _r2_step(rank: int, world: int, checkpoint: str, part: dict, backend: str, replay: bool) -> dict:
    """One grpo step (fsdp with gradient checkpointing; megatron, under its CPU shim, with full recompute) whose
    routers' expert bias moves between the old-policy log-prob pass and the step. Returns the old log-probs, the
    step's own (step 0: before any update), R2's record, and the experts each sample's rows chose in every router
    call (sorted per row), by layer: the log-prob pass's micro-batches, then each one's forward and recompute."""
    from slimecore.trainers.trainer import Trainer

    core = dict(gradient_checkpointing=True)
    plugins = ["grpo"]
    if backend == "megatron":
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent / "megatron"))
        import cpu_shim

        cpu_shim.install()
        core = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        plugins = ["grpo", "models"]
    config = _r2_config(checkpoint, plugins, replay, train_backend=backend, **core)
    trainer = Trainer(config, load_plugins(plugins), rank=rank, world_size=world, backend=backend)
    calls: dict[int, list[np.ndarray]] = {}
    biases = []
    if backend == "fsdp":
        for layer, router in find_routers(trainer.backend.model):
            router.register_forward_hook(lambda m, a, out, layer=layer: calls.setdefault(layer, []).append(
                np.sort(out[2].numpy(), -1)))
            biases.append(router.e_score_correction_bias)
    else:
        from megatron.core.transformer.moe.router import TopKRouter

        for module in trainer.backend.modules.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(lambda m, a, out, layer=module.layer_number - 1: calls.setdefault(
                    layer, []).append(out[1].nonzero()[:, 1].view(-1, m.topk).numpy()))
                biases.append(module.expert_bias)
    out: dict = {"new": {}}
    if not replay:  # the pass free routing would take (grpo's single step does not ask for one)
        out["old"] = trainer.compute_log_probs(part)
    run = trainer.backend.run_micro_batches

    def between_passes(batch, micro_batches, fn, *, train, **kw):
        if not train:
            return run(batch, micro_batches, fn, train=train, **kw)
        if replay:
            out["old"], out["recorded"] = batch["log_probs"], batch["rollout_routed_experts"]
        with torch.no_grad():
            for bias in biases:
                bias.add_(BIAS_SHIFT.to(bias.dtype))

        def keep(mb, outputs):
            out["new"].update({i: lp.detach().float().cpu() for i, lp in zip(mb, outputs["log_probs"])})
            return fn(mb, outputs)

        return run(batch, micro_batches, keep, train=train, **kw)

    trainer.backend.run_micro_batches = between_passes
    trainer.train(0, part)
    micro_batches = part["steps"][0]["micro_batches"]
    order = micro_batches + [mb for mb in micro_batches for _ in ("forward", "recompute")]
    out["rows"] = {}
    for layer, layer_calls in calls.items():
        assert len(layer_calls) == len(order), (layer, len(layer_calls), len(order))
        out["rows"][layer] = []
        for call, mb in zip(layer_calls, order):
            lengths = [len(part["tokens"][i]) for i in mb]
            widths = [max(lengths)] * len(mb) if backend == "fsdp" else lengths  # padded rows, or packed
            starts = np.cumsum([0] + widths)
            out["rows"][layer].append({i: call[a:a + n - 1] for i, a, n in zip(mb, starts, lengths)})
    out["old"] = [lp.float().cpu().numpy() for lp in out["old"]]  # numpy: tensors cross processes as file handles
    out["new"] = [out["new"][i].numpy() for i in range(len(part["tokens"]))]
    return out


def _check_r2(replayed: dict, free: dict, part: dict) -> None:
    """R2: every router call (the log-prob pass, each training forward and its recompute) chose the recorded
    experts for every real token, and the step's log-probs are the old ones (ratio 1) although the expert bias
    moved; without R2 the moved bias routes some tokens elsewhere and the step's log-probs differ."""
    recorded = replayed["recorded"]
    assert [r.shape for r in recorded] == [(len(t) - 1, 3, 2) for t in part["tokens"]]
    assert all(r.dtype == np.uint8 for r in recorded)
    for layer, per_call in replayed["rows"].items():
        assert layer in (1, 2)  # the MoE layers; layer 0 is dense
        for rows in per_call:
            for i, got in rows.items():
                assert np.array_equal(got, np.sort(recorded[i][:, layer], -1)), (layer, i)
    ratio_gap = max(float(np.abs(a - b).max()) for a, b in zip(replayed["old"], replayed["new"]))
    assert ratio_gap < 1e-5, ratio_gap
    moved = 0
    micro_batches = part["steps"][0]["micro_batches"]
    for layer, per_call in free["rows"].items():
        before = {i: rows for call in per_call[:len(micro_batches)] for i, rows in call.items()}
        moved += sum(int((rows[i] != before[i]).any(-1).sum()) for rows in per_call[len(micro_batches):] for i in rows)
    free_gap = max(float(np.abs(a - b).max()) for a, b in zip(free["old"], free["new"]))
    assert moved > 0 and free_gap > 1e-3, (moved, free_gap)


def test_r2_fsdp_training_replays_the_recorded_routing(glm_checkpoint):
    """The fsdp backend, HF's GLM-4.5 router, micro-batches right-padded, gradient checkpointing's recompute."""
    part = _r2_part(glm_checkpoint)
    _check_r2(_r2_step(0, 1, glm_checkpoint, part, "fsdp", replay=True),
              _r2_step(0, 1, glm_checkpoint, part, "fsdp", replay=False), part)


def test_r2_megatron_training_replays_the_recorded_routing(glm_checkpoint):
    """The megatron backend (megatron-core's CPU shim, one rank): megatron-core's RouterReplay records in the
    log-prob pass, replays in the step's forwards and in their full-recompute in backward."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("slime_models")
    from slimecore.testing import timeout as scaled
    from slimecore.testing.distributed import run_ranks

    part = _r2_part(glm_checkpoint)
    [replayed] = run_ranks(_r2_step, glm_checkpoint, part, "megatron", True, world=1, timeout=scaled(300))
    [free] = run_ranks(_r2_step, glm_checkpoint, part, "megatron", False, world=1, timeout=scaled(300))
    _check_r2(replayed, free, part)


def test_r2_bad_combinations_stop_before_ray(tmp_path, moe_checkpoint):
    """R2 needs no engine, only a MoE checkpoint whose router the trainer replays; megatron refuses pipeline
    parallelism, as for R3. Each refusal is one line naming the flag."""
    from slimecore.trainers.megatron import MegatronSetupError, check_config as check_megatron

    check_config(Config.make(hf_checkpoint=moe_checkpoint, use_routing_replay=True, engines=False))  # passes
    check_config(Config.make(hf_checkpoint=moe_checkpoint, use_routing_replay=True, rollout_engine="sglang"))
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text('{"model_type": "mixtral", "num_local_experts": 8, '
                                                      '"num_experts_per_tok": 2, "num_hidden_layers": 2}')
    with pytest.raises(ConfigError, match="^--use-routing-replay: the trainer cannot replay the router of model_type "
                                          "'mixtral'"):
        check_config(Config.make(hf_checkpoint=str(tmp_path / "mixtral"), use_routing_replay=True))
    with pytest.raises(MegatronSetupError, match="^--use-routing-replay with --pipeline-model-parallel-size > 1"):
        check_megatron(Config.make(hf_checkpoint=moe_checkpoint, train_backend="megatron", use_routing_replay=True,
                                   pipeline_model_parallel_size=2), world_size=2)
    _dense_checkpoint_stops_before_ray(tmp_path, make_tiny_checkpoint(tmp_path / "dense", arch="qwen3"),
                                       "--use-routing-replay")
