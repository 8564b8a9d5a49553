"""The gateway's tokenizer memo: spliced ids equal a full tokenization's, for every tokenizer
family; the overlap check refuses a splice that would be wrong; memory stays bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from kvserve.gateway.core.retry_budget import RetryBudget
from kvserve.gateway.core.token_keys import TokenKeyer
from kvserve.gateway.core.token_memo import MemoLimits, MemoOutcome, TokenMemo
from kvserve.gateway.fleet.admission import Admission
from kvserve.gateway.fleet.metrics import GatewayMetrics
from kvserve.gateway.fleet.token_source import ExactKeys
from kvserve.gateway.fleet.worker_pool import WorkerPool
from kvserve.model.demo_tokenizer import CHAT_TEMPLATE
from tests.gateway.memo_tokenizers import CORPUS, FAMILIES, never_resyncs

SPLICE, FALLBACK, MISS, EXACT = (MemoOutcome.SPLICE, MemoOutcome.FALLBACK, MemoOutcome.MISS,
                                 MemoOutcome.EXACT)
DOC = CORPUS * 3  # ~2.5k characters: a tenant's document
# Where a new prompt leaves DOC: inside a word, a whitespace run, a number, and unicode.
MID_WORD = DOC.index("filings and") + 3
MID_SPACES = DOC.index("    runs") + 2
MID_NUMBER = DOC.index("1234567") + 3
MID_UNICODE = DOC.index("東京") + 1
TAILS = ["", " and a question?", "ization of it", "x", "   \t  spaced out", "999 and 12",
         ".5 percent", "京 🙂 café", "\u0301 accent", "<|im_end|>\n<|im_start|>user\nhi",
         "\n\n\n", "'s cache", "🙂🙂🙂 42"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, Tokenizer]:
    return request.param, FAMILIES[request.param]()


def full_ids(tok: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return tok.encode(text, add_special_tokens=add_special_tokens).ids


def test_shared_prefixes_with_any_tail_give_the_full_tokenization(
        family: tuple[str, Tokenizer]) -> None:
    name, tok = family
    memo = TokenMemo(tok, add_special_tokens=True)
    texts = [DOC + " The end."]
    for cut in (len(DOC), MID_WORD, MID_SPACES, MID_NUMBER, MID_UNICODE):
        texts += [DOC[:cut] + tail for tail in TAILS]
    texts += [DOC + " The end." + "\n" + CORPUS]  # a pure extension of an earlier prompt
    for text in texts:
        assert memo.encode(text) == full_ids(tok, text), (name, text[-40:])
    counts = memo.stats.counts
    assert (counts[MISS], counts[SPLICE]) == (1, len(texts) - 1), (name, counts)
    assert memo.stats.chars_tokenized < 0.3 * memo.stats.chars_requested


def test_a_repeated_prompt_is_an_exact_hit(family: tuple[str, Tokenizer]) -> None:
    _, tok = family
    memo = TokenMemo(tok, add_special_tokens=True)
    first = memo.encode(DOC)
    first.append(-1)  # the caller's list is its own
    assert memo.encode(DOC) == full_ids(tok, DOC)
    assert memo.stats.counts[EXACT] == 1 and memo.stats.chars_tokenized == len(DOC)


def chat_keyer(tok: Tokenizer, tmp_path: Path) -> TokenKeyer:
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return TokenKeyer(tmp_path)


def test_conversations_sharing_a_system_message_give_the_full_tokenization(
        family: tuple[str, Tokenizer], tmp_path: Path) -> None:
    name, tok = family
    keyer = chat_keyer(tok, tmp_path)
    assert keyer.chat_template is not None
    system = {"role": "system", "content": DOC}
    questions = ["What changed in Q3?", "Summarise clause 12.", "東京 or Zürich?", "Why 1234?"]
    conversations = [[system, {"role": "user", "content": q}] for q in questions]
    growing = [system]
    for q in questions:  # one conversation, turn after turn
        growing = [*growing, {"role": "user", "content": q},
                   {"role": "assistant", "content": f"About {q.lower()} {CORPUS[:300]}"}]
        conversations.append(growing)
    for messages in conversations:
        for generation_prompt in (True, False):
            text = keyer.chat_template.render(messages, add_generation_prompt=generation_prompt)
            expected = full_ids(keyer.tokenizer, text, add_special_tokens=False)
            assert keyer.encode_chat(messages, None, generation_prompt) == expected, name
    counts = keyer.chat_memo.stats.counts
    assert (counts[MISS], counts[SPLICE]) == (1, 2 * len(conversations) - 1), (name, counts)
    assert keyer.prompt_memo.stats.num_calls == 0


PIECES = st.sampled_from(["the", " cache", "  ", "\n", "\t", "12", "345", ",", ".", "'s", " ",
                          "é", "e\u0301", "東京", "🙂", "<|im_start|>", "<|im_end|>", "aaa",
                          "Zürich", "   x", "0", "naïve"])
TEXTS = st.lists(st.one_of(PIECES, st.text(alphabet="ab c\n 19.é🙂", max_size=5)),
                 max_size=40).map("".join)
SMALL = MemoLimits(key_chars=(12, 48), store_tail_chars=24, max_entries=8, max_chars=4000)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(heads=st.lists(TEXTS, min_size=1, max_size=3), body=TEXTS,
       tails=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 400), TEXTS), min_size=1,
                      max_size=8),
       specials=st.booleans())
def test_random_texts_sharing_random_prefixes(family: tuple[str, Tokenizer], heads: list[str],
                                              body: str, tails: list[tuple[int, int, str]],
                                              specials: bool) -> None:
    """Several tenants' heads (sharing a body), then prompts leaving one of them anywhere."""
    _, tok = family
    memo = TokenMemo(tok, add_special_tokens=specials, limits=SMALL)
    shared = [head + body * 3 for head in heads]
    texts = [s + "!" for s in shared]
    texts += [shared[n % len(shared)][:cut] + tail for n, cut, tail in tails]
    for text in texts:
        assert memo.encode(text) == full_ids(tok, text, specials), repr(text)
    assert memo.num_entries <= SMALL.max_entries and memo.num_chars <= SMALL.max_chars


