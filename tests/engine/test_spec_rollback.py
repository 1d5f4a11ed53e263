"""State rollback after speculative verification, against a plain recurrence.

A verify row runs the last token and k drafts through every KDA layer at once; the forward keeps
the recurrent state and the conv window after each position, and the runner commits the ones
after the last accepted token to the request's slot. Checked here, with a tiny random model:

- ops: `kda_recurrent(..., keep_states=True)` keeps, at index j, exactly the final state of the
  recurrence over positions 0..j (and the chunked form agrees);
- model: in one forward mixing verify rows of different lengths, a one-token decode row and a
  prefill row, the kept state / conv window of every (row, position) equals the slot of a plain
  run (prefill, then one token at a time) over the same tokens, and `ForwardKept.copy_to`
  copies exactly that one into the slot it names;
- runner: `ModelRunner.execute` with drafts that agree with the greedy target for a positions
  then disagree (a = 0..k, several requests at once): it emits the a drafts and the correction,
  the slot then holds the state of the accepted tokens only, and the next step continues as if
  no draft had been proposed (rejected MLA latents and states leave no trace).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_model, tiny_config

from kdaserve.cache.planner import CachePlan
from kdaserve.engine.runner import ModelRunner
from kdaserve.engine.step_message import StepMessages
from kdaserve.model.batch import build_forward_batch
from kdaserve.cache.ops import SettleDrafts
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.kept_states import ForwardKept
from kdaserve.ops.kda import kda_chunk, kda_recurrent
from kdaserve.outputs import ScheduledSequence, SchedulerOutput
from kdaserve.request import Request, SamplingParams

ATOL = 1e-5
BS = 4                  # block size
PER = 12                # blocks per sequence (48 tokens)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=7)


def _table(i: int) -> list[int]:
    """Block ids of sequence i (block 0 is never used, so a wrong index shows)."""
    return list(range(1 + i * PER, 1 + (i + 1) * PER))


def _forward(model, cache, rows, num_decode, all_logits=False):
    """rows: (tokens, context_len, slot, table) in forward order. Returns (fb, logits)."""
    lens = [len(r[0]) for r in rows]
    last = torch.tensor(lens).cumsum(0) - 1
    fb = build_forward_batch(
        lens, [r[1] for r in rows], num_decode=num_decode,
        conv_kernel=model.config.conv_kernel_size, chunk_size=model.chunk_size, cache=cache,
        block_tables=[r[3] for r in rows], state_slots=[r[2] for r in rows],
        logits_indices=None if all_logits else last)
    ids = torch.tensor([t for r in rows for t in r[0]])
    with torch.inference_mode():
        logits, _ = model(ids, fb)
    return fb, logits


def _slot(cache: HybridCache, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([s[slot].clone() for s in cache.kda_states], [c[slot].clone() for c in cache.kda_conv])


class Plain:
    """The reference: one sequence, prefilled once, then strictly one token per forward (the
    plain single-step recurrence). Records its slot after every token fed and its logits."""

    def __init__(self, model, prompt: list[int]):
        self.model = model
        self.cache = HybridCache.allocate(model.config, PER + 1, BS, 2)
        self.n = len(prompt)
        _, logits = _forward(model, self.cache, [(prompt, 0, 1, _table(0))], 0)
        self.logits = [logits[-1]]
        self.states = [_slot(self.cache, 1)]

    def feed(self, tokens: list[int]) -> None:
        for t in tokens:
            _, logits = _forward(self.model, self.cache, [([t], self.n, 1, _table(0))], 1)
            self.n += 1
            self.logits.append(logits[-1])
            self.states.append(_slot(self.cache, 1))

    def greedy(self, steps: int) -> list[int]:
        """Feed `steps` greedy tokens; returns them."""
        out = []
        for _ in range(steps):
            out.append(int(self.logits[-1].argmax()))
            self.feed(out[-1:])
        return out


def _assert_state(got, want, what: str) -> None:
    for i, (g, w) in enumerate(zip(got[0], want[0])):
        assert (g - w).abs().max() <= ATOL, f"{what}: KDA state, layer {i}"
    for i, (g, w) in enumerate(zip(got[1], want[1])):
        assert (g - w).abs().max() <= ATOL, f"{what}: conv window, layer {i}"


# ---- ops -------------------------------------------------------------------------------------

def test_kept_states_are_prefix_final_states():
    g = torch.Generator().manual_seed(0)
    B, L, H, K = 3, 6, 2, 8

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    q = torch.nn.functional.normalize(rnd(B, L, H, K), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(rnd(B, L, H, K), dim=-1)
    v, gate = rnd(B, L, H, K), -torch.rand(B, L, H, K, generator=g) * 2
    beta = torch.rand(B, L, H, generator=g)
    s0 = rnd(B, H, K, K)
    s0_before = s0.clone()
    o, final, kept = kda_recurrent(q, k, v, gate, beta, s0, keep_states=True)
    assert kept.shape == (B, L, H, K, K)
    assert torch.equal(kept[:, -1], final)
    for j in range(L):
        o_j, s_j, none = kda_recurrent(q[:, :j + 1], k[:, :j + 1], v[:, :j + 1],
                                       gate[:, :j + 1], beta[:, :j + 1], s0)
        assert none is None
        assert torch.equal(kept[:, j], s_j)
        assert torch.equal(o[:, :j + 1], o_j)
        # the chunked form over the same prefix (zero-padded to a chunk) agrees
        zp = [torch.cat([x[:, :j + 1], x.new_zeros((B, 8 - (j + 1)) + x.shape[2:])], 1)
              for x in (q, k, v, gate, beta)]
        _, s_c, _ = kda_chunk(*zp, s0, 8)
        assert (s_c - kept[:, j]).abs().max() < ATOL
    assert torch.equal(s0, s0_before)  # the initial state is not written to
    _, _, none = kda_recurrent(q, k, v, gate, beta, s0)
    assert none is None


# ---- model: kept states and ForwardKept ----------------------------------------------------

def test_every_kept_position_and_commit_match_plain_recurrence(model):
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size

    def toks(n):
        return torch.randint(0, V, (n,), generator=g).tolist()

    prompts = [toks(n) for n in (11, 6, 9, 13)]
    # verify rows of 4 and 2 tokens, a one-token decode row, then a prefill row
    steps = [toks(4), toks(2), toks(1)]
    n_slots = 4 + 8
    cache = HybridCache.allocate(model.config, 4 * PER + 1, BS, n_slots)
    _forward(model, cache, [(p, 0, i, _table(i)) for i, p in enumerate(prompts[:3])], 0)
    rows = [(s, len(prompts[i]), i, _table(i)) for i, s in enumerate(steps)]
    rows.append((prompts[3], 0, 3, _table(3)))
    fb, logits = _forward(model, cache, rows, num_decode=3, all_logits=True)
    assert fb.decode is not None and set(fb.out.decode_states) == set(range(len(cache.kda_states)))

    plains = []
    for i in range(3):
        ref = Plain(model, prompts[i])
        ref.feed(steps[i])
        plains.append(ref)
    ld = fb.decode.pad_src.shape[1]
    at = 0
    for b, s in enumerate(steps):
        for j in range(len(s)):
            kept = ([st[b, j] for st in fb.out.decode_states.values()],
                    [w[b * ld + j] for w in fb.out.decode_windows.values()])
            _assert_state(kept, plains[b].states[j + 1], f"row {b}, kept after position {j}")
            assert (logits[at + j] - plains[b].logits[j + 1]).abs().max() < 1e-4
        at += len(s)
    # what the forward itself wrote: the state after each row's last token; the prefill row's
    for b, s in enumerate(steps):
        _assert_state(_slot(cache, b), plains[b].states[len(s)], f"slot of row {b}")
    _assert_state(_slot(cache, 3), Plain(model, prompts[3]).states[0], "prefill row")

    # commit every (row, position) of the verify rows into spare slots, in one call
    pairs = [(b, j) for b in range(2) for j in range(len(steps[b]))]
    dest = list(range(4, 4 + len(pairs)))
    ForwardKept(fb).copy_to(torch.tensor([b for b, _ in pairs]),
                            torch.tensor([j for _, j in pairs]), cache.kda_states,
                            cache.kda_conv, torch.tensor(dest))
    for (b, j), d in zip(pairs, dest):
        _assert_state(_slot(cache, d), plains[b].states[j + 1], f"commit row {b} upto {j}")
    for b in range(3):  # the rows' own slots are untouched by commits elsewhere
        _assert_state(_slot(cache, b), plains[b].states[len(steps[b])], f"slot {b} after")


@pytest.mark.parametrize("k", [1, 4])
def test_commit_each_rejection_point_then_continue(model, k):
    """One request: verify [last, d_1..d_k], keep upto a (a = 0..k) in place, then decode the
    next token on top: logits and state equal a run that never saw the rejected drafts."""
    g = torch.Generator().manual_seed(2 + k)
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (10,), generator=g).tolist()
    step = torch.randint(0, V, (k + 1,), generator=g).tolist()
    nxt = torch.randint(0, V, (k + 1,), generator=g).tolist()
    n = len(prompt)
    cache = HybridCache.allocate(model.config, PER + 1, BS, 2)
    _forward(model, cache, [(prompt, 0, 1, _table(0))], 0)
    after_prompt = _slot(cache, 1)
    for a in range(k + 1):
        for layer, (st, cv) in enumerate(zip(*after_prompt)):
            cache.kda_states[layer][1] = st
            cache.kda_conv[layer][1] = cv
        fb, _ = _forward(model, cache, [(step, n, 1, _table(0))], 1)
        if a < k:                   # as the runner: all accepted needs no commit
            ForwardKept(fb).copy_to(torch.tensor([0]), torch.tensor([a]), cache.kda_states,
                                    cache.kda_conv, torch.tensor([1]))
        ref = Plain(model, prompt)
        ref.feed(step[:a + 1])
        _assert_state(_slot(cache, 1), ref.states[-1], f"a={a}")
        # continue with one token at the position after the last accepted one
        _, logits = _forward(model, cache, [([nxt[a]], n + a + 1, 1, _table(0))], 1)
        ref.feed([nxt[a]])
        assert (logits[-1] - ref.logits[-1]).abs().max() < 1e-4, f"a={a}"
        _assert_state(_slot(cache, 1), ref.states[-1], f"a={a}, next step")


# ---- the runner: verify, settle, continue ----------------------------------------------------

def _seq(rid, tokens, ctx, slot, drafts=0, sample=True) -> ScheduledSequence:
    return ScheduledSequence(request_id=rid, token_ids=list(tokens), context_len=ctx,
                             block_ids=_table(slot), state_slot=slot, sample=sample,
                             num_draft_tokens=drafts)


@pytest.mark.parametrize("accepts", [(0, 0), (1, 2), (2, 0), (3, 1), (3, 2)])
def test_runner_rolls_back_to_last_accepted(model, accepts):
    """Two speculating requests (3 and 2 drafts) rejected at the given positions, a plain decode
    and a fresh prefill in the same step (listed in scrambled order)."""
    g = torch.Generator().manual_seed(5)
    V = model.config.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 7, 9, 5)]
    ks = (3, 2)
    runner = ModelRunner(model, CachePlan(4 * PER + 1, BS, 5, 0, 0, 0))
    msgs = StepMessages()       # rank 0's side of the step message
    greedy = SamplingParams(temperature=0.0)
    reqs = {f"r{i}": Request(f"r{i}", p, greedy) for i, p in enumerate(prompts)}
    first = runner.execute(msgs.attach(
        SchedulerOutput([_seq(f"r{i}", prompts[i], 0, i) for i in range(3)]), reqs))
    refs = []
    for i in range(3):
        t0 = first.sampled[f"r{i}"][0].token_id
        reqs[f"r{i}"].output_token_ids.append(t0)
        ref = Plain(model, prompts[i])
        assert t0 == int(ref.logits[0].argmax())
        ref.feed([t0])
        refs.append(ref)
    chains = [refs[i].greedy(ks[i] + 2) if i < 2 else refs[i].greedy(1) for i in range(3)]

    seqs = [_seq("r3", prompts[3], 0, 3)]                       # prefill listed first
    for i in range(2):
        a, k = accepts[i], ks[i]
        # agree for a drafts, then a wrong one, then the target's own (never to be accepted)
        drafts = chains[i][:a] + [(chains[i][a] + 1) % V] + chains[i][a + 1:k] if a < k \
            else chains[i][:k]
        last = reqs[f"r{i}"].output_token_ids[-1]
        seqs.append(_seq(f"r{i}", [last] + drafts, len(prompts[i]), i, drafts=k))
    seqs.append(_seq("r2", reqs["r2"].output_token_ids[-1:], len(prompts[2]), 2))
    # as the scheduler does: a verify row's slot is settled after verification
    settle = [SettleDrafts(f"r{i}", i) for i in range(2)]
    out = runner.execute(msgs.attach(SchedulerOutput(seqs, ops=settle), reqs))

    n_pre = [len(p) + 1 for p in prompts[:3]]          # the slot held prompt + t0 before
    for i in range(2):
        a = accepts[i]
        assert [t.token_id for t in out.sampled[f"r{i}"]] == chains[i][:a + 1]
        # refs[i].states: after prompt, t0, chain...; the slot holds prompt + t0 + chain[:a]
        _assert_state(_slot(runner.cache, i), refs[i].states[1 + a], f"r{i} rejected at {a}")
    assert [t.token_id for t in out.sampled["r2"]] == chains[2][:1]
    _assert_state(_slot(runner.cache, 2), refs[2].states[1], "r2 plain decode")
    fresh = Plain(model, prompts[3])
    assert [t.token_id for t in out.sampled["r3"]] == [int(fresh.logits[0].argmax())]
    _assert_state(_slot(runner.cache, 3), fresh.states[0], "r3 prefill")

    # the next step, without drafts, continues each sequence exactly
    seqs = []
    for i in range(2):
        a = accepts[i]
        reqs[f"r{i}"].output_token_ids.extend(chains[i][:a + 1])
        seqs.append(_seq(f"r{i}", chains[i][a:a + 1], n_pre[i] + a, i))
    out = runner.execute(msgs.attach(SchedulerOutput(seqs), reqs))
    for i in range(2):
        a = accepts[i]
        assert [t.token_id for t in out.sampled[f"r{i}"]] == [chains[i][a + 1]]
        _assert_state(_slot(runner.cache, i), refs[i].states[2 + a], f"r{i} next step")
