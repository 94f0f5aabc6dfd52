"""The fsdp backend: exact loss aggregation across micro-batching and DP sizes, reference policy,
save/load, LoRA, LR schedule. The tests that take ``device`` run on the CPU and, marked ``gpu``, on CUDA
(``tests/devices.py``: tolerances per device)."""

from __future__ import annotations

import copy
import random
import types

import pytest
import torch

from devices import DEVICES, fp32_strict, tolerance
from slimecore import hookimpl
from slimecore.config import Config
from slimecore.ops import distributed_masked_whiten, masked_whiten
from slimecore.plugins import load_plugins
from slimecore.testing.distributed import run_ranks
from slimecore.trainers.backend import lr_lambda
from slimecore.rollout.schedule import build_dp_schedule, split_for_ranks
from slimecore.trainers.trainer import Trainer


class PolicyGradient:
    """Test scaffolding for the hook layer: a clipped policy-gradient loss, advantage = reward on every
    token. Keeps the batches it saw in ``seen`` for inspection."""

    def __init__(self):
        self.seen: list[dict] = []

    @hookimpl
    def slime_train_inputs(self, config, role):
        return ["log_probs", "ref_log_probs"]

    @hookimpl
    def slime_compute_advantages(self, config, role, batch):
        self.seen.append(batch)
        adv = [torch.full((n,), float(r)) for r, n in zip(batch["rewards"], batch["response_lengths"])]
        return {"advantages": adv, "returns": adv}

    @hookimpl
    def slime_loss(self, config, role, batch, outputs, reducer):
        ratios = [torch.exp(lp - old) for lp, old in zip(outputs["log_probs"], batch["log_probs"])]
        pg = [-torch.minimum(r * a, r.clamp(0.8, 1.2) * a) for r, a in zip(ratios, batch["advantages"])]
        loss = reducer(pg) - 0.01 * reducer(outputs["entropy"])  # the entropy term checks its gradient too
        return loss, {"pg_loss": reducer(pg).detach(), "entropy_loss": reducer(outputs["entropy"]).detach()}


def _config(checkpoint, **kw):
    return Config.make(hf_checkpoint=str(checkpoint), **{"lr": 1e-3, "clip_grad": 1.0} | kw)


