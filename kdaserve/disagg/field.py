"""The request field `kv_transfer_params` (kdaserve/disagg/params.py), checked: a bad one is a
400 naming the field."""

from __future__ import annotations

import re
from typing import Any

from kdaserve.disagg.params import KVTransferParams
from kdaserve.request import SamplingParamsError

_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_PEER = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


def parse_kv_transfer(raw: Any) -> KVTransferParams | None:
    """The request field, checked; SamplingParamsError (HTTP 400) naming it otherwise."""
    if raw is None:
        return None
    field = "kv_transfer_params"
    if not isinstance(raw, dict):
        raise SamplingParamsError("kv_transfer_params must be an object", field)
    unknown = set(raw) - {"transfer_id", "peer", "first_token_id", "held_tokens", "hold"}
    if unknown:
        raise SamplingParamsError(f"kv_transfer_params: unknown keys {sorted(unknown)}", field)
    tid, peer, first = raw.get("transfer_id"), raw.get("peer"), raw.get("first_token_id")
    if not isinstance(tid, str) or not _ID.match(tid):
        raise SamplingParamsError("kv_transfer_params.transfer_id must be 1-128 characters of "
                                  "[A-Za-z0-9._:-]", field)
    hold, held = raw.get("hold", False), raw.get("held_tokens", 0)
    if not isinstance(hold, bool):
        raise SamplingParamsError("kv_transfer_params.hold must be true or false", field)
    if hold:
        if peer is not None or first is not None or "held_tokens" in raw:
            raise SamplingParamsError("kv_transfer_params with 'hold' (the hit query, to a "
                                      "decode instance) takes only 'transfer_id'", field)
        return KVTransferParams(tid, hold=True)
    if (peer is None) == (first is None):
        raise SamplingParamsError("kv_transfer_params needs exactly one of 'peer' (export, "
                                  "to a prefill instance) and 'first_token_id' (import, to a "
                                  "decode instance)", field)
    if not isinstance(held, int) or isinstance(held, bool) or held < 0 or (
            held and peer is None):
        raise SamplingParamsError("kv_transfer_params.held_tokens must be a token count, "
                                  "with 'peer' (export)", field)
    if peer is not None and (not isinstance(peer, str) or not _PEER.match(peer)):
        raise SamplingParamsError("kv_transfer_params.peer must be tcp://HOST:PORT", field)
    if first is not None and (not isinstance(first, int) or isinstance(first, bool)
                              or first < 0):
        raise SamplingParamsError("kv_transfer_params.first_token_id must be a token id",
                                  field)
    return KVTransferParams(tid, peer, first, held)
