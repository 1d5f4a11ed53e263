"""What the server checks before any work is queued: input sizes and encodings, token ids, and
the per-request and queue limits that keep one client from hurting the others.

Every check is O(input bytes) in C-speed string operations, run before tokenizing, so a
10 MB prompt is refused in milliseconds (tokenizing it would block for seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.server.errors import APIError

# a prompt longer than max_model_len × this many bytes cannot fit whatever the tokenizer,
# when the tokenizer cannot say its longest token
DEFAULT_MAX_TOKEN_BYTES = 64


@dataclass(frozen=True)
class ServerLimits:
    """The server's admission limits (flags of `kdaserve serve`; docs/reliability.md)."""

    max_seqs_per_request: int = 128        # n × prompts of one HTTP request
    default_max_tokens: int = 1024         # chat requests that give no max_tokens
    request_timeout_s: float | None = 600.0
    health_timeout_s: float = 10.0         # engine silent longer than this: /health is 503
    shutdown_timeout_s: float = 30.0       # SIGTERM: time running streams get to finish
    retry_after_s: int = 1                 # Retry-After of 503 answers
    max_token_bytes: int = DEFAULT_MAX_TOKEN_BYTES
    allow_special_tokens: bool = False     # special tokens typed in prompts stay control ids


def check_text(text: str, param: str, max_model_len: int, limits: ServerLimits) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate cannot be encoded, so no
    tokenizer can read it) or that is too long to fit the context whatever its tokens."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} is not valid Unicode ({exc.reason} at character "
                       f"{exc.start}): lone surrogates cannot be tokenized",
                       param=param) from None
    most = max_model_len * limits.max_token_bytes
    if size > most:
        raise APIError(400, f"{param} has {size} bytes; at most {most} can fit the maximum "
                       f"context of {max_model_len} tokens", param=param,
                       code="context_length_exceeded")


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        shown = bad if abs(bad) < 10**30 else f"{str(bad)[:12]}... ({len(str(bad))} digits)"
        raise APIError(400, f"token ids must be in [0, {vocab_size}), got {shown}", param=param)


def check_sequences(num_prompts: int, n: int, limits: ServerLimits) -> None:
    if num_prompts * n > limits.max_seqs_per_request:
        raise APIError(400, f"this request asks for {num_prompts} prompt(s) × n={n} = "
                       f"{num_prompts * n} sequences; at most {limits.max_seqs_per_request} "
                       "are allowed per request", param="n", code="too_many_sequences")
