"""Session fixtures: the tiny checkpoint, Ray, and embedded engines behind the real router."""

from __future__ import annotations

import pytest

from slimecore.testing.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 << 20, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    """Two embedded engines on threads of this process, behind one real sglang-router."""
    from slimecore.engines.embedded import EmbeddedServer
    from slimecore.engines.router import Router

    servers = [EmbeddedServer(str(tiny_checkpoint), seed=i) for i in range(2)]
    urls = [s.start() for s in servers]
    router = Router(urls).start()
    yield servers, router
    router.stop()
    for server in servers:
        server.stop()
