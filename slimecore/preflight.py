"""Checks made in the driver before Ray starts, so bad input fails in seconds with one message instead of
inside an actor minutes later: the hooks' signatures, ``--hf-checkpoint``, the prompt and eval files, the
reward type of your own data, ``--load`` against the model, ``--save`` and ``--log-dir``, and the placement
of a run that starts its own Ray instance without GPUs. On a cluster it joins (or with GPUs),
``slimecore.raytools.check_placement`` compares what the run asks for with what the cluster has once Ray is up.

Each check raises ``ConfigError`` (or ``PluginError`` for a plugin) whose message names the file, row, key,
flag or plugin and says what to do. ``check_before_ray`` runs them all; the CLI calls it before importing the
loop (Ray and the rest), ``slimecore.loop.run`` when its caller did not.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from slimecore.config import CORE_BY_NAME, Config, ConfigError, may_have_gpus
from slimecore.plugins import Hooks, PluginError

ROWS_RENDERED = 16  # rows whose chat template is rendered in the driver (the keys of every row are checked)
LOCK_FILE = ".slimecore-run.pid"
log = logging.getLogger("slimecore.preflight")


def check_before_ray(config: Config, hooks: Hooks, roles: list):
    """Every check, the ones that read only small files first, so their errors come before the model's files
    are opened (transformers and a meta-device model: the slowest check). ``roles``: the declared training
    roles (``slimecore.trainers.roles.declared_roles``), whose ranks the placement must hold. Returns the
    checked tokenizer, which ``slimecore.loop.run`` ships to the rollout manager instead of loading it twice."""
    check_hook_signatures(hooks)
    if config.save:
        check_writable(config.save, "--save")
    check_writable(config.log_dir, "--log-dir")
    files = check_prompt_files(config, hooks)
    check_reward_type(config, hooks)
    check_reward_service(config)
    if config.starts_engines:
        check_router_installed()
    check_local_placement(config, roles)
    tokenizer = check_hf_checkpoint(config)
    render_prompts(config, tokenizer, files)
    if config.load:
        check_load(config)
    claim_log_dir(config.log_dir)
    return tokenizer


def check_local_placement(config: Config, roles: list) -> None:
    """A run that starts its own Ray instance gets this machine's CPUs (``raytools.init_ray``): without GPUs its
    placement is known before Ray starts, and one the machine cannot hold fails here instead of after
    ``ray.init``. On GPUs and on a cluster it joins, ``create_placement`` checks it once Ray is up."""
    from slimecore.raytools import check_placement, cpu_bundles, joins_cluster, local_cpus

    if joins_cluster(config) or may_have_gpus():
        return
    bundles, _, _, what = cpu_bundles(config, [role.name for role in roles])
    check_placement(bundles, what, nodes=[{"CPU": float(local_cpus())}])


def check_router_installed() -> None:
    """The sglang-router's compiled part (``sglang_router.sglang_router_rs``), which the rollout manager's router
    process runs: without it that process dies at start-up with an engine already loading."""
    import importlib.util

    try:
        found = importlib.util.find_spec("sglang_router.sglang_router_rs") is not None
    except ImportError:  # no sglang_router package at all
        found = False
    if not found:
        raise ConfigError("the sglang-router package or its compiled router (sglang_router.sglang_router_rs) is not "
                          "installed in this environment, and the rollout needs it in front of the engines; "
                          "pip install --force-reinstall 'sglang-router>=0.3'")


def check_hook_signatures(hooks: Hooks) -> None:
    """Every active plugin's hookimpls against their specs (``async def`` where the spec awaits), so a sync
    ``def slime_reward`` fails here, blamed on its plugin, not after the first rollout on the caller."""
    from slimecore.testing.contract import ContractError, check_plugin_contract

    for info in hooks.plugins:
        if info.is_default or not info.hooks:
            continue
        try:
            check_plugin_contract(info.module)
        except ContractError as exc:
            raise PluginError(f"plugin {info.name!r} ({info.location or info.origin}): {exc}; see "
                              "`slime-core hooks` for each hook's signature") from None


def check_hf_checkpoint(config: Config):
    """``config.json`` loads, the weights match it (names and shapes), the tokenizer loads; returns the tokenizer.

    What transformers made of ``config.json`` and the tokenizer files is kept in the cache for those files and
    library versions (``slimecore.hf_checkpoint.kept_checks``): a later run of the same model reads it instead
    of importing transformers' model code. The weights on disk are read and compared every time."""
    from slimecore.hf_checkpoint import (CheckedFiles, keep_checks, kept_checks, load_tokenizer,
                                         read_safetensors_shapes, ship_tokenizer, weights_mismatch)

    path = Path(config.hf_checkpoint)
    has_safetensors = any(path.glob("*.safetensors"))
    kept = kept_checks(path)
    if kept is None or (has_safetensors and kept.shapes is None):
        hf_config = _load_hf_config(path)
        expected = _expected_shapes(path, hf_config) if has_safetensors else None
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    else:
        expected, tied = kept.shapes, kept.tied
    _check_shards(path)
    if has_safetensors:
        try:
            found = read_safetensors_shapes(path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--hf-checkpoint {path}: the *.safetensors cannot be read ({exc}); the file is "
                              "corrupt or truncated, copy it again") from None
        problem = weights_mismatch(path, found, expected, tied)
        if problem:
            raise ConfigError(f"--hf-checkpoint {path}: {problem}")
    try:
        tokenizer = load_tokenizer(path, shipped=kept.tokenizer if kept else None)
    except Exception as exc:  # transformers raises many kinds here
        raise ConfigError(f"--hf-checkpoint {path}: the tokenizer cannot be loaded ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:300]}); restore tokenizer.json / tokenizer_config.json") from None
    if kept is None or kept.shapes != expected:
        keep_checks(path, CheckedFiles(expected, tied, ship_tokenizer(tokenizer)))
    return tokenizer


