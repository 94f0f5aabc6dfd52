"""SGLang's weight-sync protocols end to end: train-side sender -> engine in another process (a Ray actor).

After each protocol the engine's weights equal the sender's bit for bit, and greedy tokens and log-probs
the engine generates match an HF forward of the sender's weights. Request bodies are checked against the
request classes of the installed ``sglang`` wheel (scripts/setup.sh installs it).
"""

from __future__ import annotations

import socket

import pytest
import torch
from fixtures_engine import http_json

from slimecore.engines import weight_sync
from slimecore.sglang_schema import class_fields, sglang_root
from slimecore.trainers.weight_sender import Endpoint, WeightSender, WeightSyncError

PROMPT = [5, 17, 33, 9]


@pytest.fixture(scope="module")
def engine_actor(ray_session, tiny_checkpoint):
    from slimecore.engines.embedded_actors import launch_embedded_engines

    (actor, url), = launch_embedded_engines(1, str(tiny_checkpoint), num_cpus=0.5, timeout=120)
    yield actor, url
    ray_session.get(actor.shutdown.remote(), timeout=30)
    ray_session.kill(actor)


def trainer_model(checkpoint, seed: int):
    """The 'trainer': the checkpoint with every weight moved, so a sync that did nothing is seen."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def check_engine_serves(ray_session, actor, url, model, version: str) -> None:
    named = list(model.state_dict().items())
    assert ray_session.get(actor.weights_digest.remote(), timeout=60) == weight_sync.digest(named)
    status, out = http_json("POST", url + "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                                        "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                            "ignore_eos": True}})
    assert status == 200 and out["meta_info"]["weight_version"] == version
    with torch.no_grad():
        expected = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False,
                                  eos_token_id=None)[0, len(PROMPT):].tolist()
        logits = model(torch.tensor([PROMPT + expected])).logits[0, len(PROMPT) - 1:-1]
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(expected)[:, None]).squeeze(1)
    assert out["output_ids"] == expected
    got = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, logprobs, atol=1e-4)


@pytest.mark.parametrize("transport", ["tensor", "distributed"])
def test_push_reaches_engine_bit_for_bit(ray_session, engine_actor, tiny_checkpoint, transport):
    actor, url = engine_actor
    model = trainer_model(tiny_checkpoint, seed=len(transport))
    sender = WeightSender(bucket_bytes=64 * 1024, timeout=120)  # small buckets: several requests per sync
    try:
        buckets = weight_sync.bucketize(model.state_dict().items(), sender.bucket_bytes)
        figures = sender.push(buckets, [Endpoint(url)], version=f"{transport}-1", transport=transport)
        assert figures["buckets"] > 1
        check_engine_serves(ray_session, actor, url, model, f"{transport}-1")
        if transport == "distributed":  # the group is made once and reused
            group = sender._group
            sender.push(weight_sync.bucketize(model.state_dict().items(), 1 << 30), [Endpoint(url)], "again",
                        transport)
            assert sender._group is group
    finally:
        sender.close()


def test_disk_update_bit_for_bit(ray_session, engine_actor, tiny_checkpoint, tmp_path):
    actor, url = engine_actor
    model = trainer_model(tiny_checkpoint, seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    status, out = http_json("POST", url + "/update_weights_from_disk", weight_sync.disk_body(str(tmp_path), "disk-1"))
    assert status == 200 and out["success"], out
    check_engine_serves(ray_session, actor, url, model, "disk-1")


def test_engine_rejects_bad_weight_requests(engine_actor):
    _, url = engine_actor
    status, out = http_json("POST", url + "/update_weights_from_distributed",
                            {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"})
    assert status == 400 and "init_weights_update_group" in out["message"]
    not_a_pickle = {"serialized_named_tensors": ["bm90IGEgcGlja2xl"]}
    status, out = http_json("POST", url + "/update_weights_from_tensor", not_a_pickle)
    assert status == 400 and out["success"] is False
    status, out = http_json("POST", url + "/update_weights_from_tensor", {"load_format": "flattened_bucket"})
    assert status == 400 and "serialized_named_tensors" in out["message"]
    status, out = http_json("POST", url + "/init_weights_update_group",
                            weight_sync.init_group_body("127.0.0.1", 1, 1, 2, "g", "nccl"))
    assert status == 400 and "gloo" in out["message"]


def test_payload_unpickler_refuses_other_globals():
    import base64
    import os
    import pickle

    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        weight_sync.deserialize(evil)


def test_sender_names_the_engine_that_failed(tiny_checkpoint):
    sender = WeightSender(timeout=5)
    named = [("model.norm.weight", torch.ones(64))]
    with pytest.raises(WeightSyncError, match="127.0.0.1:9/update_weights_from_tensor"):
        sender.push([named], [Endpoint("http://127.0.0.1:9")], "1", "tensor")


# -- SGLang's own request classes ----------------------------------------------------------------------
def check_sglang_body(class_name: str, body: dict) -> None:
    """Every key is a field of SGLang's request class and every required field is there."""
    fields = class_fields("srt.managers.io_struct", class_name)
    unknown = sorted(set(body) - set(fields))
    missing = sorted(k for k, required in fields.items() if required and k not in body)
    assert not unknown and not missing, f"{class_name}: fields SGLang lacks {unknown}, required missing {missing}"


