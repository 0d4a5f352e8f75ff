"""The names of the losses a language model's job computes (``--loss``), as the CLI, a task and the wire spell
them: their grammar and their one canonical spelling.

Torch-free, so that the server validates and matches a name with this alone; what each loss computes and keeps for
the backward is ``autotune.tasks.losses``.

- ``plain``: the model's own forward, the logits of every position whole, then the cross entropy (what
  transformers' ``ForCausalLMLoss`` does). The default: a job with it keeps every fingerprint it had.
- ``chunked:N``: TRL's chunked NLL (``SFTConfig(loss_type="chunked_nll")``, TRL's default): the head and the cross
  entropy over chunks of N tokens, each chunk recomputed in the backward (gradient checkpointing), so at most one
  chunk's logits are whole. N is tokens per chunk, as TRL's argument is; ``chunked`` alone is TRL's 256.
- ``fused-linear``: Liger-Kernel's fused linear cross entropy (``LigerFusedLinearCrossEntropyFunction``): the head
  and the loss in chunks whose gradients (of the hidden states and of the head's weight) are computed during the
  forward, so that the backward only scales them.

The canonical spelling is what a profile stores and ``/suggest`` matches by equality: ``chunked`` is written with
its size, without leading zeros.

    >>> canonical_loss("chunked"), canonical_loss("chunked:0128"), canonical_loss("fused-linear")
    ('chunked:256', 'chunked:128', 'fused-linear')
    >>> chunk_tokens("chunked:512"), chunk_tokens("plain")
    (512, None)
"""

from __future__ import annotations

import re

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "LOSS_NAMES",
    "LOSS_TAG",
    "LOSS_PATTERN",
    "MAX_CHUNK_TOKENS",
    "PLAIN_LOSS",
    "canonical_loss",
    "chunk_tokens",
]

PLAIN_LOSS = "plain"
# The task's tag (and so the profile's and the fingerprint's) that names a loss other than the plain one: the plain
# loss adds none, so that every fingerprint from before --loss stays what it was.
LOSS_TAG = "lm_loss"
# The names, in the order of the menus (chunked:N is valid beyond chunked).
LOSS_NAMES = (PLAIN_LOSS, "chunked", "fused-linear")
# TRL's _CHUNKED_LM_HEAD_CHUNK_SIZE (trl/trainer/sft_trainer.py): the tokens of one chunk of chunked_nll.
DEFAULT_CHUNK_TOKENS = 256
# No sequence of a published model reaches 2**24 tokens; a larger chunk is the plain loss with extra steps.
MAX_CHUNK_TOKENS = 2**24
# What the server checks (torch-free, as a pydantic pattern); canonical_loss says why a name fails.
LOSS_PATTERN = r"^(?:plain|fused-linear|chunked(?::[0-9]{1,9})?)$"


def canonical_loss(text: str) -> str:
    """The one spelling of a loss's name (the module docstring's grammar).

    Raises:
        ValueError: not a loss's name, or a chunk of no tokens or of more than MAX_CHUNK_TOKENS; one line naming
            the names.
    """
    name, colon, size = text.strip().partition(":")
    if name == "chunked":
        if not colon:
            return f"chunked:{DEFAULT_CHUNK_TOKENS}"
        if not re.fullmatch(r"[0-9]{1,9}", size):
            raise ValueError(f"{text!r}: chunked:N takes N tokens per chunk, a positive integer (chunked:256)")
        tokens = int(size)
        if not 1 <= tokens <= MAX_CHUNK_TOKENS:
            raise ValueError(
                f"{text!r}: a chunk holds 1 to {MAX_CHUNK_TOKENS} tokens (N is tokens per chunk, TRL's 256 by default)"
            )
        return f"chunked:{tokens}"
    if name in (PLAIN_LOSS, "fused-linear") and not colon:
        return name
    raise ValueError(f"{text!r} is not a loss: use plain, chunked[:N] (N tokens per chunk) or fused-linear")


def chunk_tokens(loss: str) -> int | None:
    """The tokens of one chunk of a canonical ``chunked:N``; None for another loss."""
    name, _, size = loss.partition(":")
    return int(size) if name == "chunked" else None
