"""The deployment model behind `kdaserve plan`: bytes per GPU by kind, what fits, a roofline
for prefill and decode with the interconnect's costs, and what a token costs.

Parameters come from `kdaserve inspect`'s count (model/inspect.py `measure`: the model built on
the meta device), so the plan's totals equal inspect's exactly. Layouts: tp ranks shard
attention, dense MLPs, shared experts and the vocabulary; routed experts are partitioned over ep
ranks (or sharded over tp when ep is 1); dp attention replicas (DEP) split the requests; pp
stages split the layers. MLA latents are whole on every tp rank (absorbed MLA reads them all),
KDA states are split by heads. Estimates, not measurements: every figure is a bound from bytes,
FLOP/s and link speeds of the hardware table, and says so in its name where it is one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kdaserve.cache.spec import specs_for
from kdaserve.model.inspect import measure
from kdaserve.model_config import ModelConfig
from kdaserve.plan.hardware import Hardware

# bits per routed-expert weight, scales included
EXPERT_BITS = {"mxfp4": 4 + 8 / 32, "int4": 4 + 16 / 128, "fp8": 8 + 32 / (128 * 128),
               "bf16": 16}
SHARDED = ("KDA", "MLA", "dense MLP", "shared experts", "latent MoE projections",
           "embedding", "LM head")
MFU = 0.5                  # prefill: share of peak tensor FLOP/s reached
BW_SHARE = 0.8             # decode: share of peak memory bandwidth reached
MAX_BATCH = 1024           # the largest batch planned for


@dataclass(frozen=True)
class Layout:
    tp: int
    ep: int
    pp: int
    dp: int
    moe_backend: str
    reason: str

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp


@dataclass
class Plan:
    total_params: int
    active_params: int
    layout: dict
    bytes_per_gpu: dict              # by kind
    weights_bytes_per_gpu: int
    kda_state_bytes_per_request: int  # per GPU
    mla_bytes_per_token: int          # per GPU
    fits: bool
    max_requests_at_context: int
    max_context_single_request: int
    prefill_tok_s: float
    decode_tpot_ms_batch1: float
    decode_batch_memory_limited: int
    decode_tpot_ms_memory_limited: float
    decode_output_tok_s_memory_limited: float
    spec_decode_tok_s_batch1: float | None
    cost_per_hour: float
    cost_per_million_output_tokens: float
    break_even_days: float | None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Roofline:
    """What one engine step costs on a layout, from bytes, FLOP/s and link speeds: the decode
    figures of the plan and the per-step cost of `plan --simulate` (kdaserve/plan/simulate.py).
    Byte fields are per GPU."""

    cfg: ModelConfig
    hw: Hardware
    quant: str
    tp: int
    ep: int
    pp: int
    dp: int
    active: int                     # parameters per token
    sharded: float
    experts: float
    replicated: float
    kda: float                      # one request's KDA state
    mla: float                      # one token's MLA latents

    def seconds(self, tokens: int, rows: int, kv_tokens: int, replicas: int = 1) -> float:
        """One step of `tokens` tokens over `rows` requests whose attention reads `kv_tokens`
        cached tokens, on each of `replicas` dp replicas. A token goes through every pipeline
        stage in turn: pp stage times (no micro-batch overlap counted, a bound on latency and
        throughput alike)."""
        cfg, hw, tp, ep, pp, dp = self.cfg, self.hw, self.tp, self.ep, self.pp, self.dp
        every = tokens * replicas
        touched = 1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** every \
            if cfg.num_experts else 1.0
        read = (self.sharded + self.replicated + self.experts * touched
                + rows * 2 * self.kda + self.mla * kv_tokens)
        t_mem = read / (hw.memory_bw * BW_SHARE)
        # activations are bf16 (fp8 with fp8 weights): packed 4-bit experts are widened to
        # them, so the tensor rate is bf16's, at the prefill's share of the peak
        t_flop = 2 * self.active / (tp * dp * pp) * every / (
            hw.flops("fp8" if self.quant == "fp8" else "bf16") * MFU)
        layers = cfg.num_hidden_layers
        comm = 0.0
        msg = tokens * cfg.hidden_size * 2
        if tp > 1:                  # two all-reduces a layer (attention out, MoE out): small
            # messages cost hops (a tree: 1 + log2 tp), large ones bandwidth (a ring)
            comm += layers / pp * 2 * (hw.link_latency_s * (1 + math.log2(tp))
                                       + 2 * msg * (tp - 1) / tp / hw.link_bw)
        if ep > 1:                  # dispatch and combine a MoE layer
            bw, lat = (hw.net_bw, hw.net_latency_s) if dp > 1 else (hw.link_bw,
                                                                    hw.link_latency_s)
            sent = tokens * cfg.expert_width * 2 * cfg.num_experts_per_token  # latent MoE: small
            comm += len(cfg.moe_layers) / pp * 2 * (lat + sent / bw)   # one round each
        hops = (pp - 1) * (hw.net_latency_s + msg / hw.net_bw)     # stage to stage
        return pp * (max(t_mem, t_flop) + comm) + hops


def recommend(cfg: ModelConfig, hw: Hardware, gpus: int, nodes: int) -> Layout:
    """TP inside a node; PP across nodes on slow networks, DEP (dp × tp with experts over all)
    on fast ones; routed experts by all-to-all where the link is fast and experts many."""
    per_node = max(1, gpus // nodes)
    tp = per_node
    slow_net = hw.net_bw < 200e9
    if nodes > 1 and slow_net:
        pp, dp = nodes, 1
        why = (f"TP{tp} inside each node, PP{pp} across nodes: the network "
               f"({hw.net_bw / 1e9:.0f} GB/s) is too slow for a collective every layer")
    else:
        pp, dp = 1, nodes
        why = (f"TP{tp} inside each node" + (f", DP{dp} attention replicas over a fast "
               f"network ({hw.net_bw / 1e9:.0f} GB/s)" if nodes > 1 else ""))
    ep = tp * dp
    many = cfg.num_experts and cfg.num_experts >= 4 * ep
    if many and hw.link_bw >= 100e9 and ep > 1:
        backend = "ep_all2all"
        why += (f"; {cfg.num_experts} experts partitioned over EP{ep} with all-to-all "
                f"(link {hw.link_bw / 1e9:.0f} GB/s): each GPU reads only its experts")
    else:
        backend, ep = "tp_sharded", 1
        why += "; experts sharded over the TP ranks (few experts, or a slow link)"
    return Layout(tp, ep, pp, dp, backend, why)


def _bytes_by_part(cfg: ModelConfig, quant: str) -> tuple[dict[str, float], int, int]:
    size = measure(cfg, "bfloat16")
    out = {}
    for part, n in size.params.items():
        if part == "routed experts":
            out[part] = n * EXPERT_BITS[quant] / 8
        elif quant == "fp8" and part in ("KDA", "MLA", "dense MLP", "shared experts"):
            out[part] = n * (1 + 4 / (128 * 128))
        else:
            out[part] = n * 2.0
    return out, size.total, int(size.total_active)


def roofline(cfg: ModelConfig, hw: Hardware, layout: Layout, quant: str = "mxfp4",
             cache_dtype: str = "bfloat16") -> tuple[Roofline, int]:
    """The layout's per-GPU bytes as a step cost model, and the model's total parameters."""
    parts, total, active = _bytes_by_part(cfg, quant)
    tp, ep, pp, dp = layout.tp, layout.ep, layout.pp, layout.dp
    sharded = sum(v for k, v in parts.items() if k in SHARDED) / tp / pp
    experts = parts.get("routed experts", 0.0) / (ep if ep > 1 else tp) / pp
    replicated = sum(v for k, v in parts.items()
                     if k not in SHARDED and k != "routed experts") / pp
    latent, state = specs_for(cfg, 16, cache_dtype)
    return Roofline(cfg, hw, quant, tp, ep, pp, dp, active, sharded, experts, replicated,
                    state.bytes_per_slot / tp / pp, latent.bytes_per_token / pp), total


def plan(cfg: ModelConfig, hw: Hardware, layout: Layout, quant: str = "mxfp4",
         context: int = 131072, cache_dtype: str = "bfloat16", memory_util: float = 0.9,
         acceptance_length: float | None = None, api_price: float | None = None,
         roof: tuple[Roofline, int] | None = None) -> Plan:
    """`roof`: `roofline(...)`'s answer for these arguments, when the caller has it (it counts
    the parameters by building the model on the meta device: seconds for K3)."""
    roof, total = roof or roofline(cfg, hw, layout, quant, cache_dtype)
    tp, dp = layout.tp, layout.dp
    sharded, experts, replicated = roof.sharded, roof.experts, roof.replicated
    kda, mla, active = roof.kda, roof.mla, roof.active
    weights = sharded + experts + replicated
    act = 8192 * cfg.hidden_size * 2 * 24 / tp + 1e9      # step buffers and graph pools
    free = hw.memory_bytes * memory_util - weights - act
    per_req = kda + mla * context
    max_reqs = max(0, int(free // per_req)) * dp if free > 0 else 0
    max_ctx = int((free - kda) // mla) if free > kda else 0

    def tpot(batch: int, replicas: int = 1) -> float:
        """Seconds per output token of a request, `batch` requests of `context` tokens on each
        of `replicas` dp replicas (speculation's tokens count as requests: a step reads the
        same bytes)."""
        return roof.seconds(batch, batch, batch * context, replicas)

    t1 = tpot(1)
    b_mem = max(1, min(MAX_BATCH, max_reqs // dp if dp else 0))
    tb = tpot(b_mem, dp)
    tok_s = b_mem * dp / tb
    spec = None
    if acceptance_length:          # one verify step of 1 + k tokens yields L of them
        k = max(1, round(2 * acceptance_length))
        spec = acceptance_length / (tpot(1 + k) * 1.1)   # + about a tenth for the draft
    prefill = hw.flops("fp8" if quant == "fp8" else "bf16") * layout.gpus * MFU / (2 * active)
    per_hour = hw.price_per_hour * layout.gpus
    per_m = per_hour / (tok_s * 3600) * 1e6
    breakeven = None
    if api_price:                  # the purchase over the API's bill for the same tokens
        api_per_day = tok_s * 86400 / 1e6 * api_price             # (power, staff: not counted)
        breakeven = hw.purchase_price * layout.gpus / api_per_day
    return Plan(
        total_params=total, active_params=active, layout=asdict(layout),
        bytes_per_gpu={"tp_sharded": int(sharded), "ep_partitioned_experts": int(experts),
                       "replicated": int(replicated), "activations_and_graphs": int(act),
                       "free_for_cache": int(max(free, 0))},
        weights_bytes_per_gpu=int(weights), kda_state_bytes_per_request=int(kda),
        mla_bytes_per_token=int(mla), fits=free > kda + mla,
        max_requests_at_context=max_reqs, max_context_single_request=max_ctx,
        prefill_tok_s=round(prefill, 1), decode_tpot_ms_batch1=round(t1 * 1e3, 3),
        decode_batch_memory_limited=b_mem * dp,
        decode_tpot_ms_memory_limited=round(tb * 1e3, 3),
        decode_output_tok_s_memory_limited=round(tok_s, 1),
        spec_decode_tok_s_batch1=None if spec is None else round(spec, 1),
        cost_per_hour=round(per_hour, 2), cost_per_million_output_tokens=round(per_m, 4),
        break_even_days=None if breakeven is None else round(breakeven, 1))
