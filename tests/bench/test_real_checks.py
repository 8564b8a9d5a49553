"""The real-weight checks (`python -m benchmarks real-structured` and `real-chats`): their
scoring exactly, and each harness end to end through kvserve's CLI on a tiny random model, so
that they keep running between the real-model measurements in docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import ROOT, with_repo_on_path
from benchmarks.answer_checks import (
    JsonValue,
    fields_match,
    is_cut_inside_value,
    normalize,
    scan_values,
    text_answers,
)
from benchmarks.cli_fleet import counter_total
from benchmarks.real_chats_cli import ideal_cached_tokens
from benchmarks.real_structured_cli import MODES
from kvserve.model import write_random_checkpoint
from tests.bench.tiny_model import TINY


def test_values_of_a_cut_answer_keys_excluded_the_open_number_last() -> None:
    text = '{"city": "Tokyo", "country": "J\\"P", "n": [1.5, -20], "population_millions": 31333'
    assert scan_values(text) == [JsonValue("string", 5, True), JsonValue("string", 4, True),
                                 JsonValue("number", 3, True), JsonValue("number", 3, True),
                                 JsonValue("number", 5, False)]
    assert is_cut_inside_value(text)
    assert is_cut_inside_value('{"city": "Tok')
    assert not is_cut_inside_value('{"city": "Tokyo", ')
    assert not is_cut_inside_value('{"a": 12}')
    assert scan_values('{"a": {"b": "x"}, "c": "yz"}') == [JsonValue("string", 1, True),
                                                            JsonValue("string", 2, True)]


def test_answers_match_after_normalization_only() -> None:
    assert normalize("The United  Kingdom.") == "united kingdom"
    assert fields_match({"capital": "London", "year": 1945}, {"capital": "london", "year": 1945.0})
    assert not fields_match({"capital": "Paris"}, {"capital": "Paris, France"})
    assert not fields_match({"year": 1945}, {"year": "1945"})
    assert not fields_match({"ok": True}, {"ok": 1})
    assert text_answers({"capital": "Paris"}, "The capital of France is Paris.")
    assert not text_answers({"capital": "Paris"}, "It is Parisian.")
    assert text_answers({"value": 5000}, "5 kilograms are 5,000 grams.")
    assert not text_answers({"value": 300, "unit": "cm"}, "300 meters")


def test_ideal_hits_are_whole_blocks_of_the_same_tenants_earlier_work() -> None:
    turns = [("a", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7]),
             ("b", [1, 2, 3, 4, 9], [1, 2, 3, 4, 9]),  # another tenant: salted apart
             ("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9]),  # the answer too
             ("a", [1, 2, 3, 4], [1, 2, 3, 4])]  # never the whole prompt
    assert ideal_cached_tokens(turns, block_size=2) == [0, 0, 6, 2]
    page = ('# HELP vllm:prefix_cache_hits_total x\nvllm:prefix_cache_hits_total{model_name="m"} '
            '12.0\nvllm:prefix_cache_hits_total{model_name="n"} 3.0\n'
            'vllm:prefix_cache_hits_totalx 100.0\n')
    assert counter_total(page, "vllm:prefix_cache_hits_total") == 15.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("real-checks") / "tiny", TINY, seed=3)


def _bench(*args: str | Path) -> str:
    done = subprocess.run([sys.executable, "-m", "benchmarks", *map(str, args)], cwd=ROOT,
                          env=with_repo_on_path(os.environ), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_structured_harness_scores_every_mode_and_the_grammar_holds(model_dir: Path,
                                                                    tmp_path: Path) -> None:
    # Choices bound the answer, so the grammar must end it inside the budget: every json and
    # named answer is valid, and correct exactly when it names the expected city. (`required`
    # may write 8 calls: more than the budget in the demo tokenizer's characters.)
    schema = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Rome"]}},
              "required": ["capital"], "additionalProperties": False}
    questions = [{"id": f"q{i}", "kind": "capital", "question": f"What is the capital of {c}?",
                  "schema": schema, "expected": {"capital": city}}
                 for i, (c, city) in enumerate([("France", "Paris"), ("Italy", "Rome")])]
    questions_file, out = tmp_path / "questions.json", tmp_path / "structured.json"
    questions_file.write_text(json.dumps({"questions": questions}))
    _bench("real-structured", "--model", model_dir, "--questions", questions_file,
           "--max-tokens", "64", "--concurrency", "2", "--serve-arg=--max-model-len=1024",
           "--out", out)
    report = json.loads(out.read_text())
    assert set(report["summary"]) == set(MODES)
    required = [a for a in report["answers"] if a["mode"] == "tool_required"]
    assert [a["id"] for a in required] == ["q0", "q1"]
    assert all(a["valid"] == (a["finish_reason"] == "tool_calls") for a in required)
    for mode in ("json", "tool_named"):
        answers = [a for a in report["answers"] if a["mode"] == mode]
        assert [a["id"] for a in answers] == ["q0", "q1"]
        for a, q in zip(answers, questions, strict=True):
            assert a["valid"] and not a["cut_inside_value"], a
            names = [] if mode == "json" else ["record_capital"]
            assert a["call_names"] == names and a["num_calls"] == len(names)
            assert a["correct"] == (json.loads(a["text"])["capital"] == q["expected"]["capital"])
            assert a["values"] == [{"kind": "string", "length": len(json.loads(a["text"])[
                "capital"]), "complete": True}]
        summary = report["summary"][mode]
        assert summary["valid"] == 2 and summary["correct"] == sum(a["correct"] for a in answers)


def test_chats_harness_counts_hits_alike_from_metrics_and_usage(model_dir: Path,
                                                                tmp_path: Path) -> None:
    system = ("the model the engine the cache the block " * 8).strip()
    chats = {"tenants": [{"name": name, "system": system,
                          "conversations": [["hello there", "and then"], ["the cache"]]}
                         for name in ("t1", "t2")]}
    chats_file, out = tmp_path / "chats.json", tmp_path / "chats-out.json"
    chats_file.write_text(json.dumps(chats))
    _bench("real-chats", "--model", model_dir, "--chats", chats_file, "--policies",
           "round_robin", "--workers", "1", "--num-kv-blocks", "256", "--max-tokens", "4",
           "--concurrency", "1", "--out", out)
    report = json.loads(out.read_text())["round_robin"]
    turns = report["answers"]
    assert [(t["tenant"], t["conversation"], t["turn"]) for t in turns] == [
        ("t1", 0, 0), ("t1", 0, 1), ("t2", 0, 0), ("t2", 0, 1), ("t1", 1, 0), ("t2", 1, 0)]
    assert report["metrics_queries"] == report["prompt_tokens"]
    assert report["metrics_hits"] == report["cached_tokens"]
    # One worker, room for everything: the salt keeps t2 off t1's system prompt, and every
    # later turn of a tenant hits at least the blocks its system prompt fills.
    assert turns[0]["cached_tokens"] == turns[2]["cached_tokens"] == 0
    for t in (turns[1], turns[3], turns[4], turns[5]):
        assert 0 < t["cached_tokens"] <= t["ideal_cached_tokens"], t
