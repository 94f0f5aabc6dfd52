"""slime-core shim of ``slime.utils.processing_utils``: ``load_tokenizer``."""

from __future__ import annotations


def load_tokenizer(name_or_path: str, **kwargs):
    """The checkpoint's tokenizer. slime's keyword options (``trust_remote_code``, ``chat_template_path``) are
    accepted and not used: slime-core loads local checkpoints with their own template."""
    from slimecore.hf_checkpoint import load_tokenizer as load

    return load(str(name_or_path))