def _load_hf_config(path: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--hf-checkpoint {path}: config.json cannot be loaded ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:300]}); restore it from the model's original files") from None


def _expected_shapes(path: Path, hf_config) -> dict[str, tuple[int, ...]]:
    from slimecore.convert import ConvertError, hf_tensor_shapes

    try:
        return hf_tensor_shapes(hf_config)
    except ConvertError as exc:
        raise ConfigError(f"--hf-checkpoint {path}: {exc}") from None
    except Exception as exc:  # the model's own code, run on the meta device
        raise ConfigError(f"--hf-checkpoint {path}: transformers cannot build the model config.json describes "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); check config.json against "
                          "the model's original files and the installed transformers") from None


def _check_shards(path: Path) -> None:
    """Every shard ``model.safetensors.index.json`` lists is there."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"--hf-checkpoint {path}: {index.name} is not a weights index ({exc}); restore it "
                          "or delete it if model.safetensors holds every tensor") from None
    missing = sorted(s for s in shards if not (path / s).is_file())
    if missing:
        raise ConfigError(f"--hf-checkpoint {path}: {index.name} lists {len(missing)} shard(s) that are not there "
                          f"({', '.join(missing[:3])}); copy the missing files")


def _uses_default(hooks: Hooks, hook: str) -> bool:
    return hooks.is_default(hooks.answerer(hook))


def check_prompt_files(config: Config, hooks: Hooks) -> list[tuple[str, list, str, str | None, bool]]:
    """The prompt file (when the built-in data source reads it) and every eval file: they exist and parse, the
    slice selects rows, every row has the keys and well-formed chat messages. Returns, per file, what
    ``render_prompts`` needs: (spec, rows, input key, label key, apply chat template)."""
    from slimecore.data.dataset import DataError, parse_row, read_rows
    from slimecore.data.source import TASK_PREFIX
    from slimecore.rollout.evaluation import eval_datasets

    files = []
    if config.prompt_data and _uses_default(hooks, "slime_data_source") and not config.load_debug_rollout_data:
        files.append((config.prompt_data, config.input_key, config.label_key, config.apply_chat_template))
    if config.eval_prompt_data or config.eval_config:
        for dataset in eval_datasets(config):
            if not dataset.path.startswith(TASK_PREFIX):
                c = dataset.apply(config)
                files.append((dataset.path, c.eval_input_key or c.input_key, c.eval_label_key or c.label_key,
                              config.apply_chat_template))
    checked = []
    for spec, input_key, label_key, chat in files:
        try:
            rows = read_rows(spec)
            for where, row in rows:
                parse_row(where, row, input_key=input_key, label_key=label_key, metadata_key=config.metadata_key,
                          tool_key=config.tool_key, apply_chat_template=chat)
        except DataError as exc:
            raise ConfigError(str(exc)) from None
        checked.append((spec, rows, input_key, label_key, chat))
    return checked


def render_prompts(config: Config, tokenizer, files: list[tuple[str, list, str, str | None, bool]]) -> None:
    """The first rows of each checked file rendered into prompts (the chat template, the tokenizer)."""
    from slimecore.data.dataset import DataError
    from slimecore.data.source import prompts_from_rows

    shortest = None
    for spec, rows, input_key, label_key, chat in files:
        try:
            records, _ = prompts_from_rows(config, tokenizer, rows[:ROWS_RENDERED], spec, input_key=input_key,
                                           label_key=label_key, apply_chat_template=chat)
        except DataError as exc:
            raise ConfigError(str(exc)) from None
        shortest = min([len(r["tokens"]) for r in records] + ([shortest] if shortest is not None else []))
    check_response_len(config, shortest or 0)


def check_response_len(config: Config, prompt_tokens: int) -> None:
    """``--rollout-max-response-len`` (and the eval one) fit in the context after the shortest checked prompt
    (``prompt_tokens``): the engine would otherwise stop every response at the context's end, unsaid."""
    from slimecore.data.source import context_len

    context, source = context_len(config)
    for name in ("rollout_max_response_len", "eval_max_response_len"):
        value, flag = getattr(config, name), "--" + name.replace("_", "-")
        if not (context and value and value + prompt_tokens > context):
            continue
        room = context - prompt_tokens
        message = (f"{flag} {value} does not fit the model's context of {context} tokens ({source})"
                   + (f" after a prompt of {prompt_tokens} tokens (the shortest checked)" if prompt_tokens else "")
                   + f": responses would stop at {room} tokens. Give {flag} {room} or less")
        if value != CORE_BY_NAME[name].default:
            raise ConfigError(message)
        log.warning("%s (the default)", message)  # a small model under the default length: still runs