def _data(n=8, seed=0, rollout_log_probs=False):
    rng = random.Random(seed)
    data = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_rewards", "rollout_ids",
                            "sample_indices", "truncated")}
    for i in range(n):
        prompt, response = rng.randint(2, 9), rng.randint(1, 7)
        data["tokens"].append([rng.randint(3, 300) for _ in range(prompt + response)])
        data["response_lengths"].append(response)
        data["loss_masks"].append([rng.choice([0, 1, 1]) for _ in range(response)])
        data["rewards"].append(rng.uniform(-1, 1))
        data["raw_rewards"].append(0.0)
        data["rollout_ids"].append(i // 2 if i < 4 else i)  # two fan-out rollouts of 2 samples, then singles
        data["sample_indices"].append(i)
        data["truncated"].append(0)
    if rollout_log_probs:
        data["rollout_log_probs"] = [[-1.0] * r for r in data["response_lengths"]]
    return data


def _part(data, dp_size=1, rank=0, micro_batch_size=8, max_tokens=None, rollouts_per_step=None):
    rollouts = rollouts_per_step or len(set(data["rollout_ids"]))
    schedule = build_dp_schedule(data["rollout_ids"], [len(t) for t in data["tokens"]], rollouts, dp_size,
                                 micro_batch_size, max_tokens)
    return split_for_ranks(copy.deepcopy(data), schedule)[rank]


def _trainer(config, dp_size=1, rank=0, shard=None, device=None):
    plugin = PolicyGradient()
    trainer = Trainer(config, load_plugins([], extra=[plugin], defaults=False), rank=rank, world_size=dp_size,
                      backend="fsdp", shard=shard, device=device)
    return trainer, plugin


def _flat_grads(trainer):
    from slimecore.trainers.fsdp import _full

    return torch.cat([_full(p.grad).reshape(-1) for p in trainer.backend.params])


def _flat_weights(trainer):
    from slimecore.trainers.fsdp import _full

    return torch.cat([_full(p.detach()).reshape(-1) for p in trainer.backend.params])


def _train_once(config, data, device=None, **part_kw):
    trainer, plugin = _trainer(config, device=device)
    metrics = trainer.train(0, _part(data, **part_kw))
    return metrics, _flat_grads(trainer), trainer, plugin


# -- (a) micro-batching does not change the objective -------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_token", [False, True])
def test_loss_and_gradients_do_not_depend_on_micro_batching(tiny_checkpoint, per_token, device):
    config, tol = _config(tiny_checkpoint, calculate_per_token_loss=per_token), tolerance(device)
    data = _data()
    with fp32_strict():
        m1, g1, _, plugin = _train_once(config, data, device, micro_batch_size=8)
        m4, g4, _, _ = _train_once(config, data, device, micro_batch_size=2)
        md, gd, _, _ = _train_once(config, data, device, micro_batch_size=None, max_tokens=20)
    assert len(_part(data, micro_batch_size=8)["steps"][0]["micro_batches"]) == 1
    assert len(_part(data, micro_batch_size=2)["steps"][0]["micro_batches"]) == 4
    assert len(_part(data, micro_batch_size=None, max_tokens=20)["steps"][0]["micro_batches"]) > 1
    assert g1.device.type == device and g1.abs().max().item() > 0
    for other_m, other_g in ((m4, g4), (md, gd)):
        for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
            assert other_m[key] == pytest.approx(m1[key], abs=tol)
        assert (other_g - g1).abs().max().item() < tol
    # before the first update the reference policy is the current one
    batch = plugin.seen[0]
    assert all(torch.equal(a, b) for a, b in zip(batch["log_probs"], batch["ref_log_probs"]))


MIXED_LENGTHS = [40, 9, 41, 9, 90, 9, 43, 88]  # forward chunks: the three 9s (no padding), 40-43, 88-90


def _with_lengths(data, lengths):
    """``data`` with each sample's prompt redrawn so that the sample is ``lengths[i]`` tokens long."""
    rng = random.Random(1)
    for i, (n, r) in enumerate(zip(lengths, data["response_lengths"])):
        data["tokens"][i] = [rng.randint(3, 300) for _ in range(n - r)] + data["tokens"][i][-r:]
    return data


def test_forward_chunks_minimise_padded_tokens_plus_a_cost_per_forward():
    from slimecore.trainers.fsdp import forward_chunks

    assert forward_chunks(MIXED_LENGTHS) == [[1, 3, 5], [0, 2, 6], [7, 4]]
    assert forward_chunks(MIXED_LENGTHS, forward_cost=10**6) == [[1, 3, 5, 0, 2, 6, 7, 4]]
    assert forward_chunks(MIXED_LENGTHS, forward_cost=0) == [[1, 3, 5], [0], [2], [6], [7], [4]]
    assert forward_chunks([7]) == [[0]]


def test_one_more_forward_costs_more_tokens_on_a_small_model():
    from slimecore.trainers.fsdp import FORWARD_COST_TOKENS, forward_cost_tokens

    assert forward_cost_tokens(135_000_000, "cpu") == FORWARD_COST_TOKENS  # SmolLM2: the tokens dominate
    assert forward_cost_tokens(130_000, "cpu") > 300  # a tiny model: the Python of a forward dominates
    assert forward_cost_tokens(500_000_000, "cuda") > forward_cost_tokens(500_000_000, "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value_model", [False, True])
def test_chunked_forward_equals_one_padded_forward(tiny_checkpoint, value_model, device):
    """Each sample's log-probs, entropies (or values) from the length-sorted chunks equal those of the whole
    micro-batch right-padded to its longest sample."""
    from slimecore.trainers.fsdp import FORWARD_COST_TOKENS, FSDPBackend, forward_chunks

    backend = FSDPBackend(_config(tiny_checkpoint), value_model=value_model, device=device)
    backend.forward_cost = FORWARD_COST_TOKENS  # chunk as a larger model would (the tiny one forwards once)
    data = _with_lengths(_data(), MIXED_LENGTHS)
    assert len(forward_chunks(MIXED_LENGTHS, backend.forward_cost)) > 1
    args = (data["tokens"], data["response_lengths"], 0.7, True)
    with torch.no_grad(), fp32_strict():
        chunked, padded = backend._forward(*args), backend._forward_padded(*args)
    assert chunked.keys() == padded.keys() == ({"values"} if value_model else {"log_probs", "entropy"})
    for key in chunked:
        for got, want, r in zip(chunked[key], padded[key], data["response_lengths"]):
            assert got.shape == want.shape == (r,) and got.device.type == device
            assert (got - want).abs().max().item() < tolerance(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value_model", [False, True])
def test_packed_forward_equals_the_padded_chunks(tiny_checkpoint, value_model, device):
    """The CUDA default, a micro-batch as one unpadded stream with position_ids restarting per sample, gives each
    sample's log-probs, entropies (or values) of the padded chunks; and a training step the same loss and
    gradients."""
    from slimecore.trainers.fsdp import FSDPBackend

    backend = FSDPBackend(_config(tiny_checkpoint), value_model=value_model, device=device)
    assert backend.packed == (device == "cuda")
    data = _with_lengths(_data(), MIXED_LENGTHS)
    args = (data["tokens"], data["response_lengths"], 0.7, True)
    with torch.no_grad(), fp32_strict():
        packed, padded = backend._forward_packed(*args), backend._forward_padded(*args)
    assert packed.keys() == padded.keys()
    for key in packed:
        for got, want in zip(packed[key], padded[key]):
            assert got.shape == want.shape and (got - want).abs().max().item() < tolerance(device)
    if value_model:
        return
    config, tol = _config(tiny_checkpoint, calculate_per_token_loss=True), tolerance(device)
    runs = []
    for packed in (False, True):
        trainer, _ = _trainer(config, device=device)
        trainer.backend.packed = packed
        with fp32_strict():
            runs.append((trainer.train(0, _part(data, micro_batch_size=4)), _flat_grads(trainer)))
    (m0, g0), (m1, g1) = runs
    assert g0.abs().max().item() > 0 and (g1 - g0).abs().max().item() < tol
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert m1[key] == pytest.approx(m0[key], abs=tol), key


@pytest.mark.parametrize("device", DEVICES)
def test_chunking_is_invisible_to_the_loss_and_gradients(tiny_checkpoint, monkeypatch, device):
    import slimecore.trainers.fsdp as fsdp

    config, tol = _config(tiny_checkpoint, calculate_per_token_loss=True), tolerance(device)
    data = _with_lengths(_data(), MIXED_LENGTHS)
    monkeypatch.setattr(fsdp, "forward_cost_tokens", lambda *_: fsdp.FORWARD_COST_TOKENS)  # chunk the tiny model
    with fp32_strict():
        chunked, g_chunked, _, _ = _train_once(config, data, device)
        monkeypatch.setattr(fsdp, "forward_chunks", lambda lengths, cost: [list(range(len(lengths)))])
        padded, g_padded, _, _ = _train_once(config, data, device)
    assert g_padded.abs().max().item() > 0
    assert (g_chunked - g_padded).abs().max().item() < tol
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert chunked[key] == pytest.approx(padded[key], abs=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lora", [False, True])
def test_chunked_lm_head_gives_the_model_heads_log_probs_loss_and_gradients(tiny_checkpoint, device, lora):
    """The response log-probs through the decoder and the chunked head (``ops.linear_logprobs``, the CUDA
    default) equal those of the model's own head, and so do a training step's loss and gradients."""
    config = _config(tiny_checkpoint, calculate_per_token_loss=True, **({"use_lora": True, "lora_rank": 4,
                                                                          "lora_alpha": 8} if lora else {}))
    data = _with_lengths(_data(), MIXED_LENGTHS)
    results = []
    for chunk in (0, 5):  # the model's head; chunks of 5 response rows
        trainer, _ = _trainer(config, device=device)
        trainer.backend.head_chunk = chunk
        if chunk:
            assert trainer.backend._plain_head() is not None
        torch.manual_seed(0)
        with fp32_strict():
            metrics = trainer.train(0, _part(data))
            with torch.no_grad():
                outputs = trainer.backend._forward(data["tokens"], data["response_lengths"], 0.7, True)
        results.append((metrics, _flat_grads(trainer), outputs))
    (m0, g0, o0), (m1, g1, o1) = results
    tol = tolerance(device)
    assert g0.abs().max().item() > 0 and (g1 - g0).abs().max().item() < tol
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm"):
        assert m1[key] == pytest.approx(m0[key], abs=tol), key
    for key in ("log_probs", "entropy"):
        assert max((a - b).abs().max().item() for a, b in zip(o1[key], o0[key])) < tol, key


def test_sample_mean_loss_value_by_hand(tiny_checkpoint):
    """At the old policy the ratio is 1, so pg_loss = -(1/B) sum_i A_i * (mask tokens of i) / D_i."""
    data = _data()
    metrics, _, _, _ = _train_once(_config(tiny_checkpoint), data)
    per_rollout: dict[int, int] = {}
    for rid, m in zip(data["rollout_ids"], data["loss_masks"]):
        per_rollout[rid] = per_rollout.get(rid, 0) + sum(m)
    live = [rid for rid, d in per_rollout.items() if d > 0]
    expected = -sum(r * sum(m) / max(per_rollout[rid], 1)
                    for r, m, rid in zip(data["rewards"], data["loss_masks"], data["rollout_ids"])) / len(live)
    assert metrics["train/pg_loss"] == pytest.approx(expected, abs=1e-6)


def test_throughput_counts_every_trained_token_and_its_model_flops(tiny_checkpoint):
    from transformers import AutoConfig

    from slimecore.trainers.flops import forward_flops

    data = _data()
    metrics, _, _, _ = _train_once(_config(tiny_checkpoint), data)
    tokens = sum(len(t) for t in data["tokens"])
    flops = 3 * forward_flops(AutoConfig.from_pretrained(tiny_checkpoint), [len(t) for t in data["tokens"]],
                              head_tokens=sum(data["response_lengths"]))
    seconds = tokens / metrics["perf/actor_train_tok_per_s"]
    assert seconds > 0
    assert metrics["perf/actor_train_tflops"] == pytest.approx(flops / seconds / 1e12, rel=1e-9)


# -- (b) DP world 2 equals world 1 ----------------------------------------------------------------------


def _whiten_case():
    return torch.tensor([1.0, 4.0, 2.0, 7.0, -3.0, 0.5]), torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])


def _per_rank(rank, world, checkpoint):
    config = _config(checkpoint)
    results = {}
    for shard in (False, True):  # replica + all-reduce, and FSDP2 fully_shard
        for name, data in (("batch", _data()), ("one_sample", _data(n=1))):
            torch.manual_seed(0)
            trainer, _ = _trainer(config, dp_size=world, rank=rank, shard=shard)
            metrics = trainer.train(0, _part(data, dp_size=world, rank=rank, micro_batch_size=1))
            # numpy, not tensors: torch's queue would share tensor memory that dies with this process
            results[(shard, name)] = (metrics["train/loss"], metrics["train/grad_norm"],
                                      _flat_grads(trainer).cpu().numpy(), _flat_weights(trainer).cpu().numpy())
            if (shard, name) == (False, "batch"):
                results["tokens_per_tflop"] = (metrics["perf/actor_train_tok_per_s"] /
                                               metrics["perf/actor_train_tflops"])
    # whitening over both ranks' halves equals whitening the whole (rank 1's half is fully masked here too)
    values, mask = _whiten_case()
    half = slice(0, 3) if rank == 0 else slice(3, 6)
    results["whiten"] = distributed_masked_whiten(values[half], mask[half]).cpu().numpy()
    return results


def test_two_dp_ranks_give_the_same_loss_and_gradients_as_one(tiny_checkpoint):
    expected = {}
    for name, data in (("batch", _data()), ("one_sample", _data(n=1))):
        metrics, grads, trainer, _ = _train_once(_config(tiny_checkpoint), data, micro_batch_size=3)
        expected[name] = (metrics["train/loss"], metrics["train/grad_norm"], grads, _flat_weights(trainer))
        if name == "batch":
            expected["tokens_per_tflop"] = metrics["perf/actor_train_tok_per_s"] / metrics["perf/actor_train_tflops"]
    whole = masked_whiten(*_whiten_case())
    for rank, by_case in enumerate(run_ranks(_per_rank, str(tiny_checkpoint))):
        half = slice(0, 3) if rank == 0 else slice(3, 6)
        assert (torch.from_numpy(by_case.pop("whiten")) - whole[half]).abs().max().item() < 1e-6
        # the same global tokens and FLOPs as one process, but TFLOP/s per rank: half of them per rank
        assert by_case.pop("tokens_per_tflop") == pytest.approx(2 * expected["tokens_per_tflop"], rel=1e-9)
        for (shard, name), (loss, norm, grads, weights) in by_case.items():
            want_loss, want_norm, want_grads, want_weights = expected[name]
            assert loss == pytest.approx(want_loss, abs=1e-6), (shard, name)
            assert norm == pytest.approx(want_norm, abs=1e-6), (shard, name)
            assert (torch.from_numpy(grads) - want_grads.cpu()).abs().max().item() < 1e-6, (shard, name)
            assert (torch.from_numpy(weights) - want_weights.cpu()).abs().max().item() < 1e-6, (shard, name)


# -- (e) save / load -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_save_load_round_trip_continues_identically(tiny_checkpoint, tmp_path, device):
    config = _config(tiny_checkpoint, lr_warmup_iters=3, lr_decay_style="cosine", train_iters=10, min_lr=1e-4)
    # the CPU repeats itself to the bit; CUDA's atomic-add backward (embedding) only to rounding
    exact = device == "cpu"
    trainer, first_plugin = _trainer(config, device=device)
    first_part = _part(_data(seed=1, rollout_log_probs=True), rollouts_per_step=3)
    first = trainer.train(0, first_part)
    # sample mean over step 0 of |old log-prob - rollout log-prob| (rollout log-probs are all -1 here)
    seen, step0 = first_plugin.seen[0], first_part["steps"][0]
    expected_diff = sum(((seen["log_probs"][i] + 1).abs() * seen["loss_masks"][i]).sum().item()
                        / max(seen["rollout_mask_sums"][i], 1) for mb in step0["micro_batches"] for i in mb)
    assert first["train/train_rollout_logprob_abs_diff"] == pytest.approx(expected_diff / step0["num_rollouts"])
    assert len(first_part["steps"]) == 2 and first["train/lr"] > 0
    trainer.backend.save(str(tmp_path / "ckpt"))
    assert {"model.safetensors", "config.json", "optimizer.pt", "rng_rank0.pt"} <= {
        p.name for p in (tmp_path / "ckpt").iterdir()}
    rng_after_save = torch.get_rng_state()
    part = _part(_data(seed=2))
    expected = trainer.train(1, copy.deepcopy(part))

    fresh, plugin = _trainer(config, device=device)
    torch.manual_seed(123)  # disturbed on purpose: load must restore the RNG
    fresh.backend.load(str(tmp_path / "ckpt"))
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    got = fresh.train(1, copy.deepcopy(part))
    train_keys = {k for k in expected if k.startswith("train/")}  # perf/* timings differ run to run
    assert {k: got[k] for k in train_keys} == pytest.approx({k: expected[k] for k in train_keys},
                                                            abs=1e-7 if exact else tolerance(device))
    diff = (_flat_weights(fresh) - _flat_weights(trainer)).abs().max().item()
    assert diff == 0 if exact else diff < tolerance(device)
    assert all(v.device.type == device for state in fresh.backend.optimizer.state.values() for v in state.values())
    # the reference policy is still the initial checkpoint, not the loaded weights
    initial, _ = _trainer(config, device=device)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in
               zip(plugin.seen[0]["ref_log_probs"], initial.compute_log_probs(part)))
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in
                   zip(plugin.seen[0]["ref_log_probs"], plugin.seen[0]["log_probs"]))


