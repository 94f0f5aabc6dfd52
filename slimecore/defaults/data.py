"""Built-in data-source plugin: ``--prompt-data`` files or a built-in ``--task``, and the default buffer filter."""

from slimecore import hookimpl
from slimecore.data.source import PromptDataSource, pop_first


@hookimpl
def slime_data_source(config, tokenizer, buffer_filter):
    return PromptDataSource.from_config(config, tokenizer, buffer_filter=buffer_filter)


@hookimpl(trylast=True)
def slime_buffer_filter(config, buffer, num_groups):
    """slime's default (``pop_first``): resume the oldest buffered groups. Any plugin that answers goes first."""
    return pop_first(buffer, num_groups)
