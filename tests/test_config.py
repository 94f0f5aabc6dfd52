"""Config: defaults < YAML < command line, plugin options namespaced, pass-through, clear errors."""

import pickle

import pytest

from slimecore.config import Config, ConfigError, Option, parse_config

GRPO_LIKE = {"algo": [Option("eps_clip", float, 0.2, "clip"), Option("use_kl_loss", bool, False, "kl")]}
BASE = ["--prompt-data", "x.jsonl", "--rollout-batch-size", "4"]


def test_cli_overrides_yaml_overrides_defaults(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("rollout_batch_size: 8\nn-samples-per-prompt: 4\nlr: 0.001\nalgo:\n  eps_clip: 0.3\n"
                   "sglang:\n  mem_fraction_static: 0.7\n")
    config = parse_config(["--prompt-data", "x.jsonl", "--config", str(run), "--lr", "0.01"], ["algo"], GRPO_LIKE)
    assert config.rollout_batch_size == 8 and config.n_samples_per_prompt == 4
    assert config.lr == 0.01  # command line wins
    assert config.plugin("algo").eps_clip == 0.3 and config.plugin("algo").use_kl_loss is False
    assert config.sglang_args == {"mem_fraction_static": 0.7}
    assert config.global_batch_size == 32  # one optimizer step per rollout by default


def test_plugin_flags_and_sglang_passthrough():
    config = parse_config(BASE + ["--eps-clip", "0.1", "--use-kl-loss", "--sglang-mem-fraction-static", "0.8",
                                  "--sglang-enable-metrics", "--tensor-model-parallel-size", "2"], ["algo"], GRPO_LIKE)
    assert config.plugin("algo").eps_clip == 0.1 and config.plugin("algo").use_kl_loss is True
    assert config.sglang_args == {"mem_fraction_static": "0.8", "enable_metrics": True}
    assert config.tensor_model_parallel_size == 2


def test_unknown_flag_suggests_a_name():
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--rollout-bach-size", "3"], [], {})
    assert "--rollout-bach-size" in str(err.value) and "did you mean --rollout-batch-size" in str(err.value)
    with pytest.raises(ConfigError, match="--plugin NAME"):
        parse_config(BASE + ["--eps-clip", "0.1"], [], {})


def test_yaml_errors_name_file_key_and_line(tmp_path):
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("rollout_bach_size: 3\n")
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--config", str(bad_key)], [], {})
    assert str(bad_key) in str(err.value) and "rollout_bach_size" in str(err.value) and "rollout_batch_size" in str(err.value)
    broken = tmp_path / "b.yaml"
    broken.write_text("lr: 1\n  bad: [\n")
    with pytest.raises(ConfigError, match=r"b.yaml line \d+: invalid YAML"):
        parse_config(BASE + ["--config", str(broken)], [], {})
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(BASE + ["--config", str(tmp_path / "missing.yaml")], [], {})
    nested = tmp_path / "c.yaml"
    nested.write_text("algo:\n  eps_clp: 0.1\n")
    with pytest.raises(ConfigError, match="plugin 'algo' has no option 'eps_clp'.*eps_clip"):
        parse_config(BASE + ["--config", str(nested)], ["algo"], GRPO_LIKE)


def test_invalid_combinations_name_the_flags():
    with pytest.raises(ConfigError) as err:
        parse_config(BASE + ["--n-samples-per-prompt", "3", "--global-batch-size", "5"], [], {})
    for flag in ("--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size"):
        assert flag in str(err.value)
    with pytest.raises(ConfigError, match="--max-tokens-per-gpu"):
        parse_config(BASE + ["--use-dynamic-batch-size"], [], {})
    with pytest.raises(ConfigError, match="--rollout-temperature must be > 0"):
        parse_config(BASE + ["--rollout-temperature", "0"], [], {})
    with pytest.raises(ConfigError, match="--over-sampling-batch-size"):
        parse_config(BASE + ["--over-sampling-batch-size", "2"], [], {})
    with pytest.raises(ConfigError, match="--train-async cannot be used with --colocate"):
        parse_config(BASE + ["--train-async", "--colocate"], [], {})
    with pytest.raises(ConfigError, match="--rollout-batch-size is required"):
        parse_config(["--prompt-data", "x.jsonl"], [], {})


def test_cluster_and_fault_options_are_checked_before_ray_starts():
    config = parse_config(BASE + ["--actor-resources", '{"trainer": 1}', "--no-use-fault-tolerance"], [], {})
    assert config.actor_resources == {"trainer": 1} and config.use_fault_tolerance is False
    assert parse_config(BASE, [], {}).use_fault_tolerance is True  # on by default
    with pytest.raises(ConfigError, match="--rollout-resources must be a JSON object of resource names"):
        parse_config(BASE + ["--rollout-resources", '["rollout"]'], [], {})
    with pytest.raises(ConfigError, match="--actor-resources must be a JSON object"):
        parse_config(BASE + ["--actor-resources", '{"trainer": 0}'], [], {})
    with pytest.raises(ConfigError, match="--rollout-health-check-interval must be > 0 seconds"):
        parse_config(BASE + ["--rollout-health-check-interval", "0"], [], {})
    with pytest.raises(ConfigError, match="--train-timeout must be > 0 seconds"):
        parse_config(BASE + ["--train-timeout", "-1"], [], {})


def test_plugin_option_conflicts():
    clash = {"a": [Option("eps_clip", float, 0.2)], "b": [Option("eps_clip", float, 0.3)]}
    with pytest.raises(ConfigError, match="plugins 'a' and 'b' both declare --eps-clip"):
        parse_config(BASE, ["a", "b"], clash)
    shared = {"a": [Option("eps_clip", float, 0.2)], "b": [Option("eps_clip", float, 0.2)]}
    config = parse_config(BASE + ["--eps-clip", "0.5"], ["a", "b"], shared)
    assert config.plugin("a").eps_clip == config.plugin("b").eps_clip == 0.5
    with pytest.raises(ConfigError, match="core option"):
        parse_config(BASE, ["a"], {"a": [Option("lr", float, 0.1)]})


def test_builtin_task_quickstart_settings_apply_only_where_unset():
    config = parse_config(["--n-samples-per-prompt", "2"], [], {})
    assert config.prompt_data is None and config.task == "compare"
    assert config.n_samples_per_prompt == 2 and config.rollout_batch_size == 8
    assert "n_samples_per_prompt" not in config.recommended_applied and config.recommended_applied["lr"] == 1e-5
    assert parse_config(BASE, [], {}).recommended_applied == {}
    with pytest.raises(ConfigError, match="not a built-in task"):
        parse_config(["--task", "chess"], [], {})


def test_a_plugins_quickstart_settings_replace_the_built_in_tasks():
    env = {"env": {"rollout_batch_size": 3, "rollout_max_response_len": 96, "n_samples_per_prompt": 4}}
    config = parse_config(["--n-samples-per-prompt", "2"], [], {}, quickstart=env)
    assert config.recommended_by == "plugin 'env'"
    assert config.recommended_applied == {"rollout_batch_size": 3, "rollout_max_response_len": 96}
    assert config.n_samples_per_prompt == 2 and config.lr == Config.make().lr  # not the compare task's 1e-5
    assert parse_config(["--n-samples-per-prompt", "2"], [], {}).recommended_by == "built-in task 'compare'"
    assert parse_config(BASE, [], {}, quickstart=env).recommended_applied == {}  # --prompt-data: none apply
    with pytest.raises(ConfigError, match="plugins 'a', 'b' each bring their own prompts"):
        parse_config(["--rollout-batch-size", "1"], [], {}, quickstart={"a": {"lr": 1.0}, "b": {"lr": 2.0}})
    with pytest.raises(ConfigError, match="plugin 'a': slime_quickstart_options names \\['lrr'\\]"):
        parse_config([], [], {}, quickstart={"a": {"lrr": 1.0}})


def test_config_pickles_and_rejects_unknown_attributes():
    config = Config.make(plugins=["grpo"], plugin_values={"grpo": {"eps_clip": 0.2}}, rollout_batch_size=3)
    back = pickle.loads(pickle.dumps(config))
    assert back.rollout_batch_size == 3 and back.plugin("grpo").eps_clip == 0.2 and back.plugins == ["grpo"]
    with pytest.raises(AttributeError, match="did you mean 'rollout_batch_size'"):
        config.rollout_bach_size
    with pytest.raises(ConfigError, match="unknown core option"):
        Config.make(nope=1)


def test_no_engines_mode_has_its_own_flag_and_slimes_debug_train_only_still_selects_it():
    plain = parse_config(["--rollout-batch-size", "2"], [], {})
    assert plain.engines and not plain.without_engines and plain.starts_engines
    for argv in (["--no-engines"], ["--debug-train-only"]):
        config = parse_config(argv, [], {})  # no --rollout-batch-size needed: the data source sets the batch
        assert config.without_engines and not config.starts_engines
    replay = parse_config(["--rollout-batch-size", "2", "--load-debug-rollout-data", "d/{rollout_id}.pt"], [], {})
    assert not replay.without_engines and not replay.starts_engines
    with pytest.raises(ConfigError, match="--debug-rollout-only needs the engines; it excludes --no-engines"):
        parse_config(["--rollout-batch-size", "2", "--debug-rollout-only", "--no-engines"], [], {})
    with pytest.raises(ConfigError, match="--fully-async needs live engines"):
        parse_config(["--rollout-batch-size", "2", "--fully-async", "--debug-train-only"], [], {})
