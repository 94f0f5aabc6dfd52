"""Built-in data-source plugin: ``--prompt-data`` files or a built-in ``--task``."""

from slimecore import hookimpl
from slimecore.data.source import PromptDataSource, pop_first


@hookimpl
def slime_data_source(config, tokenizer, hooks):
    def buffer_filter(buffer, num_groups):
        # slime_buffer_filter is a first-answer hook: None means no plugin chose, so take the oldest groups
        chosen = hooks.buffer_filter(config=config, buffer=buffer, num_groups=num_groups)
        return pop_first(buffer, num_groups) if chosen is None else chosen

    return PromptDataSource.from_config(config, tokenizer, buffer_filter=buffer_filter)