needs_sglang = pytest.mark.skipif(sglang_root() is None, reason="the sglang wheel is not installed (scripts/setup.sh)")


@needs_sglang
def test_request_bodies_are_sglangs():

    named = [("w", torch.zeros(2, 3, dtype=torch.bfloat16))]
    check_sglang_body("UpdateWeightsFromTensorReqInput", weight_sync.tensor_body(["payload"] * 2, "3"))
    check_sglang_body("InitWeightsUpdateGroupReqInput",
                      weight_sync.init_group_body("127.0.0.1", 1234, 1, 3, "g", "gloo"))
    check_sglang_body("UpdateWeightsFromDistributedReqInput", weight_sync.distributed_body(named, "g", "3"))
    check_sglang_body("DestroyWeightsUpdateGroupReqInput", {"group_name": "g"})
    check_sglang_body("UpdateWeightFromDiskReqInput", weight_sync.disk_body("/tmp/x", "3"))
    check_sglang_body("PauseGenerationReqInput", {})
    check_sglang_body("ContinueGenerationReqInput", {})
    check_sglang_body("ReleaseMemoryOccupationReqInput", {})
    check_sglang_body("ResumeMemoryOccupationReqInput", {"tags": ["weights"]})
    assert weight_sync.distributed_body(named, "g", "3")["dtypes"] == ["bfloat16"]  # SGLang does getattr(torch, d)
    with pytest.raises(AssertionError, match="bogus"):
        check_sglang_body("UpdateWeightsFromTensorReqInput", {**weight_sync.tensor_body(["p"], "3"), "bogus": 1})


