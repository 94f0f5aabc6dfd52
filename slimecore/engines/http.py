"""aiohttp routes of the embedded engine, shaped like SGLang's HTTP server (srt/entrypoints/http_server.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from aiohttp import web


class BadRequest(ValueError):
    """An invalid request: answered with HTTP 400 ``{"error": {"message": ...}}``."""


class _DropRouterProbes(logging.Filter):
    """The router also probes workers over HTTP/2 (gRPC health); aiohttp logs each probe as a bad
    request. They are expected, so keep them out of the logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "PRI/Upgrade" not in str(record.exc_info[1] if record.exc_info else record.getMessage())


logging.getLogger("aiohttp.server").addFilter(_DropRouterProbes())


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def build_app(server) -> web.Application:
    routes = web.RouteTableDef()

    async def body(request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            return await request.json()
        except json.JSONDecodeError as exc:
            raise BadRequest(f"invalid JSON body: {exc}") from None
        except UnicodeDecodeError as exc:
            raise BadRequest(f"the body is not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                             "send JSON encoded as UTF-8") from None

    @routes.get("/health")
    async def health(_):
        return web.Response(status=200 if server.ready else 503)

    @routes.get("/health_generate")
    async def health_generate(_):
        if not server.ready or server.generation_blocker() is not None:
            return web.Response(status=503)
        req = server.submit(server.new_request({"input_ids": [0], "sampling_params": {"max_new_tokens": 1,
                                                                                       "temperature": 0}}))
        ok = await asyncio.to_thread(req.done.wait, 20)
        return web.Response(status=200 if ok else 503)

    @routes.get("/model_info")
    @routes.get("/get_model_info")
    async def model_info(_):
        return web.json_response(server.model_info())

    @routes.get("/server_info")
    @routes.get("/get_server_info")
    async def server_info(_):
        return web.json_response(server.server_info())

    @routes.get("/v1/models")
    async def models(_):  # SGLang's ModelList: max_model_len is the context length its tokenizer checks against
        name = server.model_path_for_info
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
             "parent": None, "max_model_len": server.context_len}]})

    @routes.get("/get_weight_version")
    @routes.get("/weight_version")
    async def weight_version(_):
        return web.json_response({"weight_version": server.weight_version})

    @routes.post("/generate")
    async def generate(request):
        if not server.ready:
            return _error("the engine is still loading", 503)
        if (blocked := server.generation_blocker()) is not None:
            return _error(blocked)
        server.stats["generate_calls"] += 1
        try:
            reqs, batch = server.new_requests(await body(request))
        except BadRequest as exc:
            return _error(str(exc))
        if not server.unpaused.is_set():
            await asyncio.to_thread(server.unpaused.wait)  # paused: hold new requests, don't reject them
        finished = [req.finished() for req in reqs]
        try:
            server.submit_all(reqs)
        except BadRequest as exc:  # a rid already in flight: nothing was queued
            return _error(str(exc))
        await asyncio.gather(*finished)
        for req in reqs:
            if (req.finish_reason or {}).get("status_code") == 500:
                return _error(req.finish_reason["message"], 500)
        answers = [server.response(req) for req in reqs]
        return web.json_response(answers if batch else answers[0])

    @routes.post("/abort_request")
    async def abort_request(request):
        data = await body(request)
        server.abort(rid=data.get("rid") or None, abort_all=bool(data.get("abort_all")))
        return web.Response(status=200)

    @routes.get("/v1/loads")
    async def loads(request):
        include = request.query.get("include", "core")
        unknown = set(include.split(",")) - {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if unknown:
            return _error(f"invalid include section(s) {sorted(unknown)}")
        core = {"dp_rank": 0, **server.loads(), "num_used_tokens": 0, "token_usage": 0.0}
        return web.json_response({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  "version": server.server_info()["version"], "loads": [core]})

    @routes.get("/get_load")
    async def get_load(_):
        load = server.loads()
        return web.json_response([{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                                   "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": 0,
                                   "num_pending_tokens": 0, "ts_tic": time.time()}])

    @routes.route("*", "/flush_cache")
    async def flush_cache(_):
        load = server.loads()
        if load["num_running_reqs"] or load["num_waiting_reqs"]:
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    @routes.post("/pause_generation")
    async def pause_generation(_):
        server.unpaused.clear()
        server.abort(abort_all=True)
        while server.loads()["num_running_reqs"]:
            await asyncio.sleep(0.01)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    @routes.post("/continue_generation")
    async def continue_generation(_):
        server.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @routes.post("/update_weights_from_disk")
    async def update_weights_from_disk(request):
        data = await body(request)
        if not data.get("model_path"):
            return web.json_response({"success": False, "message": "model_path is required"}, status=400)
        try:
            await asyncio.to_thread(server.update_weights_from_disk, data["model_path"], data.get("weight_version"))
        except (ValueError, OSError) as exc:
            return web.json_response({"success": False, "message": f"Failed to update weights: {exc}",
                                      "num_paused_requests": 0}, status=400)
        message = "Succeeded to update model weights."
        if data.get("weight_version") is not None:
            message += f" Weight version updated to {server.weight_version}."
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    def weight_update(method, required: tuple[str, ...], optional: tuple[str, ...], message: str):
        """An SGLang weight endpoint: ``{"success": true, "message"}``, or 400 with success false. Keys
        outside SGLang's request fields are ignored, as SGLang does; a missing required one is a 400."""
        async def handler(request):
            data = await body(request)
            missing = [k for k in required if k not in data]
            if missing:
                return web.json_response({"success": False, "message": f"missing field(s) {missing}"}, status=400)
            if data.get("abort_all_requests"):
                server.abort(abort_all=True)
            try:
                await asyncio.to_thread(method, **{k: data[k] for k in (*required, *optional) if k in data})
            except BadRequest as exc:
                return web.json_response({"success": False, "message": str(exc)}, status=400)
            return web.json_response({"success": True, "message": message})
        return handler

    routes.post("/update_weights_from_tensor")(weight_update(
        server.update_weights_from_tensor, ("serialized_named_tensors",), ("load_format", "weight_version"),
        "Success"))
    routes.post("/init_weights_update_group")(weight_update(
        server.init_weights_update_group, ("master_address", "master_port", "rank_offset", "world_size"),
        ("group_name", "backend"), "Succeeded to initialize custom process group."))
    routes.post("/update_weights_from_distributed")(weight_update(
        server.update_weights_from_distributed, ("names", "dtypes", "shapes"),
        ("group_name", "load_format", "weight_version"), "Succeeded to update parameter online."))
    routes.post("/destroy_weights_update_group")(weight_update(
        server.destroy_weights_update_group, (), ("group_name",), "Succeeded to destroy custom process group."))

    @routes.route("*", "/weights_checker")
    async def weights_checker(request):
        """SGLang's ``CheckWeightsReqInput`` (``action`` ``checksum`` by default); 400 with success false on
        an action it does not know or a ``compare`` that finds a difference."""
        data = await body(request) if request.method == "POST" else {}
        try:
            answer = await asyncio.to_thread(server.check_weights, data.get("action", "checksum"))
        except BadRequest as exc:
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        return web.json_response(answer)

    def memory_occupation(method):
        async def handler(request):
            data = await body(request)
            await asyncio.to_thread(method, data.get("tags"))  # BadRequest -> 400 through the middleware
            return web.json_response(None)
        return handler

    routes.route("*", "/release_memory_occupation")(memory_occupation(server.release_memory_occupation))
    routes.route("*", "/resume_memory_occupation")(memory_occupation(server.resume_memory_occupation))

    @web.middleware
    async def api_key(request, handler):
        """SGLang's --api-key: everything but /health* and /metrics needs ``Authorization: Bearer <key>``."""
        if server.api_key and not request.path.startswith(("/health", "/metrics")):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token, server.api_key):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def bad_requests(request, handler):
        try:
            return await handler(request)
        except BadRequest as exc:
            return _error(str(exc))

    app = web.Application(middlewares=[api_key, bad_requests], client_max_size=64 * 1024**2)
    app.add_routes(routes)
    return app


def run_app(loop: asyncio.AbstractEventLoop, app: web.Application, host: str, port: int) -> int:
    """Start ``app`` on ``loop`` and return the bound port (``port=0`` picks a free one)."""
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, host, port)
    loop.run_until_complete(site.start())
    return site._server.sockets[0].getsockname()[1]
