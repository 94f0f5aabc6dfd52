import math

import pytest

from slimecore.types import Sample, SampleError, Status


def test_append_keeps_tokens_masks_and_logprobs_aligned():
    s = Sample(tokens=[1, 2, 3])
    s.append_response_tokens([10, 11], [-0.5, -0.25], text="ab", weight_version="3")
    s.append_response_tokens([20, 21, 22], trainable=False, text="<obs>")  # tool output
    s.append_response_tokens([30], [-1.0], finish_reason={"type": "stop", "matched": 30})
    assert s.tokens == [1, 2, 3, 10, 11, 20, 21, 22, 30]
    assert s.response_length == 6 and s.prompt_tokens == [1, 2, 3]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert s.status is Status.COMPLETED and s.response == "ab<obs>" and s.weight_versions == ["3"]
    assert s.effective_response_length == 3


@pytest.mark.parametrize("kind,status", [("length", Status.TRUNCATED), ("abort", Status.ABORTED), ("stop", Status.COMPLETED)])
def test_finish_reason_sets_status(kind, status):
    s = Sample(tokens=[1])
    s.append_response_tokens([2], [-0.1], finish_reason=kind)
    assert s.status is status


def test_append_rejects_misaligned_or_missing_logprobs():
    s = Sample(tokens=[1])
    with pytest.raises(SampleError, match="2 tokens but 1 log-probs"):
        s.append_response_tokens([2, 3], [-0.1])
    with pytest.raises(SampleError, match="needs the log-probs"):
        s.append_response_tokens([2])
    with pytest.raises(SampleError, match="NaN"):
        s.append_response_tokens([2], [math.nan])
    with pytest.raises(SampleError, match="unknown finish_reason"):
        s.append_response_tokens([2], [-0.1], finish_reason="exploded")
    assert s.tokens == [1] and s.response_length == 0  # nothing half-applied


def test_check_aligned_names_the_field():
    s = Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1])
    with pytest.raises(SampleError, match="loss_mask has 1 entries but response_length is 2"):
        s.check_aligned()


def test_reward_value_and_dict_rewards():
    assert Sample(reward=1).get_reward_value() == 1.0
    s = Sample(index=4, reward={"score": 0.5, "acc": 1})
    assert s.get_reward_value("score") == 0.5
    with pytest.raises(SampleError, match="--reward-key"):
        s.get_reward_value()
    with pytest.raises(SampleError, match="not in reward keys"):
        s.get_reward_value("nope")


def test_dict_round_trip_and_reset():
    s = Sample(index=1, tokens=[1, 2], metadata={"a": 1})
    s.append_response_tokens([3], [-0.2], finish_reason="length")
    back = Sample.from_dict(s.to_dict())
    assert back == s
    back.reset_response()
    assert back.tokens == [1, 2] and back.response_length == 0 and back.status is Status.PENDING


def test_slime_fields_of_features_slime_core_lacks_still_take_what_slime_code_does_with_them():
    # slime's search-r1 and retool generate functions clear the top-p replay fields; slime's generate reads the
    # multimodal ones; a dump written with slime's fields loads with them as attributes
    sample = Sample(prompt="q", tokens=[1, 2])
    sample.rollout_top_p_token_ids = sample.rollout_top_p_token_offsets = None
    assert sample.multimodal_inputs is None and sample.multimodal_train_inputs is None
    loaded = Sample.from_dict({**sample.to_dict(), "teacher_log_probs": [-0.5], "train_metadata": {"a": 1}})
    assert loaded.teacher_log_probs == [-0.5] and loaded.train_metadata == {"a": 1} and loaded.tokens == [1, 2]