def check_reward_service(config: Config) -> None:
    """``--rm-type remote_rm``: something listens at ``--rm-url`` (a closed port would otherwise be retried with
    backoff for every sample of the first step before the run stops)."""
    import socket
    from urllib.parse import urlsplit

    if not (config.rm_type and config.rm_type.removeprefix("boxed_") == "remote_rm" and config.rm_url):
        return
    url = urlsplit(config.rm_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=5).close()
    except OSError as exc:
        raise ConfigError(f"--rm-url {config.rm_url}: the reward service cannot be reached at {url.hostname}:{port} "
                          f"({exc.strerror or exc}); start it, or fix --rm-url") from None


def check_reward_type(config: Config, hooks: Hooks) -> None:
    """Your own prompts scored by the built-in reward need a reward type: ``--rm-type`` or ``rm_type`` in every
    row's metadata. (Built-in tasks bring their own.)"""
    from slimecore.data.dataset import read_rows

    if config.rm_type or not config.prompt_data or not _uses_default(hooks, "slime_reward"):
        return
    if not _uses_default(hooks, "slime_data_source") or not config.starts_engines:
        return  # a plugin's data source may set rm_type itself
    key = config.metadata_key
    for where, row in read_rows(config.prompt_data):
        metadata = row.get(key) if key else None
        if isinstance(metadata, str):
            metadata = json.loads(metadata) if metadata.strip().startswith("{") else None
        if not (isinstance(metadata, dict) and metadata.get("rm_type")):
            raise ConfigError(f"{where}: no reward type for your own data: --rm-type is not set and the row's "
                              f"{key!r} has no 'rm_type'. Set --rm-type (math, deepscaler, dapo, f1, gpqa, "
                              "remote_rm --rm-url URL, ...), add rm_type to each row's metadata, or pass a plugin "
                              "with a slime_reward hook (--plugin ./my_reward.py)")


