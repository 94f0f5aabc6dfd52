"""``slime-core convert``: HF <-> Megatron ``torch_dist`` checkpoints through the model bridge, checked before
anything is built. slime's converter once accepted a ``MODEL_ARGS`` that did not match the HF model and wrote a
broken checkpoint without a word (THUDM/slime#1059); here every mismatch is named, by flag, with both values.

``hf-to-megatron`` (HF directory -> ``torch_dist``):
1. ``config.json`` must name an architecture a bridge plugin answers for (``slime_model_bridge``);
2. the Megatron shape the user expects, ``--model PRESET`` (``slime-core models``) and/or slime-style
   ``MODEL_ARGS`` flags (``--num-layers 28 --hidden-size 3584 ...``, a ``scripts/models/*.sh`` file's array),
   must equal the shape read from ``config.json``, field by field. ``MODEL_ARGS`` are read by ``slime-core
   train``'s own Megatron parser (``slimecore.trainers.megatron_args``), so every flag a slime model file sets
   parses here as it does there, and is compared with the bridge's values for ``config.json`` as there;
3. the safetensors must hold every tensor the architecture defines, with the shapes ``config.json`` implies, and
   nothing else (a tied ``lm_head.weight`` may be absent);
4. then the Megatron model is built (TP/PP/EP from the flags; world size from torchrun's environment, else 1), the
   HF weights are loaded through the bridge and ``torch_dist`` is written with ``megatron_checkpoint.json``.
   ``torch_dist`` reshards on load, so a checkpoint converted on one process loads into any TP/PP layout.

``megatron-to-hf`` (a ``torch_dist`` directory written by this command or by the megatron training backend,
``{save}/iter_N/actor``, -> HF safetensors): the checkpoint's recorded shape must equal that of ``--hf-checkpoint``
(the HF directory whose ``config.json`` and tokenizer go with the weights); then the model weights are loaded and
exported under HF names, with the config and tokenizer files copied beside them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable

from slimecore.config import Config, ConfigError
from slimecore.errors import ConvertError
from slimecore.hf_checkpoint import read_safetensors_shapes, weights_mismatch

# slime's converter (tools/convert_hf_to_torch_dist.py) adds these to Megatron's parser. --allgather-cp (in slime's
# glm5 model files) says how context parallelism gathers keys and values in training: the checkpoint is the same
# without it, as in slime's converter. The others have no meaning here: dest -> why, and what to do instead.
CONVERTER_FLAGS = {"--allgather-cp": None,
                   "--custom-model-provider-path": "the model is built by a bridge plugin (slime_model_bridge), not a "
                   "model provider; give --plugin with a plugin that answers for this architecture",
                   "--padded-vocab-size": "the vocabulary is config.json's vocab_size (no padded rows are added)"}
# Switches that change which weights a Megatron model has, with Megatron's value when the flag is absent: slime's
# converter builds the model from MODEL_ARGS, so a file that leaves one out converts into another model. Once the
# MODEL_ARGS give any flag, an absent one counts as this value and is checked like a given one.
WEIGHT_SWITCHES: dict[str, bool] = {"add_qkv_bias": False, "qk_layernorm": False, "untie_embeddings_and_output_weights": False,
                   "swiglu": False, "group_query_attention": False, "multi_latent_attention": False,
                   "add_bias_linear": True, "moe_router_enable_expert_bias": False,
                   "post_self_attn_layernorm": False, "post_mlp_layernorm": False}
# The command's own options (cli/main.py), for the did-you-mean of an unknown argument
OWN_OPTIONS = ("--hf-checkpoint", "--save", "--model", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
               "--expert-model-parallel-size", "--plugin")


# ---------------------------------------------------------------------------------------------------
# The expected shape: presets and MODEL_ARGS
# ---------------------------------------------------------------------------------------------------

def presets(hooks) -> dict[str, tuple[str, Any, str | None]]:
    """Named shapes of the active bridge plugins (a plugin module's ``PRESETS`` mapping): name -> (plugin, shape,
    the slime model file it matches, from the module's ``SLIME_MODEL_FILES``, or None)."""
    found: dict[str, tuple[str, Any, str | None]] = {}
    for impl in hooks.implementers("slime_model_bridge"):
        files = getattr(impl.plugin, "SLIME_MODEL_FILES", None) or {}
        for name, shape in (getattr(impl.plugin, "PRESETS", None) or {}).items():
            found.setdefault(name, (hooks.plugin_name(impl), shape, files.get(name)))
    return found


def parse_model_args(args: Iterable[str]) -> dict[str, Any]:
    """slime-style ``MODEL_ARGS`` -> ``{Megatron dest: value}``, read by the parser ``slime-core train`` uses
    (``slimecore.trainers.megatron_args``: every flag of Megatron-LM's parser and megatron-core's configs, no
    megatron-core import). An unknown argument is an error naming the closest flag."""
    from slimecore.trainers.megatron_args import flag_table, split_megatron_args

    args = list(args)
    for flag, why in CONVERTER_FLAGS.items():
        if why and any(a.partition("=")[0] == flag for a in args):
            raise ConvertError(f"{flag} is not taken: {why}")
    args = [a for a in args if a.partition("=")[0] not in CONVERTER_FLAGS]
    try:
        rest, values = split_megatron_args(args)
    except ConfigError as exc:
        raise ConvertError(str(exc)) from None
    if rest:
        import difflib

        unknown = next((a for a in rest if a.startswith("-")), rest[0])
        hint = difflib.get_close_matches(unknown.partition("=")[0], [*flag_table(), *OWN_OPTIONS], n=1)
        raise ConvertError(f"unknown model argument {unknown!r}" + (f" (did you mean {hint[0]}?)" if hint else "")
                           + "; MODEL_ARGS take Megatron's flags (`slime-core models --show NAME` prints a preset's)")
    return values


def model_args_differences(values: dict[str, Any], hf_config, shape: Any) -> list[str]:
    """``--flag: MODEL_ARGS X, config.json Y`` for every parsed ``MODEL_ARGS`` value that the bridge's
    ``megatron_values()`` (or config.json) states otherwise; an absent weight switch (``WEIGHT_SWITCHES``)
    counts as Megatron's default once any flag describing the model is given (a switch reads under its own name:
    ``--add-bias-linear: MODEL_ARGS True`` for a missing ``--disable-bias-linear``). Megatron settings (the layer
    split over pipeline stages, ``--moe-token-dispatcher-type`` ...) are not compared: they reach the model build
    (``_parallel_config``), as in ``train``."""
    from slimecore.trainers.megatron_args import agrees, checkpoint_value, flag_for

    stated = shape.megatron_values() if callable(getattr(shape, "megatron_values", None)) else {}
    if values.keys() & stated.keys():
        values = {**{dest: default for dest, default in WEIGHT_SWITCHES.items() if dest in stated}, **values}
    out = []
    for name, value in values.items():
        found = checkpoint_value(name, stated, hf_config, shape)
        if found is not None and not agrees(name, value, found[0]):
            flag = "--" + name.replace("_", "-") if isinstance(value, bool) else flag_for(name)
            out.append(f"{flag}: MODEL_ARGS {_shown(value)}, config.json {_shown(found[0])}")
    return out


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{', '.join(map(str, value[:8]))}, ... ({len(value)} values)]"
    return repr(list(value) if isinstance(value, tuple) else value)


