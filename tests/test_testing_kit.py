"""The kit plugin authors get: fixtures and contract checks."""

import pytest

from slimecore import hookimpl
from slimecore.testing.contract import ContractError, check_plugin_contract
from slimecore.testing import timeout as scaled


def test_fixtures_build_hooks_and_samples(slimecore_hooks, make_sample):
    sample = make_sample(response_tokens=[7, 8], label="8")
    assert sample.response_length == 2 and sample.loss_mask == [1, 1]
    hooks = slimecore_hooks("grpo")
    assert {p.name for p in hooks.plugins} >= {"grpo", "slimecore.defaults.reward"}


def test_contract_accepts_real_plugins():
    assert "slime_loss" in check_plugin_contract("grpo")
    assert check_plugin_contract("slimecore.defaults.rollout") == ["slime_filter_group", "slime_generate",
                                                                    "slime_post_process_rewards", "slime_rollout",
                                                                    "slime_shutdown"]


class SyncReward:
    @hookimpl
    def slime_reward(self, config, sample):
        return 1.0


class ExtraParam:
    @hookimpl
    async def slime_reward(self, config, sample, tokenizer):
        return 1.0


def test_contract_rejects_wrong_async_and_parameters():
    with pytest.raises(ContractError, match="async def"):
        check_plugin_contract(SyncReward())
    with pytest.raises(ContractError, match="tokenizer"):
        check_plugin_contract(ExtraParam())


def test_tiny_engine_fixture_serves_sglangs_generate(tiny_engine):
    import json
    import urllib.request

    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 4, "temperature": 1.0},
            "return_logprob": True}
    request = urllib.request.Request(f"{tiny_engine.url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=scaled(60)) as response:
        out = json.loads(response.read())
    assert len(out["output_ids"]) == 4 and len(out["meta_info"]["output_token_logprobs"]) == 4
    assert out["meta_info"]["finish_reason"]["type"] == "length"


class RewardWrapper:
    @hookimpl(wrapper=True)
    def slime_reward(self, config, sample):
        answer = yield
        return answer


class NotAGenerator:
    @hookimpl(wrapper=True)
    async def slime_reward(self, config, sample):
        return 1.0


def test_contract_accepts_wrappers_as_generators():
    assert check_plugin_contract(RewardWrapper()) == ["slime_reward"]
    with pytest.raises(ContractError, match="must be a generator"):
        check_plugin_contract(NotAGenerator())
