"""``python -m slime_openenv.serve APP HOST PORT``: serve an OpenEnv server app with uvicorn until stopped, or until
the process that started it is gone (a rollout process killed outright cannot stop it, so it stops itself)."""

from __future__ import annotations

import os
import sys
import threading
import time

import uvicorn


def exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> None:
    app, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    uvicorn.run(app, host=host, port=port, log_level="warning")


if __name__ == "__main__":
    main()
