"""Built-in data-source plugin: ``--prompt-data`` files or a built-in task."""

from slimecore import hookimpl
from slimecore.data.source import PromptDataSource, load_prompts


@hookimpl
def slime_data_source(config, tokenizer):
    records, filtered = load_prompts(config, tokenizer, config.prompt_data)
    return PromptDataSource(records, config.n_samples_per_prompt, shuffle=config.rollout_shuffle,
                            seed=config.rollout_seed, num_filtered=filtered)
