"""The simulated worker is the engine: kvserve.engine's scheduler and stop rules over a real
cache, on the simulated clock (pinned on exact times and states of a tiny worker)."""

from __future__ import annotations

from kvserve.sim.events import EventQueue
from kvserve.sim.seq import SimSeq
from kvserve.sim.worker import SimWorker, WorkerConfig
from tests.sim.helpers import H100


class Recorder:
    """A WorkerListener that writes down what it hears."""

    def __init__(self) -> None:
        self.first_tokens: dict[str, float] = {}
        self.finished: dict[str, float] = {}

    def on_first_token(self, seq: SimSeq, now: float) -> None:
        self.first_tokens[seq.seq_id] = now

    def on_finish(self, seq: SimSeq, now: float) -> None:
        self.finished[seq.seq_id] = now


def worker(num_blocks: int, budget: int = 64, fast_forward: bool = True,
           max_num_seqs: int = 8) -> tuple[SimWorker, EventQueue, Recorder]:
    events, recorder = EventQueue(), Recorder()
    config = WorkerConfig(num_blocks, 4, budget, max_num_seqs, fast_forward=fast_forward)
    return SimWorker("w", config, H100, events, recorder), events, recorder


def drain(events: EventQueue) -> None:
    while events.run_next():
        pass


def test_a_twin_shares_the_prompt_blocks_its_sibling_writes_in_the_same_step() -> None:
    """The engine's in-step sharing: a twin that arrives during its sibling's first prefill
    chunk joins the second chunk's step, hitting the 8 tokens written in it, and gets its first
    token with its sibling (the simulator's old restatement made it wait a step)."""
    w, events, heard = worker(num_blocks=64, budget=16)
    first = SimSeq("first", list(range(24)), 4, None)
    twin = SimSeq("twin", [*range(24), 999], 4, None)
    assert w.submit(first, 0.0)
    assert w.submit(twin, 0.0)  # during the step in flight: it reaches the engine at its end
    events.run_next()  # step 1: first computes 16 of its 24 tokens
    assert w.executor.last_shape.num_prefill_tokens == 9  # step 2: first's 8, twin's 1
    drain(events)
    assert heard.first_tokens["twin"] == heard.first_tokens["first"]
    assert twin.num_cached == 24 and twin.num_work_tokens == 1 + 3  # its last token, 3 decodes
    assert w.is_idle and w.kv.check_idle().ok


def test_the_newest_runner_is_preempted_and_everything_still_finishes() -> None:
    w, events, heard = worker(num_blocks=10)
    seqs = [SimSeq(name, list(range(100 * i, 100 * i + 12)), 8, None)
            for i, name in enumerate("abc")]
    for seq in seqs:
        assert w.submit(seq, 0.0)
    drain(events)
    # 3 prompts of 3 blocks fill 9 of 10 blocks; each then needs a 4th: c (newest) goes.
    assert w.num_preemptions == 1
    assert set(heard.finished) == {"a", "b", "c"}
    assert w.counters.computed_tokens == 3 * (12 + 7) + 12  # c recomputed its prompt
    assert w.is_idle and w.kv.check_idle().ok


def test_a_decode_run_stops_where_a_seq_finishes_or_blocks_run_out() -> None:
    """Fast-forwarded decode runs give step-by-step's times and counts in fewer events."""
    results = []
    for fast in (True, False):
        w, events, heard = worker(num_blocks=12, fast_forward=fast)
        for i, max_tokens in enumerate((40, 3, 25)):
            assert w.submit(SimSeq(f"s{i}", list(range(50 * i, 50 * i + 4)), max_tokens,
                                   None), 0.0)
        drain(events)
        results.append((heard.finished, w.counters.num_steps, w.num_preemptions,
                        w.counters.computed_tokens, events.num_events))
    (fast_done, fast_steps, fast_pre, fast_tokens, fast_events), slow = results
    slow_done, slow_steps, slow_pre, slow_tokens, slow_events = slow
    assert fast_done.keys() == slow_done.keys() == {"s0", "s1", "s2"}
    for seq_id, at in slow_done.items():
        assert abs(fast_done[seq_id] - at) < 1e-9
    assert (fast_steps, fast_pre, fast_tokens) == (slow_steps, slow_pre, slow_tokens)
    assert slow_pre == 1  # 12 blocks of 4 do not hold all three answers: blocks run out
    assert fast_events < slow_events / 3


def test_a_prompt_that_can_never_run_is_refused_at_submit() -> None:
    w, _, _ = worker(num_blocks=4)  # 16 tokens of cache
    assert not w.submit(SimSeq("long", list(range(16)), 1, None), 0.0)
    assert w.is_idle and w.submit(SimSeq("fits", list(range(15)), 1, None), 0.0)