def test_release_frees_the_weights_and_a_push_brings_them_back(tiny_checkpoint):
    """/release_memory_occupation really lets go of every weight (no tensor in the process holds their
    storage any more); after /resume_memory_occupation the engine refuses to generate until a push has
    written every weight, then serves exactly the pushed weights."""
    import gc

    from slimecore.testing.engines import embedded_engine

    with embedded_engine(tiny_checkpoint) as server:
        url = server.url
        weight_gb = lambda: http_json("GET", url + "/server_info")[1]["internal_states"][0]["memory_usage"]["weight"]
        assert weight_gb() > 0
        storages = {p.untyped_storage().data_ptr() for p in server.model.parameters()}
        assert http_json("POST", url + "/release_memory_occupation", {}) == (200, None)
        gc.collect()
        assert weight_gb() == 0 and all(p.is_meta for p in server.model.parameters())
        alive = [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta
                 and t.untyped_storage().data_ptr() in storages]
        assert not alive  # returned to the allocator
        assert http_json("POST", url + "/generate", {"input_ids": PROMPT})[0] == 400
        assert http_json("POST", url + "/resume_memory_occupation", {"tags": ["weights"]}) == (200, None)
        status, out = http_json("POST", url + "/generate", {"input_ids": PROMPT})
        assert status == 400 and "push the weights first" in out["error"]["message"]
        assert http_json("POST", url + "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})[0] == 200
        model = trainer_model(tiny_checkpoint, seed=9)
        WeightSender(timeout=60).push([list(model.state_dict().items())], [Endpoint(url)], "9", "tensor")
        assert server.weights_digest() == weight_sync.digest(model.state_dict().items()) and weight_gb() > 0
        assert http_json("POST", url + "/generate", {"input_ids": PROMPT})[0] == 200


def test_api_key_guards_every_endpoint_but_health(tiny_checkpoint):
    from slimecore.engines.router import http_json as keyed
    from slimecore.testing.engines import embedded_engine

    with embedded_engine(tiny_checkpoint, api_key="k3y") as server:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
        assert http_json("POST", server.url + "/generate", body) == (401, {"error": "Unauthorized"})
        assert keyed("POST", server.url + "/generate", body, api_key="wrong")[0] == 401
        assert http_json("POST", server.url + "/update_weights_from_tensor", {})[0] == 401
        assert http_json("GET", server.url + "/health")[0] == 200
        assert keyed("POST", server.url + "/generate", body, api_key="k3y")[0] == 200


def test_a_changed_engine_set_gets_a_new_weight_group(tiny_checkpoint):
    """A restarted engine (new URL) joins at the next push: the sender leaves the old group and makes one
    with the current engines."""
    from slimecore.testing.engines import embedded_engine

    model = trainer_model(tiny_checkpoint, seed=11)
    named = list(weight_sync.unique_tensors(model.state_dict().items()))
    sender = WeightSender(timeout=120)
    with embedded_engine(tiny_checkpoint) as first, embedded_engine(tiny_checkpoint) as second:
        try:
            sender.push([named], [Endpoint(first.url)], "1", "distributed")
            old = sender._group_name
            sender.push([named], [Endpoint(first.url), Endpoint(second.url)], "2", "distributed")
            assert sender._group_name != old and not first._weight_groups.get(old)
            expected = weight_sync.digest(model.state_dict().items())
            assert first.weights_digest() == expected and second.weights_digest() == expected
            assert second.weight_version == "2"
        finally:
            sender.close()


def test_kept_shared_buffer_serves_engines_that_join_later(ray_session, tiny_checkpoint):
    """Tensor pushes from one sender (its shared buffer kept across buckets and syncs) to engines in other
    processes: two engines twice, then an engine started later (as one restarted after a fault) together with
    them. Every engine opens the kept buffer and serves the pushed weights bit for bit."""
    from slimecore.engines.embedded_actors import launch_embedded_engines

    engines = launch_embedded_engines(3, str(tiny_checkpoint), num_cpus=0.1, timeout=180)
    sender = WeightSender(bucket_bytes=64 * 1024, timeout=120)
    try:
        for version, members in (("1", engines[:2]), ("2", engines[:2]), ("3", engines), ("4", engines)):
            model = trainer_model(tiny_checkpoint, seed=20 + int(version))
            buckets = weight_sync.bucketize(weight_sync.unique_tensors(model.state_dict().items()),
                                            sender.bucket_bytes)
            sender.push(buckets, [Endpoint(url) for _, url in members], version, "tensor")
            expected = weight_sync.digest(model.state_dict().items())
            for actor, url in members:
                assert ray_session.get(actor.weights_digest.remote(), timeout=60) == expected, (version, url)
                assert http_json("GET", url + "/model_info")[1]["weight_version"] == version
    finally:
        for actor, _ in engines:
            ray_session.kill(actor)


# -- weights the trainer keeps in shared memory ---------------------------------------------------------
def _mapped_bucket(ray_session, actor) -> int:
    """Where the engine has the last pushed bucket's shared memory mapped (an address in its process)."""
    return ray_session.get(actor.__ray_call__.remote(lambda engine: engine.server._mapped_bucket.data_ptr()),
                           timeout=60)


def test_weights_in_shared_memory_reach_every_engine_without_a_copy(ray_session, tiny_checkpoint):
    """The fsdp trainer's layout (weight_sync.share_weights): a push sends spans of the weights themselves
    (the sender makes no copy buffer), every engine serves them bit for bit under the pushed version, and
    the next push after an in-place update (as the optimizer's) reaches the engines through the mapping they
    kept. An engine that cannot be reached is named."""
    from slimecore.engines.embedded_actors import launch_embedded_engines

    model = trainer_model(tiny_checkpoint, seed=30)
    before = weight_sync.digest(model.state_dict().items())
    weight_sync.share_weights(model)
    storages = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
    assert len(storages) == 1
    assert weight_sync.digest(model.state_dict().items()) == before
    engines = launch_embedded_engines(2, str(tiny_checkpoint), num_cpus=0.1, timeout=180)
    endpoints = [Endpoint(url) for _, url in engines]
    sender = WeightSender(bucket_bytes=64 * 1024, timeout=120)
    try:
        mapped = None
        for version in ("1", "2"):
            buckets = weight_sync.bucketize(weight_sync.unique_tensors(model.state_dict().items()), sender.bucket_bytes)
            assert sender.push(buckets, endpoints, version, "tensor")["buckets"] > 1
            assert sender._shared is None  # nothing was copied into a transfer buffer
            expected = weight_sync.digest(model.state_dict().items())
            for actor, url in engines:
                assert ray_session.get(actor.weights_digest.remote(), timeout=60) == expected, (version, url)
                assert http_json("GET", url + "/model_info")[1]["weight_version"] == version
            now = [_mapped_bucket(ray_session, actor) for actor, _ in engines]
            assert mapped is None or now == mapped  # the second push found the first one's mapping
            mapped = now
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(0.9)
        dead = Endpoint("http://127.0.0.1:9")
        buckets = weight_sync.bucketize(weight_sync.unique_tensors(model.state_dict().items()), sender.bucket_bytes)
        with pytest.raises(WeightSyncError, match="127.0.0.1:9/update_weights_from_tensor"):
            sender.push(buckets, [endpoints[0], dead], "3", "tensor")
    finally:
        for actor, _ in engines:
            ray_session.kill(actor)


def test_fsdp_trainer_keeps_pushed_weights_in_shared_memory_but_merges_lora_into_a_copy(tiny_checkpoint):
    """Full fine-tuning on CPU: the policy's weights lie in one shared buffer and its buckets are spans of it.
    LoRA: the merged weights (W + scaling B A) are new tensors, copied once into the sender's buffer; the
    engine serves the merged weights."""
    from slimecore.config import Config
    from slimecore.testing.engines import embedded_engine
    from slimecore.trainers.fsdp import FSDPBackend

    full = FSDPBackend(Config.make(hf_checkpoint=str(tiny_checkpoint)))
    buckets = list(full.hf_weight_buckets(64 * 1024))
    assert len(buckets) > 1 and all(weight_sync.shared_span(bucket) is not None for bucket in buckets)
    assert not FSDPBackend(Config.make(hf_checkpoint=str(tiny_checkpoint),
                                       update_weight_transport="distributed")).params[0].is_shared()

    lora = FSDPBackend(Config.make(hf_checkpoint=str(tiny_checkpoint), use_lora=True, lora_rank=4, lora_alpha=8))
    with torch.no_grad():
        for name, param in lora.model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)  # as after training: the merge changes the weights
    sender = WeightSender(bucket_bytes=64 * 1024, timeout=120)
    with embedded_engine(tiny_checkpoint) as engine:
        sender.push(lora.hf_weight_buckets(64 * 1024), [Endpoint(engine.url)], "lora-1", "tensor")
        assert sender._shared is not None and engine.weight_version == "lora-1"
        merged = lora.named_weights()
        assert engine.weights_digest() == weight_sync.digest(merged.items())
        assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                               full.model.state_dict()["model.layers.0.self_attn.q_proj.weight"])


