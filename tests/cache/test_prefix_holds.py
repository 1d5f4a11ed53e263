"""Prefix holds (disaggregation's hit query, kdaserve/cache/holds.py): the blocks of a hybrid
hit pinned under a key until an import takes them or the hold expires; exact ids and counts."""

from __future__ import annotations

from kdaserve.cache.manager import CacheManager
from kdaserve.disagg.field import parse_kv_transfer
from kdaserve.disagg.params import KVTransferParams
from kdaserve.request import SamplingParamsError

TOKENS = list(range(100, 114))                   # 14 tokens: 3 full blocks of 4


def cached_manager() -> CacheManager:
    """A manager holding TOKENS' three blocks and a snapshot at 12, all free."""
    m = CacheManager(num_blocks=6, block_size=4, num_slots=2, enable_prefix_caching=True,
                     num_snapshots=4, snapshot_bytes=100, mla_bytes_per_token=1,
                     snapshot_interval=1 << 20)
    m.begin_step()
    assert m.allocate("a", 14, m.find_hit(TOKENS))
    assert m.plan_snapshots("a", TOKENS, 14, 0, 14) == [(12, 0)]
    m.commit("a", TOKENS, 14)
    m.free("a")
    m.begin_step()
    return m


def test_a_hold_pins_its_blocks_until_the_import_takes_them():
    m = cached_manager()
    prompt = TOKENS[:12] + [1, 2, 3]
    assert m.hold("t", prompt, (), None, deadline=10.0) == 12
    assert not m.all_free() and m.num_free_blocks == 3
    # another request cannot take the held blocks: only the 3 free ones
    assert not m.allocate("other", 16) and m.allocate("other", 12)
    hit = m.held_hit("t", prompt)
    assert (hit.num_tokens, hit.snapshot, hit.block_hashes) == (12, None, m.prefix_holds.get(
        "t").hashes)
    m.free("other")
    assert m.allocate("imp", 15, hit)
    held_ids = m.block_ids("imp")[:3]
    m.release_hold("t")
    assert m.block_ids("imp")[:3] == held_ids and m.num_free_blocks == 2
    m.free("imp")
    assert m.all_free()


def test_holds_expire_and_check_the_prompt():
    m = cached_manager()
    assert m.hold("t", TOKENS[:12] + [9], (), None, deadline=5.0) == 12
    m.prefix_holds.expire(4.0)
    assert len(m.prefix_holds) == 1
    m.prefix_holds.expire(6.0)
    assert len(m.prefix_holds) == 0 and m.prefix_holds.expired == 1 and m.all_free()
    # a hold whose blocks are not the import's prompt is dropped, not used
    assert m.hold("u", TOKENS[:12] + [9], (), None, deadline=5.0) == 12
    assert m.held_hit("u", [7] + TOKENS[1:12] + [9]) is None and m.all_free()
    # no hit, or another key's hold: nothing held
    assert m.hold("v", [5, 5, 5, 5, 5], (), None, deadline=5.0) == 0 and m.all_free()
    assert m.held_hit("w", TOKENS) is None


def test_the_request_field():
    assert parse_kv_transfer({"transfer_id": "t", "hold": True}) == KVTransferParams(
        "t", hold=True)
    assert parse_kv_transfer({"transfer_id": "t", "peer": "tcp://h:1", "held_tokens": 8}
                             ).held_tokens == 8
    for bad in ({"transfer_id": "t", "hold": True, "peer": "tcp://h:1"},
                {"transfer_id": "t", "hold": 1},
                {"transfer_id": "t", "first_token_id": 3, "held_tokens": 8},
                {"transfer_id": "t", "peer": "tcp://h:1", "held_tokens": -1}):
        try:
            parse_kv_transfer(bad)
        except SamplingParamsError as exc:
            assert exc.param == "kv_transfer_params"
        else:
            raise AssertionError(f"{bad} was accepted")