def check_load(config: Config) -> None:
    """Say what ``--load`` resumes (the iteration, the steps left, the incomplete iterations skipped) or that
    the run starts fresh on a missing or empty directory; refuse a checkpoint that already reaches
    ``--num-rollout`` (a total: those steps are done); check (fsdp, full weights) that its tensors have the
    model's shapes."""
    from slimecore import checkpoint

    try:
        point = checkpoint.resume_point(config.load)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    if point.iteration is not None and config.start_rollout_id is None and config.num_rollout is not None \
            and point.next_rollout >= config.num_rollout:
        raise ConfigError(f"--load {config.load}: {checkpoint.iteration_dir(config.load, point.iteration).name} has "
                          f"{point.next_rollout} steps done, which reaches --num-rollout {config.num_rollout}: nothing "
                          "to run. --num-rollout counts every step of the run, those before the checkpoint included; "
                          f"give --num-rollout {point.next_rollout + 1} or more to train on")
    log.info("%s", point.describe(config.num_rollout, config.start_rollout_id))
    if point.iteration is None:
        return
    actor = checkpoint.iteration_dir(config.load, point.iteration) / "actor"
    if config.train_backend != "fsdp" or config.use_lora or not any(actor.glob("model*.safetensors")):
        return
    from slimecore.hf_checkpoint import read_safetensors_shapes

    saved, model = read_safetensors_shapes(actor), read_safetensors_shapes(Path(config.hf_checkpoint))
    differ = [f"{k}: checkpoint {saved[k]}, model {model[k]}" for k in sorted(saved) if k in model and saved[k] != model[k]]
    missing = sorted(set(model) - set(saved) - {"lm_head.weight"})
    if differ or missing:
        raise ConfigError(f"--load {config.load}: {actor} was saved from another model than --hf-checkpoint "
                          f"{config.hf_checkpoint} (" + "; ".join(differ[:4] + [f"missing {m}" for m in missing[:4]])
                          + "). Load a checkpoint of this model, or give the --hf-checkpoint it was trained from")


def check_writable(directory: str, flag: str) -> None:
    """Create ``directory`` and a probe file in it (then remove the probe): fails now, not after the first step."""
    path = Path(directory)
    probe = path / f".slimecore-write-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("probe")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{flag} {directory}: cannot write there ({exc.strerror or exc}); choose a directory "
                          "you can write to") from None


def claim_log_dir(directory: str) -> None:
    """Two runs writing one ``--log-dir`` would interleave their metrics: the second stops, naming the first."""
    lock = Path(directory) / LOCK_FILE
    tmp = lock.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(str(os.getpid()))
    try:
        os.link(tmp, lock)  # atomic: of two runs starting at once, exactly one makes the lock
    except FileExistsError:
        text = lock.read_text().strip()
        if text.isdigit() and int(text) != os.getpid() and _alive(int(text)):
            tmp.unlink()
            raise ConfigError(f"--log-dir {directory} is in use by another run (pid {text}); give this run its own "
                              "--log-dir (and --save), or wait for that one to end") from None
        os.replace(tmp, lock)  # left by a run that ended without releasing it
    else:
        tmp.unlink()


def release_log_dir(directory: str) -> None:
    lock = Path(directory) / LOCK_FILE
    if lock.is_file() and lock.read_text().strip() == str(os.getpid()):
        lock.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
