"""The DSpark drafter end to end: greedy output is token-identical with a random (bad) draft on a
tiny checkpoint and with the bundled demo draft; the training loop runs from the CLI pieces."""

from __future__ import annotations

import json

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.assets import kimi_linear_demo_path
from kdaserve.model.dspark import DraftConfig, DSparkDraft
from kdaserve.model.registry import load_config


def _random_draft(model_dir, out, block: int, seed: int = 0, conditioned: bool = False):
    cfg = load_config(model_dir)
    torch.manual_seed(seed)
    dc = DraftConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                     target_layer_ids=(0, cfg.num_hidden_layers - 1), block_size=block,
                     num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
                     qk_rope_head_dim=4, v_head_dim=8, intermediate_size=32, markov_rank=4,
                     temperature_conditioning=conditioned)
    draft = DSparkDraft(dc)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.3)
    draft.save_pretrained(out)
    return out


def _greedy(llm, prompts, n=20, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.cache.all_free()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts(hf_checkpoint):
    _, hf = hf_checkpoint
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 40, (10,), generator=g).tolist()
    return [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_random_draft_is_identical(hf_checkpoint, prompts, tmp_path, k):
    path, _ = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=6)
    ref = _greedy(LLM(str(path)), prompts)
    llm = LLM(str(path), speculative_method="dspark",
              speculative_adaptive=False, num_speculative_tokens=k,
              speculative_model=str(draft))
    assert _greedy(llm, prompts) == ref
    assert llm.engine.scheduler.num_draft_tokens > 0


def test_random_draft_chunked_prefix_cached_preempted(hf_checkpoint, prompts, tmp_path):
    path, _ = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=4, seed=1)
    shared = [prompts[0] + p for p in prompts]       # shared prefixes: cache hits
    ref = _greedy(LLM(str(path)), shared)
    llm = LLM(str(path), speculative_method="dspark",
              speculative_adaptive=False, num_speculative_tokens=4,
              speculative_model=str(draft), num_blocks=14, block_size=8,
              long_prefill_token_threshold=7, max_num_batched_tokens=32)
    assert _greedy(llm, shared) == ref
    assert llm.engine.scheduler.num_preemptions > 0


def test_seeded_sampling_runs_with_draft(hf_checkpoint, prompts, tmp_path):
    path, _ = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=4)
    llm = LLM(str(path), speculative_method="dspark",
              speculative_adaptive=False, num_speculative_tokens=4,
              speculative_model=str(draft))
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=16, seed=5, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], sp, use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].token_ids) == 16 for o in a)
    assert llm.engine.cache.all_free()


def test_a_temperature_conditioned_draft_reads_each_request_temperature(
        hf_checkpoint, prompts, tmp_path, monkeypatch):
    path, _ = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=4, conditioned=True)
    llm = LLM(str(path), speculative_method="dspark", speculative_adaptive=False,
              num_speculative_tokens=3, speculative_model=str(draft))
    assert _greedy(llm, prompts) == _greedy(LLM(str(path)), prompts)
    seen: list[list[float]] = []
    block_hidden = DSparkDraft.block_hidden

    def spy(self, first, positions, ctx, mask, block, temperatures=None):
        seen.append(temperatures.tolist())
        return block_hidden(self, first, positions, ctx, mask, block, temperatures)

    monkeypatch.setattr(DSparkDraft, "block_hidden", spy)
    params = [SamplingParams(temperature=t, max_tokens=8, seed=1, ignore_eos=True)
              for t in (0.0, 0.5, 0.9)]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
    assert seen and sorted({t for step in seen for t in step}) == pytest.approx([0.0, 0.5, 0.9])
    # the batch's first step drafts for all three, each row at its own request's temperature
    assert sorted(seen[0]) == pytest.approx([0.0, 0.5, 0.9])


def test_bundled_draft_identical_and_accepts():
    demo = kimi_linear_demo_path()
    if not (demo / "draft" / "config.json").is_file():
        pytest.skip("the bundled draft is not built")
    llm_base = LLM(str(demo))
    llm = LLM(str(demo), speculative_method="dspark",
              speculative_adaptive=False, num_speculative_tokens=7)
    prompts = [llm.tokenizer.encode(t) for t in ("ROMEO:\n", "HAMLET:\nTo be")]
    assert _greedy(llm, prompts, n=48) == _greedy(llm_base, prompts, n=48)
    s = llm.engine.scheduler
    assert s.num_accepted_tokens / s.num_draft_tokens > 0.3


