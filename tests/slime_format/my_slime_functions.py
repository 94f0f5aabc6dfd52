"""A slime user's custom functions, written against slime's API and signatures only (nothing of slime-core's):
they run unchanged under ``slime-core train`` through the built-in slime adapter. Each call appends a line to
``args.call_log`` (set by ``--custom-config-path``), so the test can see which process called what, with what."""

import asyncio
import json
import os

import torch

from slime.backends.megatron_utils.loss import get_log_probs_and_entropy
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.data_source import DataSource
from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.async_utils import run
from slime.utils.http_utils import post
from slime.utils.types import Sample


def _log(args, what, **details):
    with open(args.call_log, "a") as f:
        f.write(json.dumps({"what": what, "pid": os.getpid(), **details}) + "\n")


# --custom-generate-function-path
async def generate(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = sample.tokens or state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    output = await post(url, {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True})
    if not sample.tokens:
        sample.tokens = prompt_ids
    items = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(args, tokens=[item[1] for item in items], log_probs=[item[0] for item in items],
                                  trainable=True, meta_info=output["meta_info"], text=output["text"])
    _log(args, "generate", status=sample.status.value, max_new_tokens=sampling_params["max_new_tokens"], router=url)
    return sample


# --custom-rm-path
async def reward_func(args, sample: Sample, **kwargs):
    assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED), sample.status
    _log(args, "reward", index=sample.index, eps_clip=args.eps_clip, rm_type=args.rm_type)
    return sum(ch.isdigit() for ch in sample.response) / max(1, len(sample.response))


# --custom-rm-path with --group-rm: the batched form
async def batched_reward_func(args, samples: list[Sample], **kwargs):
    return [float(len(sample.response)) for sample in samples]


# --dynamic-sampling-filter-path: drop every odd prompt group
def filter_odd_groups(args, samples: list[Sample], **kwargs):
    rewards = [sample.get_reward_value(args) for sample in samples]
    keep = samples[0].group_index % 2 == 0
    _log(args, "filter", group_index=samples[0].group_index, rewards=rewards)
    return DynamicFilterOutput(keep=keep, reason=None if keep else "odd_group")


# --rollout-sample-hook-path (async, as slime allows)
async def tag_sample(args, sample, *, rollout_id=None, evaluation=False):
    sample.metadata["tagged_at"] = rollout_id
    return None


# --rollout-sample-filter-path: the last sample of each group does not train
def remove_last(args, groups: list[list[Sample]]) -> None:
    for group in groups:
        group[-1].remove_sample = True
    _log(args, "sample_filter", groups=len(groups))


# --rollout-all-samples-process-path: every finished group, dropped ones included
def all_samples(args, all_groups: list[list[Sample]], data_source) -> None:
    _log(args, "all_samples", group_indices=[group[0].group_index for group in all_groups], prompts=len(data_source))


# --buffer-filter-path: the newest buffered groups first (aborted groups wait in the buffer)
def newest_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    selected = list(reversed(buffer[-num_samples:]))
    del buffer[-num_samples:]
    _log(args, "buffer_filter", rollout_id=rollout_id, taken=len(selected))
    return selected


# --custom-reward-post-process-path: rewards centred per group, not divided by the std
def post_process_rewards(args, samples: list[Sample]):
    raw = [sample.get_reward_value(args) for sample in samples]
    groups = torch.tensor(raw, dtype=torch.float32).reshape(-1, args.n_samples_per_prompt)
    _log(args, "post_process", n=len(raw))
    return raw, (groups - groups.mean(dim=-1, keepdim=True)).flatten().tolist()


# --custom-rollout-log-function-path
def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    rollout_extra_metrics["rollout/my_sample_count"] = len(samples)
    _log(args, "log_rollout", rollout_id=rollout_id, rollout_time=rollout_time)
    return False


# --custom-megatron-init-path
def init(args) -> None:
    _log(args, "init", backend=args.train_backend)