# -- (f) LoRA -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_lora_trains_adapters_and_exports_merged_weights(tiny_checkpoint, device):
    from transformers import AutoModelForCausalLM

    config = _config(tiny_checkpoint, use_lora=True, lora_rank=4, lora_alpha=8, lr=1e-2)
    trainer, plugin = _trainer(config, device=device)
    base_before = {n: p.detach().clone() for n, p in trainer.backend.model.named_parameters() if not p.requires_grad}
    trainer.train(0, _part(_data()))
    trainable = [n for n, p in trainer.backend.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    batch = plugin.seen[0]  # with LoRA the reference is the model with adapters disabled (B = 0 at start)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(batch["log_probs"], batch["ref_log_probs"]))

    merged = trainer.backend.named_weights()
    assert all(torch.equal(p, base_before[n]) for n, p in trainer.backend.model.named_parameters() if n in base_before)
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint))
    original = {k: v.clone() for k, v in plain.state_dict().items()}
    assert set(merged) == set(original) and all(v.device.type == "cpu" for v in merged.values())
    plain.load_state_dict(merged)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    trainer.backend.model.eval()
    with torch.no_grad(), fp32_strict():  # the adapters' own matmuls against the merged weight: 10 x the tolerance
        lora = trainer.backend.model(input_ids=ids.to(trainer.backend.device)).logits.cpu()
        assert (lora - plain(input_ids=ids).logits).abs().max().item() < 10 * tolerance(device)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           original["model.layers.0.self_attn.q_proj.weight"])


