"""Built-in data-source plugin: ``--prompt-data`` files or a built-in task."""

from slimecore import hookimpl
from slimecore.data.source import PromptDataSource, load_prompts, pop_first


@hookimpl
def slime_data_source(config, tokenizer, hooks):
    def buffer_filter(buffer, num_groups):
        chosen = hooks.buffer_filter(config=config, buffer=buffer, num_groups=num_groups)
        return pop_first(buffer, num_groups) if chosen is None else chosen

    records, filtered = load_prompts(config, tokenizer, config.prompt_data)
    return PromptDataSource(records, config.n_samples_per_prompt, shuffle=config.rollout_shuffle,
                            seed=config.rollout_seed, buffer_filter=buffer_filter, num_filtered=filtered)