# -- the weight-sync sentinel (--check-weights) ---------------------------------------------------------
def test_corrupted_sync_names_engine_version_and_tensor(ray_session, engine_actor, tiny_checkpoint):
    """A push whose checksums the engine reports back passes; one tensor changed on the engine side after the
    push stops the check, naming the engine, the weight version and that tensor."""
    from slimecore.weight_check import WeightCheckError, check_engines, checksums

    _, url = engine_actor
    model = trainer_model(tiny_checkpoint, seed=11)
    named = list(weight_sync.unique_tensors(model.state_dict().items()))
    sender = WeightSender(bucket_bytes=64 * 1024, timeout=120)
    figures = sender.push(weight_sync.bucketize(named, sender.bucket_bytes), [Endpoint(url)], "11", "tensor",
                          checksum="all")
    expected = figures["checksums"]
    assert expected == checksums(named) and len(expected) == len(named)
    assert check_engines(expected, [url], "11", every_name=True) == len(named)
    # an engine that died after the sync (nothing listens) is left to the fault monitor, not a stop
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert check_engines(expected, [url, dead], "11", every_name=True) == len(named)

    name = "model.layers.1.mlp.up_proj.weight"
    perturbed = dict(named)[name].clone()
    perturbed[3, 5] += 1e-3  # one value of one tensor
    status, _ = http_json("POST", url + "/update_weights_from_tensor", {
        "serialized_named_tensors": [weight_sync.serialize([(name, perturbed)])], "load_format": "direct"})
    assert status == 200
    with pytest.raises(WeightCheckError) as stopped:
        check_engines(expected, [url], "11", every_name=True)
    assert f"engine {url} does not hold the weights v11" in str(stopped.value)
    assert f"1 tensor(s) differ, first {name}." in str(stopped.value)


@needs_sglang
def test_weights_checker_is_sglangs(engine_actor):
    """The embedded engine's /weights_checker takes SGLang's CheckWeightsReqInput and answers its body:
    ``ranks`` of ChecksumInfo (with ParallelismInfo), ``per_engine_checksum`` over them."""
    import hashlib

    _, url = engine_actor
    request = {"action": "checksum"}
    check_sglang_body("CheckWeightsReqInput", request)
    status, answer = http_json("POST", url + "/weights_checker", request)
    assert status == 200 and answer["success"] is True
    assert set(answer) == {"success", "message", "ranks", "per_engine_checksum"}
    (rank,) = answer["ranks"]
    for class_name, value in (("ChecksumInfo", rank), ("ParallelismInfo", rank["parallelism_info"])):
        assert set(value) == set(class_fields("srt.utils.weight_checker", class_name))
    assert "model.embed_tokens.weight" in rank["checksums"] and not any("inv_freq" in n for n in rank["checksums"])
    assert answer["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    assert http_json("GET", url + "/weights_checker")[1] == answer  # SGLang's GET form: the default action
    status, refused = http_json("POST", url + "/weights_checker", {"action": "reset_tensors"})
    assert status == 400 and refused["success"] is False and "reset_tensors" in refused["message"]