def test_lora_save_load_and_bf16_gradient_checkpointing_smoke(tiny_checkpoint, tmp_path):
    config = _config(tiny_checkpoint, use_lora=True, lora_rank=4, lora_alpha=8, lr=1e-2, bf16=True,
                     gradient_checkpointing=True)
    trainer, _ = _trainer(config)
    metrics = trainer.train(0, _part(_data()))
    assert all(v == v for v in metrics.values())  # no NaN
    trainer.backend.save(str(tmp_path / "lora"))
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()
    fresh, _ = _trainer(config)
    fresh.backend.load(str(tmp_path / "lora"))
    assert torch.equal(_flat_weights(fresh), _flat_weights(trainer))


# -- dropout ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_is_off_so_the_train_forward_equals_the_old_policy(tmp_path, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # GPT-2 configs default to 0.1 for attention, residual and embedding dropout
    gpt2 = GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(gpt2).save_pretrained(tmp_path)
    trainer, _ = _trainer(_config(tmp_path), device=device)
    assert {k: v for k, v in trainer.backend.model.config.to_dict().items() if "pdrop" in k} == {
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    trainer.backend.model.train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]], device=device)
    with torch.no_grad():
        assert torch.equal(trainer.backend.model(input_ids=ids).logits, trainer.backend.model(input_ids=ids).logits)


