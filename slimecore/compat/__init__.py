"""What lets a slime user's files import ``slime`` unchanged: a small shim package, ``slimecore/compat/slime``.

It is not THUDM/slime. It provides only the names slime users' custom functions import (listed in
``docs/hooks.md``), each backed by slime-core: ``slime.utils.types.Sample`` *is* ``slimecore.types.Sample``,
``DynamicFilterOutput`` is ``slimecore.types.FilterResult``, ``post`` talks to the run's router ... A name it
does not provide fails with Python's ordinary ImportError.

The adapter (``slimecore.defaults.slime_compat.install_shim``) puts the shim on ``sys.path`` only when no real
``slime`` package is importable; with THUDM/slime installed, ``import slime`` keeps meaning slime, and the adapter
takes its samples as they are (same field names). This package holds no code: the shim imports the adapter, and
the adapter only names this folder.
"""