def shape_mismatches(actual: Any, expected: dict[str, Any], source: str) -> list[str]:
    return [f"--{k.replace('_', '-')}: {source} {v!r}, config.json {getattr(actual, k)!r}"
            for k, v in expected.items() if getattr(actual, k) != v]


# ---------------------------------------------------------------------------------------------------
# HF side
# ---------------------------------------------------------------------------------------------------

def hf_tensor_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors an HF checkpoint of ``hf_config`` holds on disk (a meta-device model,
    with transformers 5's load-time fusions such as MoE experts reverted to the saved layout).

    Kept in ``$SLIMECORE_CACHE/shapes/`` per config and transformers version: building the meta model imports
    the model's modeling code, seconds of the driver's checks before Ray that the same model pays once."""
    import hashlib

    import transformers

    from slimecore.hf_checkpoint import cache_root, write_atomic

    key = hashlib.sha256(f"{transformers.__version__}\n{hf_config.to_json_string(use_diff=False)}".encode()).hexdigest()
    path = cache_root() / "shapes" / f"{key[:32]}.json"
    try:
        return {name: tuple(shape) for name, shape in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):  # not kept yet (or unreadable): build it
        pass
    shapes = _meta_model_shapes(hf_config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(shapes).encode())
    except OSError:  # a read-only cache: checked again next time
        pass
    return shapes


def _meta_model_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    except ImportError:  # transformers 4: the module's names are the saved names
        pass
    return {name: tuple(t.shape) for name, t in state.items()}


def safetensors_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    if not any(directory.glob("*.safetensors")):
        raise ConvertError(f"{directory} holds no *.safetensors; convert .bin checkpoints with transformers first")
    return read_safetensors_shapes(directory)


def check_hf_weights(directory: Path, hf_config) -> None:
    problem = weights_mismatch(directory, safetensors_shapes(directory), hf_tensor_shapes(hf_config),
                               bool(getattr(hf_config, "tie_word_embeddings", False)))
    if problem:
        raise ConvertError(problem)


def _load_hf_config(directory: Path):
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise ConvertError(f"{directory} has no config.json; give an HF checkpoint directory (save_pretrained layout)")
    return AutoConfig.from_pretrained(str(directory))


def _bridge(hooks, config, hf_config, where: Path):
    from slimecore.trainers.megatron_model import find_bridge  # torch: not for `slime-core models`

    try:
        return find_bridge(config, hooks, hf_config)
    except ConfigError as exc:
        raise ConvertError(f"{where}: {exc}") from None


def _parallel_config(hf_dir: Path, tp: int, pp: int, ep: int, megatron_args: dict | None = None) -> Config:
    """The conversion's config: the parallel sizes, and the ``MODEL_ARGS`` that are Megatron settings (layer split
    over pipeline stages, ``--expert-tensor-parallel-size`` ...), which reach the model build as in ``train``."""
    config = Config.make(hf_checkpoint=str(hf_dir), tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         expert_model_parallel_size=ep)
    return Config.from_dict({**config.to_dict(), "megatron_args": dict(megatron_args or {})})


def _world() -> tuple[int, int]:
    """(rank, world size): the process group already set up (e.g. by a test's ranks), else torchrun's
    environment, else one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


# ---------------------------------------------------------------------------------------------------
# The two commands
# ---------------------------------------------------------------------------------------------------

def check_hf_to_megatron(hf_dir: str | Path, hooks, preset: str | None = None, model_args: Iterable[str] = (),
                         tp: int = 1, pp: int = 1, ep: int = 1):
    """Every check of ``hf-to-megatron`` that needs no Megatron; returns (config, hf_config, shape)."""
    hf_dir = Path(hf_dir)
    values = parse_model_args(model_args)  # first: a mistyped flag is named before any model code loads
    hf_config = _load_hf_config(hf_dir)
    config = _parallel_config(hf_dir, tp, pp, ep, values)
    shape = _bridge(hooks, config, hf_config, hf_dir)
    problems: list[str] = []
    if preset is not None:
        known = presets(hooks)
        if preset not in known:
            raise ConvertError(f"--model {preset!r} is not a preset of the active bridge plugins; known: "
                               f"{', '.join(sorted(known)) or 'none'} (`slime-core models` lists them)")
        import dataclasses

        expected = dataclasses.asdict(known[preset][1])
        problems += shape_mismatches(shape, expected, f"preset {preset}")
    problems += model_args_differences(values, hf_config, shape)
    if problems:
        raise ConvertError(f"{hf_dir}/config.json does not have the Megatron shape you gave; nothing was converted. "
                           "Differences: " + "; ".join(problems))
    check_hf_weights(hf_dir, hf_config)
    return config, hf_config, shape


def hf_to_megatron(hf_dir: str | Path, save: str | Path, hooks, preset: str | None = None,
                   model_args: Iterable[str] = (), tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
    config, _, _ = check_hf_to_megatron(hf_dir, hooks, preset, model_args, tp, pp, ep)
    save = Path(save)
    if (save / "torch_dist").exists() and any((save / "torch_dist").iterdir()):
        raise ConvertError(f"{save}/torch_dist already holds a checkpoint; give an empty --save directory")
    from slimecore.trainers.megatron_model import BridgedModel, init_parallel, write_checkpoint_meta

    rank, world = _world()
    init_parallel(config, rank, world)
    model = BridgedModel.build(config, hooks, str(hf_dir))
    model.save_torch_dist(save)
    if rank == 0:
        write_checkpoint_meta(save, model.bridge, config, iteration=0, optimizer=False, hf_checkpoint=str(Path(hf_dir)))
    if world > 1:  # no rank returns (and e.g. reads the metadata back) before rank 0 has written it
        import torch.distributed as dist

        dist.barrier()
    return save


def check_megatron_to_hf(load: str | Path, hf_dir: str | Path, hooks):
    """Checks of ``megatron-to-hf`` that need no Megatron; returns (config, meta). ``load`` is a checkpoint of the
    megatron backend or ``hf-to-megatron`` (``megatron_checkpoint.json``; meta is what it records) or a Megatron-LM
    one (a root with ``latest_checkpointed_iteration.txt``, or an ``iter_N`` / ``release`` folder; meta is None: it
    records no shape, and its keys and shapes are checked against the model when it loads)."""
    from slimecore.checkpoint_layout import megatron_lm_checkpoint
    from slimecore.trainers.megatron_model import CHECKPOINT_META, check_shape, read_checkpoint_meta

    load, hf_dir = Path(load), Path(hf_dir)
    meta = None
    try:
        if (load / CHECKPOINT_META).is_file() or megatron_lm_checkpoint(load) is None:
            meta = read_checkpoint_meta(load)
    except (FileNotFoundError, ValueError) as exc:
        raise ConvertError(f"--load {load}: {exc}" if isinstance(exc, ValueError) else str(exc)) from None
    hf_config = _load_hf_config(hf_dir)
    config = _parallel_config(hf_dir, 1, 1, 1)
    shape = _bridge(hooks, config, hf_config, hf_dir)
    if meta is not None:
        try:
            check_shape(meta, shape, str(load))
        except ValueError as exc:
            raise ConvertError(f"{exc}; pass the --hf-checkpoint of the model that was trained") from None
    return config, meta


def megatron_to_hf(load: str | Path, hf_dir: str | Path, output: str | Path, hooks,
                   shard_bytes: int = 5 << 30) -> Path:
    config, meta = check_megatron_to_hf(load, hf_dir, hooks)
    load, hf_dir, output = Path(load), Path(hf_dir), Path(output)
    if output.exists() and any(output.glob("*.safetensors")):
        raise ConvertError(f"{output} already holds *.safetensors; give an empty output directory")
    from safetensors.torch import save_file

    from slimecore.engines.weight_sync import bucketize
    from slimecore.trainers.megatron_model import BridgedModel, init_parallel

    rank, world = _world()
    init_parallel(config, rank, world)
    model = BridgedModel.build(config, hooks, str(hf_dir), load_weights=False)
    if meta is None:  # a Megatron-LM checkpoint
        from slimecore.checkpoint_layout import megatron_lm_checkpoint

        model.load_megatron_lm(megatron_lm_checkpoint(load), f"--load {load}")
    else:
        model.load_torch_dist(load)
    shards = []
    for bucket in bucketize(model.hf_weights(), shard_bytes):  # collective: every rank iterates
        if rank == 0:
            shards.append({name: tensor.contiguous() for name, tensor in bucket})
    if rank:
        return output
    output.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(output / "model.safetensors"), metadata={"format": "pt"})
    else:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
                 "weight_map": {}}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(output / file), metadata={"format": "pt"})
            index["weight_map"].update({name: file for name in shard})
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    for file in hf_dir.iterdir():  # config, generation config, tokenizer, chat template
        if file.is_file() and not file.name.endswith((".safetensors", ".bin", ".index.json", ".pt")):
            shutil.copy2(file, output / file.name)
    return output