# -- LR schedule ---------------------------------------------------------------------------------------


def test_lr_schedule_shapes():
    def f(**kw):
        cfg = types.SimpleNamespace(**{"lr": 1.0, "min_lr": 0.1, "lr_warmup_iters": 2, "train_iters": 6,
                                       "lr_decay_style": "linear"} | kw)
        return [round(lr_lambda(cfg)(it), 6) for it in range(8)]

    assert f() == [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]
    assert f(lr_decay_style="cosine")[2:] == [1.0, pytest.approx(0.1 + 0.9 * 0.5 * (1 + 0.7071068), abs=1e-6),
                                             0.55, pytest.approx(0.1 + 0.9 * 0.5 * (1 - 0.7071068), abs=1e-6),
                                             0.1, 0.1]
    assert f(lr_decay_style="constant") == [0.5] + [1.0] * 7
    assert f(train_iters=None) == [0.5] + [1.0] * 7


def _optimizer_tensors(backend) -> dict:
    """Every tensor of the optimizer's state, by (parameter index, key): fused AdamW's ``step`` included."""
    index = {id(p): i for i, p in enumerate(backend.params)}
    return {(index[id(p)], key): value for p, state in backend.optimizer.state.items()
            for key, value in state.items() if isinstance(value, torch.Tensor)}


