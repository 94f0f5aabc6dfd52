"""Field names of SGLang's own request and argument classes, read from the installed ``sglang`` package.

``ServerArgs`` (``sglang.srt.server_args``) and the request classes of ``sglang.srt.managers.io_struct``
(``UpdateWeightsFromTensorReqInput``, ...) are read from their source with ``ast``, without importing
sglang: its import pulls triton, torchvision and CUDA kernels, which a CPU machine (or the driver, before
Ray starts) should not need. A class's fields are its annotated class attributes and those of its bases
in the same module, as for a dataclass or a msgspec ``Struct``.

``check_server_args`` holds the run's ``--sglang-*`` arguments against ``ServerArgs`` while the config is
parsed, before Ray starts: ``slimecore.config`` reads this module, so it stands beside the config (as
``megatron_args`` does), not among the engines.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from pathlib import Path

from slimecore.errors import ConfigError


def sglang_root() -> Path | None:
    """The installed ``sglang`` package directory (found without importing it), or None."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=None)
def class_fields(module: str, class_name: str) -> dict[str, bool] | None:
    """``{field: required}`` of ``module.class_name`` in the installed sglang (``module`` relative to the
    package, e.g. ``srt.server_args``); None when sglang is not installed."""
    root = sglang_root()
    if root is None:
        return None
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    classes = {node.name: node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    if class_name not in classes:
        raise LookupError(f"sglang {path} has no class {class_name}")

    def fields(name: str) -> dict[str, bool]:
        node, out = classes[name], {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                annotation = ast.unparse(stmt.annotation)
                if not annotation.startswith("ClassVar"):
                    out[stmt.target.id] = stmt.value is None
        return out

    return fields(class_name)


def server_args_fields() -> dict[str, bool] | None:
    """SGLang's ``ServerArgs`` fields, or None when sglang is not installed."""
    return class_fields("srt.server_args", "ServerArgs")


# ServerArgs fields slime-core sets itself, and the flag that sets each
OWNED = {"model_path": "--hf-checkpoint", "tp_size": "--rollout-num-gpus-per-engine", "base_gpu_id": "placement",
         "host": "the run (127.0.0.1, or the node address on a multi-node run)", "port": "a free port",
         "random_seed": "--seed", "enable_memory_saver": "--offload-rollout", "api_key": "the run's own key",
         "skip_server_warmup": "slime-core (always on)", "enable_return_routed_experts": "--use-rollout-routing-replay"}


def overrides(config) -> dict:
    """``--sglang-<field>`` values, then the ``--sglang-config`` YAML mapping over them."""
    values = dict(config.sglang_args)
    if config.sglang_config:
        import yaml

        path = Path(config.sglang_config)
        if not path.is_file():
            raise ConfigError(f"--sglang-config {path}: no such file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--sglang-config {path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--sglang-config {path}: expected a mapping of SGLang ServerArgs fields, got "
                              f"{type(data).__name__}")
        if "sglang" in data:  # slime's server-group form
            data = server_group_overrides(config, path, data)
        values.update({str(k).replace("-", "_"): v for k, v in data.items()})
    return values


def server_group_overrides(config, path, data: dict) -> dict:
    """slime's ``--sglang-config`` form (``sglang: [{name, model_path, num_gpus_per_engine, update_weights,
    server_groups: [{worker_type, num_gpus, num_gpus_per_engine, overrides}]}]``) as the engines' ServerArgs
    overrides: read when it describes what slime-core runs (one model, the trained one, in regular groups that
    share one engine size and one set of overrides, on --rollout-num-gpus devices); any other layout is refused
    with one line saying which part."""
    where = f"--sglang-config {path}"
    models = data.get("sglang")
    if not isinstance(models, list) or len(models) != 1 or not isinstance(models[0], dict):
        raise ConfigError(f"{where}: slime-core runs one model's engines (the trained one); this file lists "
                          f"{len(models) if isinstance(models, list) else 'no list of'} models under 'sglang'. Keep "
                          "one entry, or give its ServerArgs as a flat mapping")
    model = models[0]
    if model.get("update_weights") is False or model.get("model_path") not in (None, config.hf_checkpoint):
        raise ConfigError(f"{where}: model {model.get('name')!r} is not the trained policy (model_path or "
                          "update_weights: false); slime-core's engines serve the policy only (a frozen model is a "
                          "reward plugin's own server)")
    groups = model.get("server_groups") or model.get("engine_groups") or []
    kinds = sorted({g.get("worker_type") for g in groups} - {"regular"})
    if not groups or kinds:
        raise ConfigError(f"{where}: worker_type {', '.join(map(str, kinds)) or '(no server_groups)'} is not "
                          "supported (no prefill/decode/encoder disaggregation or placeholder groups); use "
                          "regular groups")
    sizes = {g.get("num_gpus_per_engine") or model.get("num_gpus_per_engine") or config.rollout_num_gpus_per_engine
             for g in groups}
    overrides = [g.get("overrides") or {} for g in groups]
    if len(sizes) != 1 or any(o != overrides[0] for o in overrides):
        raise ConfigError(f"{where}: the server groups differ in num_gpus_per_engine or overrides; slime-core runs "
                          "identical engines: give one group (or groups with the same settings)")
    gpus = sum(int(g.get("num_gpus", 0)) for g in groups)
    if sizes != {config.rollout_num_gpus_per_engine} or gpus != config.rollout_num_gpus:
        raise ConfigError(f"{where}: its groups take {gpus} GPUs in engines of {sizes.pop()}, but --rollout-num-gpus "
                          f"is {config.rollout_num_gpus} and --rollout-num-gpus-per-engine "
                          f"{config.rollout_num_gpus_per_engine}; make them agree")
    return {k: v for k, v in overrides[0].items() if k != "model_path"}


def check_server_args(config) -> None:
    """Every SGLang argument is a ``ServerArgs`` field slime-core does not set itself (before Ray starts)."""
    values = overrides(config)
    for key in values:
        if key in OWNED:
            raise ConfigError(f"--sglang-{key.replace('_', '-')}: slime-core sets {key} itself from {OWNED[key]}; "
                              "drop the flag")
    fields = server_args_fields()
    if fields is None:
        return  # sglang is not installed here: the server checks its arguments where it runs
    for key in values:
        if key not in fields:
            hint = difflib.get_close_matches(key, fields, n=1)
            where = f"--sglang-config {config.sglang_config}" if key not in config.sglang_args else "the command line"
            raise ConfigError(f"--sglang-{key.replace('_', '-')} (from {where}): SGLang's ServerArgs has no field "
                              f"{key!r}" + (f"; did you mean {hint[0]!r} (--sglang-{hint[0].replace('_', '-')})?"
                                            if hint else ""))
