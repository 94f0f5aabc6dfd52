"""One HTTP request with a JSON body, from any process: the driver and the rollout manager asking the router and
the engines (``slimecore.engines.router``, ``fleet``), train rank 0 pushing weights, the weight-sync sentinel asking
each engine for its checksums (``slimecore.weight_check``). Plain ``urllib``: no event loop, no session to close."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def http_request(method: str, url: str, body: dict | None = None, timeout: float = 10,
                 api_key: str | None = None) -> tuple[int, bytes]:
    """(status, body) of one request; HTTP errors are returned, connection errors raise OSError."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 60,
              api_key: str | None = None) -> tuple[int, object]:
    """(status, decoded JSON body, or its text when it is not JSON) of one request."""
    status, raw = http_request(method, url, body, timeout, api_key)
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")
