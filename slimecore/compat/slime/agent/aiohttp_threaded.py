"""slime-core shim of ``slime.agent.aiohttp_threaded``: serve an adapter's ``app`` from its own thread."""

from __future__ import annotations

from aiohttp.web_log import AccessLogger

from slimecore.agents.server import ThreadedApp, serve_in_thread

AppHandle = ThreadedApp


class FilteredAccessLogger(AccessLogger):
    """slime's access logger that leaves health checks out."""

    def log(self, request, response, time):
        if request.path not in ("/health", "/healthz"):
            super().log(request, response, time)


def run_app_in_thread(app, *, host: str = "127.0.0.1", port: int = 0, thread_name: str = "aiohttp-app",
                      runner_kwargs: dict | None = None) -> AppHandle:
    """Serve ``app`` on ``host:port`` (0: a free port); the handle has ``port`` and ``stop()``."""
    return serve_in_thread(app, host, port, thread_name, runner_kwargs=runner_kwargs)