RUN = "a" * 120  # the never-resyncing tokenizer pairs these from wherever it starts


def test_the_fallback_fires_where_a_splice_would_be_wrong() -> None:
    tok = never_resyncs()
    first, second = "b" + RUN + "b" * 40, "b" + RUN + "c" * 40
    # The splice any cut inside the run would make: the head's tokens up to the cut, then the
    # tail's; it is wrong, because the tail pairs the "a"s one off.
    cut_idx = 30
    head = tok.encode(first, add_special_tokens=False)
    start = head.offsets[cut_idx - 1][1]
    naive = [0, *head.ids[:cut_idx], *full_ids(tok, second[start:], False)]
    assert naive != full_ids(tok, second)
    memo = TokenMemo(tok, add_special_tokens=True, limits=MemoLimits(key_chars=(16,)))
    assert memo.encode(first) == full_ids(tok, first)
    assert memo.encode(second) == full_ids(tok, second)
    assert memo.stats.counts[FALLBACK] == 1 and memo.stats.counts[SPLICE] == 0
    # Past the run both tokenizations agree again, so a prompt leaving the text there splices.
    third = first[:-20] + "c" * 20
    assert memo.encode(third) == full_ids(tok, third)
    assert memo.stats.counts[SPLICE] == 1


def test_a_start_of_text_effect_is_dropped_at_the_resync_point(
        family: tuple[str, Tokenizer]) -> None:
    """Tails re-tokenized from a word boundary may begin differently (a Metaspace or Prepend
    "▁", a prefix space); their ids are used only from where they agree with the entry's."""
    name, tok = family
    memo = TokenMemo(tok, add_special_tokens=False, limits=MemoLimits(key_chars=(16,)))
    base = "<|im_start|>user\n" + "It's the cache's job, 1234567 blocks. " * 8
    assert memo.encode(base) == full_ids(tok, base, False)
    for tail in ("\nno", "<|im_end|>", " 42"):
        text = base[:-30] + tail
        assert memo.encode(text) == full_ids(tok, text, False), name
    assert memo.stats.counts[SPLICE] == 3, (name, memo.stats.counts)


