"""A tiny random HF model and a locally trained tokenizer, built in well under a second, no hub.

The tokenizer is a byte-level BPE trained on a small synthetic corpus (digits, arithmetic, words,
ChatML markers) and carries a ChatML chat template, so everything that runs on SmolLM2 (chat
templates, EOS, log-probs) runs on it too. The checkpoint reloads offline with
``AutoTokenizer.from_pretrained(dir)`` / ``AutoModelForCausalLM.from_pretrained(dir)``.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_VOCAB = 400
# arch -> the transformers class prefix (``Qwen2Config``, ``Qwen2ForCausalLM``)
ARCHS = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral", "qwen3_moe": "Qwen3Moe"}
# the mixture-of-experts arch: 4 experts, top-2, with router weights drawn at std 1 (the default init's 0.02
# sends nearly every token to the same experts)
MOE = {"qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}}
_BUILT: dict[tuple, Path] = {}  # (directory, spec) -> directory, for repeated calls in one process


def _corpus() -> list[str]:
    words = ("apple river stone cloud tiger music green house light paper answer number larger smaller which "
             "what is the only with sort count letter repeat word search information yes no user assistant system "
             "The answer is Let me think step by step")
    lines = [words, "0 1 2 3 4 5 6 7 8 9 10 + - * / = ( ) . , ? !"]
    for a in range(0, 100, 3):
        lines.append(f"Which number is larger: {a} or {99 - a}? Answer with only the number. {max(a, 99 - a)}")
        lines.append(f"What is {a} + {a % 10}? {a + a % 10}. {a} - 1 = {a - 1}. {a} * 2 = {a * 2}")
        lines.append(f"<|im_start|>user\nWhat is {a} + 7?<|im_end|>\n<|im_start|>assistant\n{a + 7}<|im_end|>\n")
    return lines


def build_tokenizer():
    """The byte-level BPE tokenizer (``<|im_end|>`` is EOS, ``<|endoftext|>`` pads) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, additional_special_tokens=["<|im_start|>"],
                                   chat_template=CHAT_TEMPLATE)


def make_tiny_checkpoint(directory: str | Path, arch: str = "qwen2", vocab_size: int | None = None,
                         hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> Path:
    """Write a random-init ``arch`` (a key of ``ARCHS``) fp32 model plus tokenizer to ``directory`` as
    safetensors and return the directory.

    ``vocab_size`` is the model's embedding rows (default: the tokenizer's size); a larger value pads the
    vocabulary the way real checkpoints do. A directory already built with the same arguments is reused
    (a ``tiny.json`` stamp), and repeated calls in one process return at once."""
    directory = Path(directory)
    spec = {"arch": arch, "vocab_size": vocab_size, "hidden": hidden, "layers": layers, "heads": heads,
            "kv_heads": kv_heads, "seed": seed}
    key = (str(directory.resolve()), tuple(spec.items()))
    stamp = directory / "tiny.json"
    if key in _BUILT and stamp.is_file():
        return _BUILT[key]
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        _BUILT[key] = directory
        return directory
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")

    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = build_tokenizer()
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    name = ARCHS[arch]
    config_cls, model_cls = getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")
    moe = {**MOE[arch], "moe_intermediate_size": hidden // 2} if arch in MOE else {}
    config = config_cls(vocab_size=vocab_size or len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        head_dim=hidden // heads, max_position_embeddings=512, tie_word_embeddings=False,
                        eos_token_id=eos, pad_token_id=pad, bos_token_id=None, **moe)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    if moe:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.normal_(0, 1.0)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    stamp.write_text(json.dumps(spec))
    _BUILT[key] = directory
    return directory


def teach_tiny(base: str | Path, out: str | Path, rows: list[tuple[list[int], list[bool]]], steps: int = 150,
               lr: float = 1e-2, batched: bool = True) -> Path:
    """Fine-tune the checkpoint at ``base`` so it writes the ``trained`` tokens of each row (``(token ids, trained
    flags)``), and save it with its tokenizer to ``out``: a tiny model taught a format (a tool call, a search
    action) in seconds, so a test sees the engine itself produce it. The objective is the sum over rows of the
    mean cross-entropy of its trained tokens; ``batched`` computes it in one right-padded batch per step (faster),
    otherwise one unpadded forward per row (the same objective, other float rounding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    width = max(len(ids) for ids, _ in rows)
    groups = [rows] if batched else [[row] for row in rows]
    batches = []
    for group in groups:
        ids = torch.tensor([list(r) + [tokenizer.pad_token_id] * (width - len(r)) for r, _ in group])  # (B, T)
        attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in group])
        trained = torch.tensor([list(t) + [False] * (width - len(t)) for _, t in group])[:, 1:]  # (B, T-1) targets
        if not batched:  # one row: no padding at all
            ids, attention, trained = ids[:, :len(group[0][0])], None, trained[:, :len(group[0][0]) - 1]
        batches.append((ids, attention, trained))
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared 2-core machine
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            loss = 0.0
            for ids, attention, trained in batches:
                logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # (B, T-1, V) predicts ids[:, 1:]
                if batched:
                    token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
                    loss = loss + ((token_loss * trained).sum(1) / trained.sum(1)).sum()
                else:
                    loss = loss + torch.nn.functional.cross_entropy(logits[0][trained[0]], ids[0, 1:][trained[0]])
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
