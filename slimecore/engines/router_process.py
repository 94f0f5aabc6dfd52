"""The sglang-router's process (``slimecore.engines.router.Router.spawn`` runs ``python -m`` this module).

It does what ``python -m sglang_router.launch_router`` does: the same argument parser (``RouterArgs``), the
``sglang::router`` process title, ``Router.from_args(args).start()`` (the Rust router). It leaves out the
launcher's import of the package's Python debugging load balancer (fastapi, uvicorn, aiohttp and sglang),
which was 0.6 s of CPU at every start on a 2-core machine, spent while the engines and the trainer load.
A package without ``sglang_router.router_args`` gets its own launcher."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> None:
    try:
        from sglang_router.router import Router
        from sglang_router.router_args import RouterArgs
    except ImportError:
        from sglang_router.launch_router import main as launch

        sys.argv = [sys.argv[0], *argv]
        launch()
        return
    try:
        import setproctitle

        setproctitle.setproctitle("sglang::router")
    except ImportError:
        pass
    parser = argparse.ArgumentParser(prog="sglang-router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    validate = getattr(args, "_validate_router_args", None)
    if validate is not None:
        validate()
    Router.from_args(args).start()


if __name__ == "__main__":
    main(sys.argv[1:])