def test_the_memo_stays_bounded_and_keeps_the_heads_it_uses() -> None:
    tok = FAMILIES["demo_fixture"]()
    limits = MemoLimits(max_entries=3, max_chars=10_000, key_chars=(32,))
    memo = TokenMemo(tok, add_special_tokens=True, limits=limits)
    docs = [f"Tenant {n}: " + CORPUS[n * 40:] for n in range(4)]
    for doc in docs[:3]:
        memo.encode(doc)
    memo.encode(docs[0] + " a question")  # spliced on docs[0], which becomes the newest
    memo.encode(docs[3])  # a fourth tenant: docs[1], now the oldest, goes
    assert memo.num_entries == 3 and memo.num_chars == sum(len(docs[n]) for n in (0, 2, 3))
    memo.encode(docs[1] + " again")
    memo.encode(docs[0] + " another question")
    counts = memo.stats.counts
    assert (counts[MISS], counts[SPLICE]) == (5, 2), counts
    big = TokenMemo(tok, add_special_tokens=True, limits=MemoLimits(max_chars=500))
    big.encode(CORPUS)  # over max_chars: tokenized, never stored
    assert big.num_entries == 0 and big.encode(CORPUS) == full_ids(tok, CORPUS)
    one = TokenMemo(tok, add_special_tokens=True,
                    limits=MemoLimits(max_entries=1, key_chars=(32,), store_tail_chars=64))
    one.encode(CORPUS)
    longer = CORPUS[:200] + CORPUS  # a long tail: stored, and its own base is evicted for it
    assert one.encode(longer) == full_ids(tok, longer) and one.num_entries == 1
    assert one.encode(longer) == full_ids(tok, longer)
    assert (one.stats.counts[SPLICE], one.stats.counts[EXACT]) == (1, 1)
    with pytest.raises(ValueError, match="sync_tokens <= overlap_tokens"):
        MemoLimits(overlap_tokens=4, sync_tokens=5)


def test_a_truncating_tokenizer_is_never_memoized() -> None:
    tok = FAMILIES["demo_fixture"]()
    tok.enable_truncation(64)
    memo = TokenMemo(tok, add_special_tokens=True)
    assert not memo.is_enabled
    assert memo.encode(DOC) == full_ids(tok, DOC) and len(full_ids(tok, DOC)) == 64
    assert memo.encode(DOC) == full_ids(tok, DOC) and memo.stats.counts[MISS] == 2


def test_memo_outcomes_are_gateway_metrics(tiny_model: Path) -> None:
    keys = ExactKeys(str(tiny_model), 16, wanted=True)
    metrics = GatewayMetrics(WorkerPool(["http://w1"]), Admission(4, 4, 1.0), RetryBudget(),
                             keys)
    assert keys.keyer is not None
    keys.keyer.encode(DOC)
    keys.keyer.encode(DOC + " and a question")
    keys.keyer.encode(DOC + " and a question")

    def lookups(kind: str, outcome: str) -> float | None:
        return metrics.registry.get_sample_value("kvserve:gateway_token_memo_lookups_total",
                                                 {"kind": kind, "outcome": outcome})

    # A short tail is not stored: the repeat splices again (an exact hit needs a stored text).
    assert {o.value: lookups("prompt", o.value) for o in MemoOutcome} == {
        "exact": 0.0, "splice": 2.0, "fallback": 0.0, "miss": 1.0}
    assert lookups("chat", "miss") == 0.0
    tokenized = metrics.registry.get_sample_value("kvserve:gateway_token_memo_chars_total",
                                                  {"kind": "prompt", "stage": "tokenized"})
    assert tokenized is not None and len(DOC) < tokenized < 1.2 * len(DOC)
