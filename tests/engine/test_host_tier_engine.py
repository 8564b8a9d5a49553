"""The engine over a device pool with a host tier, on the paged toy model: prefixes copied back
from the host give the reference outputs, and a step that fails undoes its copies."""

from __future__ import annotations

import pytest

from kvserve.engine import FinishReason, Request, SamplingParams
from tests.engine.conftest import make_rig
from tests.engine.test_scheduler import assert_clean
from tests.engine.toy_model import reference_generate

GREEDY = SamplingParams(max_tokens=6, temperature=0)
SYSTEM = [[7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 1, 2], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


def prompt(n: int) -> list[int]:
    return SYSTEM[n % 2] + [n % 5, 9]


def test_prefixes_loaded_back_from_the_host_match_the_reference():
    rig = make_rig(num_blocks=6, num_host_slots=8)
    for n in range(6):  # alternating prefixes: each evicts the other from the device
        rig.core.add_request(Request(f"r{n}", prompt(n), GREEDY))
        rig.drain()
        assert rig.tokens[f"r{n}"] == reference_generate(prompt(n), 6), n
    host = rig.kv.stats().host
    assert host.counters.loads == host.counters.hit_blocks > 0
    cached = sum(rig.finished[f"r{n}"].num_cached_tokens for n in range(6))
    assert cached == rig.kv.stats().counters.prefix_hits_tokens > host.counters.hit_tokens
    assert_clean(rig)


def test_a_failed_step_undoes_its_copies_and_ends_the_loading_request():
    rig = make_rig(num_blocks=6, num_host_slots=8)
    for n in range(2):
        rig.core.add_request(Request(f"r{n}", prompt(n), GREEDY))
        rig.drain()
    rig.core.add_request(Request("again", prompt(0), GREEDY))
    rig.model.fail_next = True
    with pytest.raises(RuntimeError, match="fell over"):
        rig.step()
    host = rig.kv.stats().host
    assert host.counters.cancelled_loads > 0 and host.num_pinned_slots == 0
    assert host.num_storing_slots == 0  # cancelled stores went back free, unreadable
    rig.step()  # the ended request's final delta comes out of the next step
    final = rig.finished["again"]
    assert final.finish_reason is FinishReason.ERROR and "fell over" in final.error
    assert_clean(rig)
    rig.core.add_request(Request("retry", prompt(0), GREEDY))  # the host copies are intact
    rig.drain()
    assert rig.tokens["retry"] == reference_generate(prompt(0), 6)
    assert rig.finished["retry"].num_cached_tokens > 0
    assert_clean(rig)
