"""Kimi K3 against an independent implementation: mlx-lm's kimi_k3 (Apple's code, run on the
CPU through mlx[cpu]) loads the same tiny random checkpoints in the released layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3_models import k3_raw, mlx_greedy, mlx_logits, write_k3_checkpoint
from kdaserve import LLM, SamplingParams
from kdaserve.model.loader import load_model

pytest.importorskip("mlx_lm.models.kimi_k3")

CONFIGS = {
    # attention-residual blocks of 2 over 5 layers (does not divide), SiTU with the up clip,
    # latent MoE with its norm, q-LoRA, MXFP4 experts: the released K3 shape
    "k3_mxfp4": dict(mxfp4=True),
    # no attention-residuals (plain residual stream), no up clip, no latent norm, no q-LoRA
    "plain_fp32": dict(attn_res_block_size=None, activation_situ_linear_beta=None,
                       latent_moe_use_norm=False, q_lora_rank=None),
    # one block of 5 over 5 layers (divides), experts on the full hidden, MXFP4
    "full_width_mxfp4": dict(mxfp4=True, attn_res_block_size=5, routed_expert_hidden_size=None),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 95, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def k3_dir(request, tmp_path_factory):
    over = dict(CONFIGS[request.param])
    mxfp4 = over.pop("mxfp4", False)
    out = tmp_path_factory.mktemp(request.param)
    write_k3_checkpoint(out, k3_raw(mxfp4=mxfp4, **over), seed=len(request.param))
    return out


def test_last_logits_match_mlx(k3_dir):
    ps = prompts(4, 0)
    ref = mlx_logits(k3_dir, ps)
    ours = load_model(k3_dir, progress=False)
    with torch.inference_mode():
        for p, r in zip(ps, ref):
            lo = ours.forward_dense(torch.tensor([p]))[0, -1].numpy()
            assert np.abs(lo - r).max() < 1e-4 * max(1.0, np.abs(r).max())


def test_greedy_identical_to_mlx(k3_dir):
    """Through the engine: batched, one at a time, chunked prefill (prompts longer than the
    step's token budget), and again with prefix-cache hits on the same prompts."""
    ps = prompts(5, 1, lo=20, hi=60)
    want = mlx_greedy(k3_dir, ps, GREEDY.max_tokens)
    llm = LLM(str(k3_dir), block_size=4, max_num_batched_tokens=16, state_snapshot_interval=4)

    def run(batch):
        res = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
        return [r.outputs[0].token_ids for r in res], [r.num_cached_tokens for r in res]

    batched, _ = run(ps)
    assert batched == want
    singles = [run([p])[0][0] for p in ps]
    assert singles == want
    again, cached = run(ps)                     # every prompt was seen: prefix hits
    assert again == want and all(c > 0 for c in cached)