# --rollout-data-postprocess-path
def postprocess(args, rollout_id, rollout_data):
    _log(args, "postprocess", rollout_id=rollout_id, loss_mask_sums=[int(m.sum()) for m in rollout_data["loss_masks"]],
         sample_indices=rollout_data["sample_indices"], keys=sorted(rollout_data))


# --custom-loss-function-path (--loss-type custom_loss): a plain REINFORCE-style ratio loss
def custom_loss(args, batch, logits, sum_of_sample_mean):
    _, log_probs_and_entropy = get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=True)
    log_probs = torch.cat(log_probs_and_entropy["log_probs"], dim=0)
    old_log_probs = torch.cat(batch["log_probs"], dim=0)
    advantages = torch.cat(batch["advantages"], dim=0)
    pg_loss = sum_of_sample_mean(-(log_probs - old_log_probs).exp() * advantages)
    entropy = sum_of_sample_mean(torch.cat(log_probs_and_entropy["entropy"], dim=0))
    _log(args, "loss", n=len(batch["response_lengths"]), loss_type=args.loss_type)
    return pg_loss, {"custom_pg_loss": pg_loss.detach(), "custom_entropy": entropy.detach()}


# --custom-advantage-function-path: centred reward on every response token
def advantages(args, rollout_data):
    rewards = torch.tensor(rollout_data["rewards"], dtype=torch.float32)
    centred = rewards - rewards.mean()
    rollout_data["advantages"] = [torch.full((n,), float(c)) for n, c in zip(rollout_data["response_lengths"], centred)]
    rollout_data["returns"] = rollout_data["advantages"]
    _log(args, "advantages", n=len(rewards), raw_reward=list(rollout_data["raw_reward"]))


# --data-source-path
class JsonlDataSource(DataSource):
    def __init__(self, args):
        self.args = args
        with open(args.prompt_data) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.offset, self.index, self.buffer = 0, 0, []

    def get_samples(self, num_samples):
        groups = [self.buffer.pop(0) for _ in range(min(num_samples, len(self.buffer)))]
        while len(groups) < num_samples:
            row = self.rows[self.offset % len(self.rows)]
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                group.append(Sample(group_index=self.offset, index=self.index, prompt=row["input"], label=row["label"]))
                self.index += 1
            self.offset += 1
            groups.append(group)
        return groups

    def add_samples(self, samples):
        self.buffer.extend(samples)

    def save(self, rollout_id):
        os.makedirs(self.args.save, exist_ok=True)
        with open(os.path.join(self.args.save, f"my_source_{rollout_id}.json"), "w") as f:
            json.dump({"offset": self.offset}, f)
        _log(self.args, "source_save", rollout_id=rollout_id)

    def load(self, rollout_id=None):
        _log(self.args, "source_load", rollout_id=rollout_id)

    def __len__(self):
        return len(self.rows)


# --rollout-function-path (and eval): slime's sync signature, driving async generate code with slime's run()
def generate_rollout(args, rollout_id, data_source, evaluation=False):
    if evaluation:
        groups = data_source.get_samples(len(data_source))[:4]
    else:
        groups = data_source.get_samples(args.rollout_batch_size)
    params = GenerateState(args).sampling_params

    async def one(sample):
        sample = await generate(args, sample, dict(params))
        sample.reward = await reward_func(args, sample)
        return sample

    async def everything():
        return await asyncio.gather(*(asyncio.gather(*(one(s) for s in group)) for group in groups))

    groups = [list(group) for group in run(everything())]
    _log(args, "rollout", rollout_id=rollout_id, evaluation=evaluation, groups=len(groups))
    if evaluation:
        samples = [s for group in groups for s in group]
        return RolloutFnEvalOutput(data={"mine": {"rewards": [s.reward for s in samples], "truncated": [
            s.status == Sample.Status.TRUNCATED for s in samples], "samples": samples}})
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/my_rollout_groups": len(groups)})
