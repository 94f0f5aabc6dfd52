"""The embedded CPU inference engine: an HF transformers model behind SGLang's native HTTP API.

It answers the endpoints the router and slime-style rollouts use (``/generate``, ``/health``,
``/model_info``, ``/server_info``, ``/abort_request``, ``/v1/loads``, ``/flush_cache``,
``/pause_generation``, ``/continue_generation``, the weight-sync endpoints ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/release_memory_occupation``, ``/resume_memory_occupation``, weight
version), with the same request and response shapes as SGLang, bound to 127.0.0.1 (or the node's address
with an API key, as SGLang's ``--api-key``). The aiohttp routes live in :mod:`slimecore.engines.http`; the
engine is :class:`EmbeddedServer` (``server.py``), made of one part per concern:

- ``request.py``: a /generate body validated, the :class:`Request` it becomes, SGLang's response to it;
- ``scheduler.py``: the queues, pause and abort, continuous batching on one scheduler thread;
- ``runner.py``: the prefill (shared prefixes, identical prompts) and decode forwards over the KV rows;
- ``sampler.py``: the next token of each row, its log-prob, and when the row stops;
- ``weights.py``: weight updates (disk, tensor, distributed), checksums, memory release and resume.
"""

from slimecore.engines.embedded.request import (ABORTED, ABORTED_WAITING, DEFAULT_SAMPLING, Request,
                                               validate_sampling_params)
from slimecore.engines.embedded.sampler import _draw, _seeded_uniform
from slimecore.engines.embedded.server import VERSION, EmbeddedServer
from slimecore.engines.embedded.weights import _own_weights

__all__ = ["ABORTED", "ABORTED_WAITING", "DEFAULT_SAMPLING", "VERSION", "EmbeddedServer", "Request",
           "validate_sampling_params"]
