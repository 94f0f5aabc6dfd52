"""An example Verifiers taskset built from local data (``compare.jsonl``, shipped in this package): which of two
numbers is larger. Its id is this package's name, ``slime_vf_compare`` (``--vf-env slime_vf_compare``)."""

from slime_vf_compare.taskset import CompareTaskset

__all__ = ["CompareTaskset"]
