"""The transfer's wire format: a typed msgspec header, then one raw frame per buffer.

Never pickle: the header is msgpack of the Structs below, and each buffer is the raw bytes of
one tensor (C order), described in the header by name, dtype, shape and an xxh3-64 checksum.
The buffers of one request (or of one part of it, in push mode), in this order:
  mla.{i}        [num_tokens, latent_dim]  the i-th MLA layer's latents, token by token (not
                                           by block: the receiver may use another block size),
                                           from token `held_tokens` on (the hit query)
  kda_state.{j}  [H, K, V] fp32            the j-th KDA layer's recurrent state
  kda_conv.{j}   [K-1, conv_dim]           its conv window (q, k, v inputs)
  draft.{i}      [num_tokens, D']          with a DSpark draft: its i-th layer's context
  draft_valid    [num_tokens] uint8        latents, and which positions hold context
A receiver refuses a header whose model identity, layout, TP layout or transport differs from
its own, and a buffer whose size or checksum does not match (`check_buffers`). A TP=N sender
sends one message per rank (its KDA heads; the latents from rank 0 only), which a TP=1
receiver joins (tp_layout.py): the layouts are compared whole.
Torch-free: the engine side (transfer.py) turns tensors into these buffers and back.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import xxhash

VERSION = 2                   # 2: held_tokens (the hit query)


class CacheLayout(msgspec.Struct, frozen=True):
    """What both sides must agree on (block size is not in it: latents travel per token)."""

    dtype: str
    mla_layers: list[int]
    mla_latent_dim: int
    kda_layers: list[int]
    kda_num_heads: int            # heads on this rank (TP shards KDA by head)
    kda_head_dim: int
    conv_kernel_size: int
    kda_conv_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    # the DSpark draft's pages (0: no draft); optional, so not compared (`comparable`)
    draft_layers: int = 0
    draft_latent_dim: int = 0

    def whole(self) -> CacheLayout:
        """The whole model's layout (TP=1) that this rank's layout is a shard of."""
        tp = self.tp_size
        return msgspec.structs.replace(self, kda_num_heads=self.kda_num_heads * tp,
                                       kda_conv_dim=self.kda_conv_dim * tp, tp_size=1,
                                       tp_rank=0)


class BufferSpec(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    xxh3: int


class TransferHeader(msgspec.Struct, frozen=True, tag="transfer"):
    version: int
    transfer_id: str
    model_identity: str           # hex (kdaserve/cache/identity.py, block size left out)
    layout: CacheLayout
    num_tokens: int
    token_hash: int               # xxh3-64 of the first num_tokens token ids
    first_token_id: int
    buffers: list[BufferSpec]
    # push mode: the latents of tokens [token_start, num_tokens) in part `part`; parts before
    # the last (`final` False, MLA buffers only, first_token_id -1) are pushed while the
    # prompt is still being computed; the final one adds the KDA states
    part: int = 0
    token_start: int = 0
    final: bool = True
    # how the buffers travel: "zmq" (raw frames after this header) or "nixl" (an offer after
    # it; the receiver READs them, nixl_connector.py); set by the sending connector
    transport: str = "zmq"
    # the sender's DSpark draft (identity of its weights; "" without one), and the drafts it
    # proposed after the first token: the receiver's first step verifies them, as the
    # colocated engine's second step would
    draft_identity: str = ""
    draft_token_ids: list[int] = msgspec.field(default_factory=list)
    # the hit query: the receiver holds the first `held_tokens` tokens already (it said so
    # before the prompt was computed), so the transfer's per-token buffers (latents, draft
    # pages) cover tokens [held_tokens, num_tokens) once its parts are joined
    held_tokens: int = 0


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    transfer_id: str
    ok: bool
    error: str = ""


class TransferRefused(ValueError):
    """A transfer that this instance cannot take (another model, layout, a bad checksum)."""


_header_dec = msgspec.msgpack.Decoder(TransferHeader)
_ack_dec = msgspec.msgpack.Decoder(Ack)
encode = msgspec.msgpack.encode


def decode_header(frame: bytes) -> TransferHeader:
    try:
        return _header_dec.decode(frame)
    except msgspec.DecodeError as exc:
        raise TransferRefused(f"not a transfer header: {exc}") from None


def decode_ack(frame: bytes) -> Ack:
    return _ack_dec.decode(frame)


def token_hash(token_ids: Sequence[int]) -> int:
    return xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in token_ids))


def checksum(buf: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def check_buffers(header: TransferHeader, frames: Sequence[memoryview | bytes]) -> None:
    """Every buffer arrived whole and unchanged."""
    if len(frames) != len(header.buffers):
        raise TransferRefused(f"transfer {header.transfer_id}: {len(frames)} buffers arrived, "
                              f"the header lists {len(header.buffers)}")
    for spec, f in zip(header.buffers, frames):
        if len(f) != spec.nbytes:
            raise TransferRefused(f"transfer {header.transfer_id}: buffer {spec.name} has "
                                  f"{len(f)} bytes, the header says {spec.nbytes}")
        if checksum(f) != spec.xxh3:
            raise TransferRefused(f"transfer {header.transfer_id}: buffer {spec.name} fails "
                                  "its checksum")


def check_compatible(header: TransferHeader, identity: str, layout: CacheLayout,
                     transport: str = "zmq") -> None:
    """The header was written by the same model with the same cache layout, and sent over
    the connector this instance receives with."""
    if header.version != VERSION:
        raise TransferRefused(f"transfer format {header.version}; this instance reads "
                              f"{VERSION}")
    if header.transport != transport:
        raise TransferRefused(f"transfer {header.transfer_id} "
                              f"was sent over {header.transport}; this instance receives "
                              f"over {transport}: give both sides the same --kv-connector")
    if header.model_identity != identity:
        raise TransferRefused(f"transfer {header.transfer_id} comes from another model "
                              f"(identity {header.model_identity[:16]}, this instance "
                              f"{identity[:16]}): both sides must serve the same weights")
    theirs = header.layout
    if layout.tp_size == 1:       # a TP=N sender's shards are joined here (tp_layout.py)
        theirs = theirs.whole()
    # either side may speculate with a draft or not: its pages are taken only where both
    # have the same draft (transfer.py)
    theirs = msgspec.structs.replace(theirs, draft_layers=0, draft_latent_dim=0)
    layout = msgspec.structs.replace(layout, draft_layers=0, draft_latent_dim=0)
    if theirs != layout:
        diff = [f for f in layout.__struct_fields__
                if getattr(theirs, f) != getattr(layout, f)]
        raise TransferRefused(f"transfer {header.transfer_id} has another cache layout "
                              f"(differs in {', '.join(diff)}: sender "
                              f"{[getattr(theirs, f) for f in diff]}, this instance "
                              f"{[getattr(layout, f) for f in diff]})")


def expected_names(layout: CacheLayout) -> list[str]:
    """The buffers a rank sends: the MLA latents (and the draft's pages) are the same on every
    tensor-parallel rank, so only rank 0 sends them."""
    return cache_names(layout) + draft_names(layout)


def cache_names(layout: CacheLayout) -> list[str]:
    mla = len(layout.mla_layers) if layout.tp_rank == 0 else 0
    return ([f"mla.{i}" for i in range(mla)]
            + [f"kda_state.{j}" for j in range(len(layout.kda_layers))]
            + [f"kda_conv.{j}" for j in range(len(layout.kda_layers))])


def draft_names(layout: CacheLayout) -> list[str]:
    """draft.{i} [num_tokens, draft_latent_dim] per draft layer, then draft_valid
    [num_tokens] uint8 (which positions hold draft context)."""
    if layout.tp_rank or not layout.draft_layers:
        return []
    return [f"draft.{i}" for i in range(layout.draft_layers)] + ["draft_valid"]
