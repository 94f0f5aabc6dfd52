"""Test plugin: records, from inside the rollout of a real run, where the router and the engines listen,
whether the run's API key is in use, and what an engine answers a request without it (``--address-log``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from slimecore import hookimpl
from slimecore.config import Option
from slimecore.defaults import rollout as builtin

_recorded = False


@hookimpl
def slime_options():
    return [Option("address_log", str, None, "JSON file of the run's router and engine addresses.")]


def _status_without_key(url: str) -> int:
    request = urllib.request.Request(url + "/generate", data=json.dumps({"input_ids": [1, 2]}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _listening(url: str) -> list[str]:
    """The addresses the sockets listening on ``url``'s port are bound to (every node of the test cluster is this
    host): the engine's own bind, not only the address it registered."""
    import psutil
    from urllib.parse import urlparse

    port = urlparse(url).port
    return [c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


@hookimpl
async def slime_generate(config, sample, sampling_params, client, evaluation, observation, agent):
    global _recorded
    if not _recorded:
        _recorded = True
        engines = await client.worker_urls()
        record = {"router": client.url, "engines": engines, "keyed": client.api_key is not None,
                  "engines_listen_on": sorted({ip for url in engines for ip in _listening(url)}),
                  "engine_without_key": _status_without_key(engines[0]),
                  "router_without_key": _status_without_key(client.url)}
        with open(config.plugin("address_plugin").address_log, "w") as f:
            json.dump(record, f)
    return await builtin.slime_generate(config=config, sample=sample, sampling_params=sampling_params, client=client,
                                        observation=observation, agent=agent)
