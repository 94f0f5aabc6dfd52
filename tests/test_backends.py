"""The training-backend protocol: every registered backend implements all of it, on its own (no backend derives
from another), and the step refuses what it cannot do with a message naming it."""

from __future__ import annotations

import inspect

import pytest

from slimecore.config import Config, parse_config
from slimecore.plugins import load_plugins
from slimecore.trainers.backend import TRAIN_BACKENDS, TrainBackend, backend_class
from slimecore.trainers.trainer import Trainer


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(TrainBackend).items()
            if callable(member) and not name.startswith("_")}


@pytest.mark.parametrize("name", list(TRAIN_BACKENDS))
def test_each_backend_implements_the_whole_protocol(name):
    cls = backend_class(name)  # imports the module only: megatron-core is imported when a model is built
    for method, signature in _protocol_methods().items():
        assert callable(getattr(cls, method, None)), f"{cls.__name__} lacks {method}"
        params = list(inspect.signature(getattr(cls, method)).parameters)
        assert params == list(signature.parameters), (cls.__name__, method, params)
    init = inspect.signature(cls.__init__).parameters
    assert {"config", "hooks", "rank", "world_size", "value_model", "keep_reference", "other_weights"} <= set(init), \
        cls.__name__


def test_no_backend_derives_from_another():
    classes = [backend_class(name) for name in TRAIN_BACKENDS]
    for cls in classes:
        assert cls.__mro__[1:] == (object,), f"{cls.__name__} derives from {cls.__mro__[1].__name__}"


def test_the_backend_choice_comes_from_the_registry(capsys):
    assert parse_config(["--train-backend", "megatron"], [], {}).train_backend == "megatron"
    with pytest.raises(SystemExit):
        parse_config(["--train-backend", "deepspeed"], [], {})
    assert "invalid choice: 'deepspeed' (choose from 'fsdp', 'megatron')" in capsys.readouterr().err


def test_unknown_backend_and_values_of_a_policy_are_refused(tiny_checkpoint):
    config = Config.make(hf_checkpoint=str(tiny_checkpoint))
    with pytest.raises(ValueError, match="unknown training backend 'deepspeed'; known: fsdp, megatron"):
        Trainer(config, load_plugins([]), backend="deepspeed")
    with pytest.raises(RuntimeError, match="role 'actor' is not a value model"):
        Trainer(config, load_plugins([])).compute_values({"tokens": [], "steps": []})


def test_the_data_parallel_ranks_come_from_the_backends_driver_side():
    from slimecore.trainers.backend import data_parallel_ranks

    assert data_parallel_ranks(Config.make(train_backend="fsdp"), 4) == [0, 1, 2, 3]
    megatron = Config.make(train_backend="megatron", tensor_model_parallel_size=2)
    assert data_parallel_ranks(megatron, 4) == [0, 0, 1, 1]  # the two ranks of a TP group train on the same data
