"""What a request says about its cache transfer (the OpenAI field `kv_transfer_params`).

Two shapes, one per side (the proxy, kdaserve/disagg/proxy.py, writes both):
- export (to a prefill instance): `{"transfer_id": ..., "peer": "tcp://host:port",
  "held_tokens": k}`; the instance computes the prompt and the first token, then pushes the
  request's cache to `peer` (the decode instance's kv-transfer address) before it answers,
  all but the first `k` tokens' latents (optional, default 0: the decode instance's answer
  to the hit query, below);
- hit query (to a decode instance): `{"transfer_id": ..., "hold": true}`; the instance
  tokenizes the request as it would to serve it, pins its prefix-cache hit on the prompt
  under the transfer id and answers `{"held_tokens": k}` instead of a completion (the import
  under the same transfer id takes the pinned blocks);
- import (to a decode instance): `{"transfer_id": ..., "first_token_id": t}`; the instance
  takes the prompt's cache from its inbox instead of computing it, appends `t` as the first
  output token and goes on decoding.
Torch-free: it travels inside SamplingParams through the server, the engine and the runner;
the request field is checked in field.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVTransferParams:
    transfer_id: str
    peer: str | None = None             # export: where to push the cache
    first_token_id: int | None = None   # import: the prefill instance's first output token
    held_tokens: int = 0                # export: leading tokens the decode instance holds
    hold: bool = False                  # the hit query (answered, never run)

    @property
    def is_export(self) -> bool:
        return self.peer is not None

    @property
    def is_import(self) -> bool:
        return self.first_token_id is not None