@pytest.mark.parametrize("device", DEVICES)
def test_offload_round_trip_keeps_weights_grads_and_optimizer_state(tiny_checkpoint, device):
    """--offload-train: every parameter, gradient and optimizer state tensor (fused AdamW's ``step`` too) goes to
    the CPU and back unchanged, and the exported weights buckets stay within the buffer size. On the CPU both
    moves stay there, so the move itself is observed by sending a second backend to the meta device."""
    config = _config(tiny_checkpoint)
    data = _data()
    _, grads, trainer, _ = _train_once(config, data, device)
    weights = _flat_weights(trainer)
    state = {k: v.clone() for k, v in _optimizer_tensors(trainer.backend).items()}
    assert {key for _, key in state} == {"step", "exp_avg", "exp_avg_sq"}
    assert len(state) == 3 * len(trainer.backend.params)
    trainer.backend.offload()
    assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in trainer.backend.params)
    assert all(v.device.type == "cpu" for v in _optimizer_tensors(trainer.backend).values())
    trainer.backend.onload()
    assert all(p.device.type == device and p.grad.device.type == device for p in trainer.backend.params)
    assert all(v.device.type == device for v in _optimizer_tensors(trainer.backend).values())
    assert torch.equal(_flat_weights(trainer), weights) and torch.equal(_flat_grads(trainer), grads)
    assert all(torch.equal(v, state[k]) for k, v in _optimizer_tensors(trainer.backend).items())
    trainer.train(1, _part(_data(seed=3)))  # the fused kernel finds its step counters where the parameters are

    _, _, other, _ = _train_once(config, data, device)
    other.backend._move_to(torch.device("meta"))
    moved = _optimizer_tensors(other.backend)
    assert moved.keys() == state.keys() and all(v.device.type == "meta" for v in moved.values())
    # (a move to meta makes new Parameter objects, so read them from the model; the optimizer's stay keyed by the old)
    assert all(p.device.type == "meta" and p.grad.device.type == "meta" for p in other.backend.model.parameters())
    buckets = list(trainer.backend.hf_weight_buckets(64 * 1024))
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    assert len(buckets) > 1 and all(s <= 64 * 1024 or len(b) == 1 for s, b in zip(sizes, buckets))
    names = [n for b in buckets for n, _ in b]
    assert len(names) == len(set(names)) and "model.embed_tokens.weight" in names
