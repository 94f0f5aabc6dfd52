"""Built-in data-source plugin: ``--prompt-data`` files or a built-in ``--task``."""

from slimecore import hookimpl
from slimecore.data.source import PromptDataSource


@hookimpl
def slime_data_source(config, tokenizer, buffer_filter):
    return PromptDataSource.from_config(config, tokenizer, buffer_filter=buffer_filter)
