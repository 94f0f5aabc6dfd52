"""The fate of every flag slime's parser defines (THUDM/slime ``slime/utils/arguments.py`` and
``slime/backends/sglang_utils/arguments.py``): the same meaning here, mapped to slime-core's equivalent, or refused
before Ray starts with the reason and what to use instead. ``docs/slime-flags.md`` is generated from this table and
the flags read out of slime's source (``tests/slime_format/``); ``tests/test_slime_flags.py`` feeds each flag to
``slime-core train``'s parser.

The slime adapter (``slimecore.defaults.slime_compat``) declares each refused flag as an option of its own, so
argparse reads its values as slime would, and refuses it in ``slime_validate_config``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fate:
    """``kind``: ``same``, ``mapped`` or ``refused``. ``text``: for ``mapped`` the mapping, for ``refused`` why.
    ``plugin``: the plugin whose option it is. ``accepted``: values of a refused flag that mean what slime-core
    does anyway (slime's default), which are not refused."""

    kind: str
    text: str = ""
    instead: str = ""
    plugin: str | None = None
    accepted: tuple = ()
    where: str = "core option"  # a same-named flag that is not a core option: Megatron's or SGLang's argument

    def describe(self) -> str:
        if self.kind == "same":
            return (f"option of plugin `{self.plugin}`" if self.plugin else self.where) + \
                (f"; {self.text}" if self.text else "")
        if self.kind == "mapped":
            return self.text
        allowed = f" (accepted: {', '.join(f'`{v}`' for v in self.accepted)})" if self.accepted else ""
        return f"{self.text}; instead: {self.instead}{allowed}"


def _same(names: str, plugin: str | None = None, text: str = "", where: str = "core option") -> dict[str, Fate]:
    return {"--" + name: Fate("same", text, plugin=plugin, where=where) for name in names.split()}


def _refused(why: str, instead: str, *flags: str, accepted: tuple = ()) -> dict[str, Fate]:
    return {flag: Fate("refused", why, instead, accepted=accepted) for flag in flags}


SLIME_FLAGS: dict[str, Fate] = {
    # -- the same name and meaning: core options
    **_same("actor-num-gpus-per-node actor-num-nodes apply-chat-template apply-chat-template-kwargs "
            "calculate-per-token-loss clip-grad colocate debug-rollout-only debug-train-only eval-config "
            "eval-input-key eval-interval eval-label-key eval-max-response-len eval-prompt-data eval-temperature "
            "eval-top-p global-batch-size group-rm hf-checkpoint input-key label-key load load-debug-rollout-data "
            "lr mask-offpolicy-in-partial-rollout max-tokens-per-gpu metadata-key micro-batch-size "
            "n-samples-per-eval-prompt n-samples-per-prompt num-epoch num-rollout num-steps-per-rollout offload "
            "offload-rollout offload-train over-sampling-batch-size partial-rollout prompt-data reward-key rm-type "
            "rm-url rollout-batch-size rollout-health-check-first-wait rollout-health-check-interval "
            "rollout-health-check-timeout rollout-max-context-len rollout-max-prompt-len rollout-max-response-len "
            "rollout-num-gpus rollout-num-gpus-per-engine rollout-seed rollout-shuffle rollout-skip-special-tokens "
            "rollout-stop rollout-stop-token-ids rollout-temperature rollout-top-k rollout-top-p save "
            "save-debug-rollout-data save-interval seed sglang-server-concurrency skip-eval-before-train "
            "start-rollout-id tool-key update-weight-buffer-size update-weights-interval "
            "use-dynamic-batch-size use-fault-tolerance use-tensorboard use-wandb wandb-group wandb-mode "
            "wandb-project"),
    **_same("train-backend", text="megatron or fsdp; slime has megatron only, so with no --train-backend a "
            "Megatron-only argument of a slime script (--optimizer, --attention-dropout ...) selects megatron, with "
            "the installed models plugin for the bridge"),
    **_same("no-save-optim", text="a switch named no_save_optim: --no-save-optim turns it on"),
    **_same("save-hf", text="PATH, may hold {rollout_id}: every --save checkpoint is also written there as an HF "
            "model"),
    **_same("ref-load", text="as in slime, the reference policy (KL, reference log-probs) and, unless --load "
            "resumes a checkpoint, the policy's starting weights are read from PATH (the engines get them at the "
            "first weight sync): an HF directory, or on --train-backend megatron also a torch_dist checkpoint "
            "(`slime-core convert hf-to-megatron`, or a megatron save's iter_N/actor)"),
    **_same("balance-data", text="micro-batches are dealt to the data-parallel ranks by a greedy token balance "
            "(largest first to the least loaded rank) instead of round-robin"),
    **_same("sglang-router-ip sglang-router-port", text="an external sglang-router: slime-core starts none, "
            "registers its engines with it (POST /workers) and removes them at the end; args.sglang_router_ip/port "
            "of a custom function name the router in use"),
    **_same("sglang-router-request-timeout-secs", text="seconds one request to the router may take (the rollout "
            "client's timeout)"),
    **_same("sglang-pp-size sglang-pipeline-parallel-size", where="SGLang argument",
            text="a ServerArgs field (--sglang-<field>), passed to --rollout-engine sglang"),
    **_same("mtp-num-layers mtp-loss-scaling-factor", where="Megatron argument",
            text="passed to megatron-core (--train-backend megatron)"),
    # -- the same: the algorithm plugins' options (the plugin comes with --advantage-estimator or --plugin)
    **_same("disable-grpo-std-normalization disable-rewards-normalization entropy-coef eps-clip eps-clip-c "
            "eps-clip-high get-mismatch-metrics kl-loss-coef kl-loss-type normalize-advantages tis-clip "
            "tis-clip-low use-kl-loss use-rollout-logprobs use-tis", plugin="grpo",
            text="also of gspo and ppo, which share GRPO's loss options"),
    **_same("gamma lambd num-critic-only-steps value-clip", plugin="ppo"),
    **_same("kl-coef", plugin="ppo", text="KL in the reward; the grpo plugin refuses it, as GRPO's advantages "
            "ignore it (slime ignores it silently there)"),
    # -- the same: slime's --*-path functions, called with slime's signatures (slime_compat)
    **_same("buffer-filter-path custom-advantage-function-path custom-config-path custom-generate-function-path "
            "custom-loss-function-path custom-megatron-init-path custom-reward-post-process-path custom-rm-path "
            "custom-rollout-log-function-path data-source-path dynamic-sampling-filter-path eval-function-path "
            "rollout-all-samples-process-path rollout-data-postprocess-path rollout-function-path "
            "rollout-sample-filter-path", plugin="slimecore.defaults.slime_compat",
            text="the function is called with slime's signature (docs/hooks.md)"),
    **_same("rollout-sample-hook-path", plugin="slimecore.defaults.slime_compat",
            text="repeatable, as slime's append: every hook given runs, in order"),
    "--loss-type": Fate("same", "policy_loss and custom_loss as in slime; sft_loss is refused with --plugin sft "
                        "instead", plugin="slimecore.defaults.slime_compat"),
    # -- mapped
    "--advantage-estimator": Fate("mapped", "selects the algorithm plugin: grpo -> grpo, gspo -> gspo, ppo / "
                                  "reinforce_plus_plus / reinforce_plus_plus_baseline -> ppo (its own "
                                  "--advantage-estimator); a plugin that is not installed is refused naming it; "
                                  "cispo is refused (no plugin implements it)"),
    "--update-weight-transport": Fate("mapped", "nccl -> distributed (or tensor with --colocate, as slime uses CUDA "
                                      "IPC there); disk -> disk"),
    "--sglang-config": Fate("mapped", "slime's server-group YAML (sglang: [{name, server_groups: [...]}]) is read "
                            "when it is one model of regular groups with one set of overrides: those become the "
                            "engines' ServerArgs; PD disaggregation, placeholder or encoder groups and several "
                            "models are refused; a flat mapping of ServerArgs fields also works"),
    "--wandb-key": Fate("mapped", "WANDB_API_KEY in the driver's environment, read by wandb.init"),
    "--wandb-host": Fate("mapped", "WANDB_BASE_URL in the driver's environment"),
    "--wandb-team": Fate("mapped", "WANDB_ENTITY in the driver's environment"),
    "--wandb-run-id": Fate("mapped", "WANDB_RUN_ID and WANDB_RESUME=allow in the driver's environment (resumes "
                           "that W&B run)"),
}
# the slime adapter adds its refused --*-path flags (slime_compat.REFUSED)

_DROP = "drop the flag"
SLIME_FLAGS.update({
    **_refused("with --context-parallel-size > 1 the megatron backend splits each sequence its own way, with no "
               "all-gather variant (without context parallelism the flag changes nothing, in slime either, and is "
               "accepted: slime's glm5 model files set it)", "--context-parallel-size alone", "--allgather-cp",
               accepted=("",)),
    **_refused("checkpoints are written synchronously (the marker last, so a checkpoint is complete or skipped)",
               _DROP, "--async-save"),
    **_refused("micro-batches are packed by tokens, not by estimated FLOPs",
               "--use-dynamic-batch-size --max-tokens-per-gpu N (and --balance-data across ranks)",
               "--balance-by-flops"),
    **_refused("a debug check of slime's own weight update", "slime-core's weight-sync tests; drop the flag",
               "--check-weight-update-equal"),
    **_refused("slime's CI assertions", _DROP, "--ci-test", "--ci-disable-kl-checker",
               "--ci-train-rollout-logprob-abs-diff-threshold", "--ci-save-grad-norm", "--ci-load-grad-norm"),
    **_refused("samples are not padded to a multiple here (packed micro-batches)", _DROP,
               "--data-pad-size-multiplier"),
    **_refused("advantages come from the algorithm plugin's slime_compute_advantages",
               "--plugin sft for supervised fine-tuning, or --custom-advantage-function-path",
               "--disable-compute-advantages-and-returns"),
    **_refused("the prompts always come from the run's data source", "--data-source-path to manage the data yourself",
               "--disable-rollout-global-dataset"),
    **_refused("W&B names the run itself (slime-core gives no name, so there is no suffix to drop)",
               "WANDB_NAME=... in the environment", "--disable-wandb-random-suffix"),
    **_refused("slime-core picks the backend: NCCL on CUDA, gloo on CPU", _DROP, "--distributed-backend"),
    **_refused("collectives are not given a timeout of their own", "--train-timeout SECONDS (a hung step or weight "
               "sync fails naming the rank)", "--distributed-timeout-minutes"),
    **_refused("no training dump", "the run folder: metrics.jsonl, samples.jsonl (--log-samples -1 for every "
               "sample)", "--dump-details"),
    **_refused("MTP layers are not trained (no MTP loss)", _DROP, "--enable-mtp-training"),
    **_refused("slime-core does not freeze parameters by name", "--use-lora (fsdp) to train adapters only",
               "--freeze-params-name-list", "--only-train-params-name-list", "--freeze-indexer"),
    **_refused("reward requests go out from the rollout manager directly", "HTTPS_PROXY / HTTP_PROXY in the "
               "environment for a proxy", "--http-proxy", "--use-distributed-post"),
    **_refused("the old policy's log-probs are recomputed before each update; no second copy is kept", _DROP,
               "--keep-old-actor"),
    **_refused("slime's debug replay variants", "--load-debug-rollout-data / --save-debug-rollout-data",
               "--load-debug-rollout-data-subsample", "--load-forge-rollout-data", "--save-debug-train-data"),
    **_refused("that rollout metric is not computed", "compute it in --custom-rollout-log-function-path (its "
               "metrics are logged)", "--log-correct-samples", "--log-multi-turn", "--log-passrate",
               "--log-reward-category"),
    **_refused("log-probs are computed per micro-batch with the training budget", "--max-tokens-per-gpu (bounds "
               "every forward)", "--log-probs-chunk-size", "--log-probs-max-tokens-per-gpu"),
    **_refused("no FP8 DeepGEMM forward in the trainers", _DROP, "--megatron-deepgemm-forward-layers",
               "--megatron-deepgemm-forward-modules", "--megatron-deepgemm-moe-forward-layers",
               "--megatron-deepgemm-moe-forward-modules"),
    **_refused("no memory recorder or profiler flags", "torch.profiler or torch.cuda.memory._record_memory_history "
               "in a plugin's slime_startup", "--memory-recorder", "--memory-snapshot-dir",
               "--memory-snapshot-num-steps", "--profile-target", "--record-memory-history"),
    **_refused("the model bridge is chosen from config.json's architecture", _DROP, "--model-name"),
    **_refused("no multimodal prompts", "text prompts (--input-key)", "--multimodal-keys"),
    **_same("opd-kl-coef", plugin="opd", text="the weight of the teacher's term in the advantages"),
    **_same("opd-teacher-load", plugin="opd", text="the teacher in the trainer (slime's --opd-type megatron): a "
            "checkpoint of the student's architecture read as --ref-load is (an HF directory, or on --train-backend "
            "megatron also a torch_dist one: slime-core's, or a Megatron-LM root), kept by each train rank as a CPU copy and run forward once a step to "
            "fill teacher_log_probs"),
    "--use-opd": Fate("mapped", "selects the opd plugin (as --plugin opd); with slime's --opd-type megatron and "
                      "--opd-teacher-load CKPT the teacher is the trainer's"),
    **_refused("slime's sglang type asks a teacher server through its reward function (--rm-url); the opd plugin "
               "asks its teacher engines itself", "--opd-type megatron --opd-teacher-load CKPT (the teacher in the "
               "trainer), or --plugin opd with --opd-teacher NAME=HF_CHECKPOINT (the run starts that teacher) or "
               "--opd-teacher-urls NAME=URL", "--opd-type", accepted=("megatron",)),
    **_same("opd-teacher-ckpt-step", plugin="opd", text="with --opd-teacher-load a Megatron-LM checkpoint root "
            "(slime's converter output, a Megatron-LM save): the iteration read, iter_N (megatron)"),
    **_refused("off-policy sequence masking is not implemented", "--use-tis --tis-mode icepop (token-level masking)",
               "--use-opsm", "--opsm-delta"),
    **_refused("the vocabulary size comes from config.json", _DROP, "--padded-vocab-size"),
    **_refused("no prefill/decode disaggregation", "--rollout-num-gpus and --rollout-num-gpus-per-engine (regular "
               "engines)", "--prefill-num-servers"),
    **_refused("no gated delta-net (Qwen3-Next / Qwen3.5 linear attention) layers in the trainers", _DROP,
               "--qwen-gdn-backend"),
    **_refused("the loss is not recomputed separately", "--gradient-checkpointing (fsdp) or --recompute-granularity "
               "(megatron)", "--recompute-loss-function"),
    **_same("ref-ckpt-step", text="with --ref-load a Megatron-LM checkpoint root (slime's converter output, a "
            "Megatron-LM save): the iteration read, iter_N (megatron)"),
    **_refused("the reference policy is not refreshed from the actor", _DROP, "--ref-update-interval"),
    **_refused("train actors stay alive through the run", "--offload-train (moves the trainer's state to CPU while "
               "engines generate)", "--release-train"),
    **_refused("optimizer state is not reset between rollouts", _DROP, "--reset-optimizer-states"),
    **_refused("rollout data reaches the trainers through Ray's object store only", _DROP,
               "--rollout-data-transport", accepted=("object-store",)),
    **_refused("slime-core starts the engines it generates with", "--sglang-router-ip/--sglang-router-port for an "
               "external router, or --rollout-function-path for your own generation", "--rollout-external-engine-addrs"),
    **_refused("slime's rollout-buffer service is not supported", "an agent plugin (slime_agent) or "
               "--rollout-function-path", "--rollout-buffer-url", "--fetch-trajectory-retry-times",
               "--min-batch-collection-ratio", "--rollout-task-type", "--loss-mask-type"),
    **_refused("TensorBoard events are written in the run folder", "--log-dir DIR", "--tb-project-name",
               "--tb-experiment-name"),
    **_refused("W&B writes under the run folder", "--log-dir DIR", "--wandb-dir"),
    **_refused("the train actors inherit the driver's environment", "export the variables before slime-core train",
               "--train-env-vars"),
    **_refused("delta weight updates are not implemented", _DROP, "--update-weight-mode", accepted=("full",)),
    **_refused("delta weight updates are not implemented", _DROP, "--update-weight-delta-checksum",
               "--update-weight-delta-encoding", "--update-weight-local-checkpoint-dir"),
    **_refused("the disk transport writes each version under the run folder and keeps only the newest",
               "--log-dir DIR", "--update-weight-disk-dir", "--update-weight-disk-keep-files"),
    **_refused("entropy of the rollout policy is not computed", "--entropy-coef (the policy's entropy in the loss)",
               "--use-rollout-entropy"),
    **_same("use-rollout-routing-replay", text="R3: the engines return each token's routed experts and the trainer "
            "(fsdp or megatron) routes to them (slimecore/routing_replay.py)"),
    **_same("use-routing-replay", text="R2: the old-policy log-prob pass records each token's routed experts and "
            "training (fsdp or megatron) routes to them (slimecore/routing_replay.py)"),
    **_refused("the optimizer is AdamW with state", _DROP, "--use-stateless-adam"),
    **_refused("the KL estimators are k1, k2, k3 and low_var_kl, without the unbiased correction",
               "--kl-loss-type", "--use-unbiased-kl"),
    **_refused("eval sampling here takes a temperature, top-p and response length only",
               "--eval-temperature, --eval-top-p, --eval-max-response-len (or per data set in --eval-config)",
               "--eval-top-k", "--eval-min-new-tokens", "--eval-max-context-len"),
    **_refused("eval prompts are not filtered by length", "filter the eval data file",
               "--eval-max-prompt-len"),
    **_refused("eval rewards are read with the run's reward key", "--reward-key", "--eval-reward-key"),
    **_refused("eval prompts take their tools from the run's tool key", "--tool-key", "--eval-tool-key"),
    **_refused("every metric is logged with the rollout step (train/step is the same number)", _DROP,
               "--wandb-always-use-train-step"),
    **_refused("GPUs come from Ray's resources", "--actor-num-gpus-per-node and --rollout-num-gpus",
               "--num-gpus-per-node"),
})


def refused_message(flag: str, value=None) -> str:
    """The one line a refused flag stops the run with."""
    fate = SLIME_FLAGS[flag]
    given = "" if value in (None, True, []) else f" {value}" if not isinstance(value, list) else " " + " ".join(
        map(str, value))
    return f"{flag}{given} is not supported by slime-core: {fate.text}; instead: {fate.instead}"
