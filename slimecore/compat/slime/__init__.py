"""slime-core's compatibility shim for ``import slime`` in slime users' files: not THUDM/slime.

See ``slimecore/compat/__init__.py`` and the "slime compatibility" section of slime-core's ``docs/hooks.md``.
"""
