"""Search-R1 plugin: declares its options. The generate (search tool loop) and reward (exact match)
hooks come with the search_r1 issue; nothing here pretends to implement them yet."""

from slimecore import hookimpl
from slimecore.config import Option


@hookimpl
def slime_options():
    return [
        Option("max_turns", int, 2, "Most search/answer turns per sample."),
        Option("search_url", str, None, "Search-R1 retrieval server (POST /retrieve); default: the shipped BM25."),
        Option("search_topk", int, 3, "Documents returned per search."),
    ]
