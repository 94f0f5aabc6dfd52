"""slime-core shim of ``slime.agent``: the protocol adapters (``slime.agent.adapters``) and ``run_app_in_thread``
(``slime.agent.aiohttp_threaded``), backed by slime-core's agent sessions (``slimecore.agents``)."""
