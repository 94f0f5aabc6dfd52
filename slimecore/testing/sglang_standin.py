"""A CPU stand-in for ``python -m sglang.launch_server``: takes its command line, serves the embedded engine.

    slime-core train --rollout-engine sglang \\
        --sglang-launch-command "python -m slimecore.testing.sglang_standin" ...

runs the whole SGLang launcher path (spawn, ``/health_generate`` wait, router registration, tensor and
distributed weight sync, memory release/resume, shutdown) on a machine without a GPU or SGLang. Every
``--<field>`` must be a field of the installed sglang's ``ServerArgs`` (an unknown one exits with code 2,
as SGLang's argument parser does); the fields a one-process CPU engine can honour are used
(``model_path``, ``host``, ``port``, ``random_seed``, ``api_key``), ``tp_size`` must be 1, and the rest
(``base_gpu_id``, ``mem_fraction_static``, ...) are printed and otherwise ignored.
"""

from __future__ import annotations

import signal
import sys
import threading

USED = {"model_path", "host", "port", "random_seed", "api_key", "tp_size"}


def parse(argv: list[str]) -> dict:
    """``--a-b 1 --flag --c x y --d=-2`` -> ``{"a_b": "1", "flag": True, "c": ["x", "y"], "d": "-2"}``: as argparse,
    ``--flag=value`` gives the value whatever it starts with (slime-core joins a value starting with ``-``, such as an
    API key, to its flag)."""
    args, key = {}, None
    for token in argv:
        if token.startswith("--") and "=" in token:
            name, value = token[2:].split("=", 1)
            args[name.replace("-", "_")], key = value, None
        elif token.startswith("--"):
            key = token[2:].replace("-", "_")
            args[key] = True
        elif key is None:
            raise SystemExit(f"sglang_standin: unexpected argument {token!r}")
        elif args[key] is True:
            args[key] = token
        else:
            args[key] = (args[key] if isinstance(args[key], list) else [args[key]]) + [token]
    return args


def main(argv: list[str] | None = None) -> None:
    from slimecore.sglang_schema import server_args_fields

    args = parse(sys.argv[1:] if argv is None else argv)
    fields = server_args_fields()
    unknown = sorted(set(args) - set(fields)) if fields is not None else []
    if unknown:
        print(f"launch_server: error: unrecognized arguments: {' '.join('--' + k.replace('_', '-') for k in unknown)}",
              file=sys.stderr)
        raise SystemExit(2)
    if "model_path" not in args:
        print("launch_server: error: the following arguments are required: --model-path", file=sys.stderr)
        raise SystemExit(2)
    if int(args.get("tp_size", 1)) != 1:
        raise SystemExit(f"sglang_standin: tp_size {args['tp_size']} needs GPUs; the CPU stand-in serves tp_size 1")
    ignored = {k: v for k, v in args.items() if k not in USED}
    print(f"sglang_standin: serving {args['model_path']} on the embedded CPU engine; ignored: {ignored}", flush=True)

    from slimecore.engines.embedded import EmbeddedServer

    server = EmbeddedServer(args["model_path"], host=args.get("host", "127.0.0.1"), port=int(args.get("port", 30000)),
                            seed=int(args.get("random_seed", 0)), api_key=args.get("api_key"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"sglang_standin: ready at {server.start()}", flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
