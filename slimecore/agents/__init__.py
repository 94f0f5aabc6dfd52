"""Agent sessions: train any agent that speaks the OpenAI or Anthropic API, with exact tokens.

The pieces, each usable on its own (the interface environment plugins build on):

- ``slimecore.agents.session.AgentSession``: what a ``slime_agent`` hook receives (``base_url``,
  ``anthropic_base_url``, ``api_key``, ``model``, ``sample``, ``env()``, ``openai_client()``,
  ``anthropic_client()``, ``await run(args, input=...)``, ``alias(key)``).
- ``slimecore.agents.server.SessionServer``: ``/v1/chat/completions``, ``/v1/messages`` and ``/v1/models``
  in front of an engine client; ``open(sampling, pinned)`` / ``close(id)`` a session; ``app()`` its aiohttp
  application (``start()`` serves it on its own thread, as ``serve_in_thread`` serves any app).
- ``slimecore.agents.trajectory.Trajectory``: a session's turns as exact tokens, forked where the client
  rewrote its history; ``to_samples(base)`` gives the training samples (one ``rollout_id``).
- ``slimecore.agents.protocol``: the two APIs' request checks, responses, streams and error shapes.
- ``slimecore.agents.chat``: chat-template rendering (tools to the template, or the Hermes format when the
  template has none) and tool-call parsers (``qwen``/``hermes``, ``none``, ``module:function``).
- ``slimecore.agents.episode.run_episode``: the built-in generate's agent path.
"""
