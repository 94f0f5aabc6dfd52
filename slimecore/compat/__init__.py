"""What lets a slime user's files import ``slime`` unchanged: a small shim package, ``slimecore/compat/slime``.

It is not THUDM/slime. It provides only the names slime users' custom functions import (listed in
``docs/hooks.md``), each backed by slime-core: ``slime.utils.types.Sample`` *is* ``slimecore.types.Sample``,
``DynamicFilterOutput`` is ``slimecore.types.FilterResult``, ``post`` talks to the run's router ... A name it
does not provide fails with Python's ordinary ImportError.

:func:`install` puts the shim on ``sys.path`` only when no real ``slime`` package is importable; with THUDM/slime
installed, ``import slime`` keeps meaning slime, and the adapter (``slimecore.defaults.slime_compat``) takes its
samples as they are (same field names).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SHIM_ROOT = str(Path(__file__).resolve().parent)


def install() -> bool:
    """Make ``import slime`` resolve to the shim unless a real slime is installed; True if the shim is used."""
    if SHIM_ROOT in sys.path:
        return True
    if importlib.util.find_spec("slime") is not None:
        return False
    sys.path.append(SHIM_ROOT)
    return True
