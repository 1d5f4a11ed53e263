"""What a request says about its cache transfer (the OpenAI field `kv_transfer_params`).

Two shapes, one per side (the proxy, kdaserve/disagg/proxy.py, writes both):
- export (to a prefill instance): `{"transfer_id": ..., "peer": "tcp://host:port"}`; the
  instance computes the prompt and the first token, then pushes the request's cache to `peer`
  (the decode instance's kv-transfer address) before it answers;
- import (to a decode instance): `{"transfer_id": ..., "first_token_id": t}`; the instance
  takes the prompt's cache from its inbox instead of computing it, appends `t` as the first
  output token and goes on decoding.
Torch-free: it travels inside SamplingParams through the server, the engine and the runner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_PEER = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


@dataclass
class KVTransferParams:
    transfer_id: str
    peer: str | None = None             # export: where to push the cache
    first_token_id: int | None = None   # import: the prefill instance's first output token

    @property
    def is_export(self) -> bool:
        return self.peer is not None

    @property
    def is_import(self) -> bool:
        return self.first_token_id is not None


def parse_kv_transfer(raw: Any) -> KVTransferParams | None:
    """The request field, checked; SamplingParamsError (HTTP 400) naming it otherwise."""
    from kdaserve.request import SamplingParamsError     # request.py imports this module

    if raw is None:
        return None
    field = "kv_transfer_params"
    if not isinstance(raw, dict):
        raise SamplingParamsError("kv_transfer_params must be an object", field)
    unknown = set(raw) - {"transfer_id", "peer", "first_token_id"}
    if unknown:
        raise SamplingParamsError(f"kv_transfer_params: unknown keys {sorted(unknown)}", field)
    tid, peer, first = raw.get("transfer_id"), raw.get("peer"), raw.get("first_token_id")
    if not isinstance(tid, str) or not _ID.match(tid):
        raise SamplingParamsError("kv_transfer_params.transfer_id must be 1-128 characters of "
                                  "[A-Za-z0-9._:-]", field)
    if (peer is None) == (first is None):
        raise SamplingParamsError("kv_transfer_params needs exactly one of 'peer' (export, "
                                  "to a prefill instance) and 'first_token_id' (import, to a "
                                  "decode instance)", field)
    if peer is not None and (not isinstance(peer, str) or not _PEER.match(peer)):
        raise SamplingParamsError("kv_transfer_params.peer must be tcp://HOST:PORT", field)
    if first is not None and (not isinstance(first, int) or isinstance(first, bool)
                              or first < 0):
        raise SamplingParamsError("kv_transfer_params.first_token_id must be a token id",
                                  field)
    return KVTransferParams(tid, peer, first)