def test_extract_and_train_draft_smoke(tmp_path):
    from kdaserve.train.draft import train_draft
    from kdaserve.train.draft_data import extract_hidden

    text = tmp_path / "corpus.txt"
    text.write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 20)
    meta = extract_hidden(str(kimi_linear_demo_path()), str(text), str(tmp_path / "hid"),
                          prompt_len=8, generate=16, max_seqs=6, batch=4)
    assert meta["num_sequences"] == 6 and meta["sequence_length"] == 24
    report = train_draft(str(kimi_linear_demo_path()), str(tmp_path / "hid"), str(tmp_path / "d"),
                         steps=3, batch=2, anchors=2, block=4)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["block_size"] == 4
    # the report's figures agree with each other (their values on known logits:
    # tests/train/test_draft_acceptance.py)
    assert report["block_size"] == 4
    assert report["heldout_acceptance_rate"] == pytest.approx(report["heldout_mean_accepted"] / 4)
    assert report["heldout_sampled_acceptance_rate"] == pytest.approx(
        report["heldout_sampled_mean_accepted"] / 4)
    # a block's sampled run cannot outlast its first draft: Π_(i<=j) α_i <= α_0
    assert report["heldout_sampled_acceptance_rate"] <= report["heldout_sampled_first_draft"] + 1e-6
    DSparkDraft.from_pretrained(tmp_path / "d")


def test_deferred_context_matches_writing_it_each_step(hf_checkpoint, tmp_path):
    """Context held back while no request drafts, then projected at once, leaves the draft's
    pages as writing each step's at once would: a slot written twice keeps the later write."""
    from kdaserve.engine.spec.dspark import DSparkProposer
    from kdaserve.model.loader import load_model
    from kdaserve.model.registry import load_draft

    path, _ = hf_checkpoint
    target = load_model(path, progress=False)
    draft = load_draft(_random_draft(path, tmp_path / "draft", block=4))
    draft.bind_target(target.model.embed_tokens)
    lazy = DSparkProposer(draft, target, 3, num_blocks=6, block_size=4, device=torch.device("cpu"))
    eager = DSparkProposer(draft, target, 3, num_blocks=6, block_size=4, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    width = draft.config.hidden_size * len(draft.config.target_layer_ids)
    for dest in ([0, 1, 2], [3, 9], [1, 2, 20], [9]):     # slots 1, 2 and 9 are rewritten
        step = (torch.randn(len(dest), width, generator=g), torch.tensor(dest) + 5,
                torch.tensor(dest))
        lazy._pending.append(step)
        eager._pending.append(step)
        with torch.inference_mode():
            eager._ingest()
    with torch.inference_mode():
        lazy._ingest()
    for a, b in zip(lazy.pages, eager.pages):     # one matmul over all rows vs one per step
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert lazy.pages[0].view(-1, lazy.pages[0].shape[-1])[20].abs().sum() > 0


@pytest.mark.parametrize("window", [None, 8])
def test_a_context_window_reads_only_the_newest_positions(hf_checkpoint, tmp_path, window):
    """A draft with `context_window` W drafts the same block whatever lies older than the
    newest W positions of its context; without one, changing the older context changes it."""
    from dataclasses import replace

    from kdaserve.engine.sampler import SamplingRow
    from kdaserve.engine.spec.dspark import DSparkProposer
    from kdaserve.engine.spec.proposer import ProposalInput
    from kdaserve.model.loader import load_model
    from kdaserve.model.registry import load_draft
    from kdaserve.outputs import ScheduledSequence

    path, _ = hf_checkpoint
    target = load_model(path, progress=False)
    draft = load_draft(_random_draft(path, tmp_path / "draft", block=4))
    draft.config = replace(draft.config, context_window=window)
    draft.bind_target(target.model.embed_tokens)
    width = draft.config.hidden_size * len(draft.config.target_layer_ids)
    n = 20                                   # context positions, in blocks 2, 0, 5, 1, 3 of 4
    blocks = [2, 0, 5, 1, 3]
    slots = torch.tensor([blocks[p // 4] * 4 + p % 4 for p in range(n)])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, width, generator=g)

    def drafts(h):
        prop = DSparkProposer(draft, target, 3, num_blocks=6, block_size=4,
                              device=torch.device("cpu"))
        seq = ScheduledSequence("r", list(range(3, 3 + n)), 0, blocks, 0, True)
        inp = ProposalInput([seq], [n], {"r": [7]}, {}, torch.arange(n), slots, h,
                            {"r": SamplingRow("r", SamplingParams(temperature=0.0), [], [],
                                              None)})
        with torch.inference_mode():
            return prop.propose(inp)["r"].tokens, prop.rows_drafted

    base, rows = drafts(hidden)
    older = hidden.clone()
    older[: n - 8] = torch.randn(n - 8, width, generator=g) * 5    # all but the newest 8
    newer = hidden.clone()
    newer[n - 8:] = torch.randn(8, width, generator=g) * 5
    assert rows == 4 and len(base) == 3
    assert drafts(newer)[0] != base            # the newest positions are read either way
    if window:
        assert drafts(older)[0] == base
    else:
        assert drafts(older)[0] != base
