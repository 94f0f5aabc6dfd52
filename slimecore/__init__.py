"""slime-core: a minimal RL post-training core (Ray loop + hook contract); algorithms are plugins."""

from importlib.metadata import PackageNotFoundError, version

import pluggy

hookimpl = pluggy.HookimplMarker("slimecore")

try:
    __version__ = version("slime-core")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["hookimpl", "__version__"]
