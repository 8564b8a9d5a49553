"""`python -m benchmarks real-structured`: structured output and tool calls on a real model,
through `kvserve serve` and the openai client only.

Each question of benchmarks/data/fact_questions.json (capitals, arithmetic, units, dates, fields
extracted from a short text) is asked, at temperature 0, in five modes: `plain` (no constraint),
`json` (response_format json_schema), and a tool whose parameters are that schema, offered with
tool_choice `required`, named, and `auto` (SmolLM2's chat template drops `tools`, so in `auto`
a system message lists the tool in Hermes' words, as Qwen's template would). Per mode: the
schema-valid rate (the answer ended by itself and its JSON validates), the rate whose values
answer the question, how many answers `max_tokens` cut inside a value, and the lengths of the
string and number values the grammar let the model write.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai

from benchmarks import ROOT
from benchmarks.answer_checks import (
    fields_match,
    is_cut_inside_value,
    scan_values,
    text_answers,
)
from benchmarks.cli_fleet import CliProcess

QUESTIONS = ROOT / "benchmarks" / "data" / "fact_questions.json"
MODES = ("plain", "json", "tool_required", "tool_named", "tool_auto")
# A system message standing in for the tools section SmolLM2's template does not render.
_AUTO_SYSTEM = ("You may call this function. To call it, answer with <tool_call>{{\"name\": "
                "\"{name}\", \"arguments\": {{...}}}}</tool_call>.\n<tools>{tool}</tools>")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("real-structured",
                       help="structured output and tool calls on a real model: valid and "
                            "correct rates, value lengths")
    p.add_argument("--model", required=True, help="model directory (or GGUF) kvserve serves")
    p.add_argument("--questions", type=Path, default=QUESTIONS, help="questions file (JSON)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {MODES}")
    p.add_argument("--limit", type=int, default=0, help="the first N questions only (0: all)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `kvserve serve` (repeatable)")
    p.add_argument("--out", type=Path, help="write every answer and the summary here (JSON)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    questions = json.loads(args.questions.read_text())["questions"]
    if args.limit:
        questions = questions[: args.limit]
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown --modes {unknown}: choose from {', '.join(MODES)}")
    log = Path(tempfile.mkdtemp(prefix="kvserve-real-structured-")) / "serve.log"
    extra = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", *args.serve_arg]
    with CliProcess.serve(args.model, log, extra) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=600.0)
        model = client.models.list().data[0].id
        jobs = [(mode, q) for mode in modes for q in questions]
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda job: ask(client, model, job[0], job[1],
                                                    args.max_tokens), jobs))
    summary = {mode: summarize([a for a in answers if a["mode"] == mode]) for mode in modes}
    print_summary(summary, args.max_tokens)
    if args.out:
        args.out.write_text(json.dumps({"max_tokens": args.max_tokens, "summary": summary,
                                        "answers": answers}, indent=1) + "\n")
    return 0


def _tool(question: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": f"record_{question['kind']}",
        "description": "Record the answer to the user's question.",
        "parameters": question["schema"]}}


def ask(client: openai.OpenAI, model: str, mode: str, question: dict[str, Any],
        max_tokens: int) -> dict[str, Any]:
    """One question in one mode: the answer's text (the first call's arguments for tool
    modes), finish reason, and its scores."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question["question"]}]
    tool = _tool(question)
    name = tool["function"]["name"]
    extra: dict[str, Any] = {}
    if mode == "json":
        extra["response_format"] = {"type": "json_schema", "json_schema": {
            "name": name, "schema": question["schema"]}}
    elif mode == "tool_required":
        extra |= {"tools": [tool], "tool_choice": "required"}
    elif mode == "tool_named":
        extra |= {"tools": [tool], "tool_choice": {"type": "function",
                                                   "function": {"name": name}}}
    elif mode == "tool_auto":
        extra |= {"tools": [tool], "tool_choice": "auto"}
        system = _AUTO_SYSTEM.format(name=name, tool=json.dumps(tool))
        messages.insert(0, {"role": "system", "content": system})
    response = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
        temperature=0.0, **extra)
    choice = response.choices[0]
    calls = [c.function for c in choice.message.tool_calls or [] if c.type == "function"]
    text = calls[0].arguments if calls else (choice.message.content or "")
    return {"mode": mode, "id": question["id"], "kind": question["kind"],
            "finish_reason": choice.finish_reason, "text": text,
            "num_calls": len(calls), "call_names": [c.name for c in calls],
            "completion_tokens": response.usage.completion_tokens if response.usage else None,
            **score(mode, question, choice.finish_reason, text, [c.name for c in calls])}


def score(mode: str, question: dict[str, Any], finish_reason: str | None, text: str,
          call_names: list[str]) -> dict[str, Any]:
    """`valid`: ended by itself (not `length`) with JSON that validates against the schema
    (tool modes: at least one call, of the offered tool); `correct`: the expected values
    (plain: found in the text); `cut_inside_value`: `length` while inside a value."""
    cut = finish_reason == "length"
    if mode == "plain":
        return {"valid": None, "correct": text_answers(question["expected"], text),
                "cut_inside_value": False, "values": []}
    values = [{"kind": v.kind, "length": v.length, "complete": v.complete}
              for v in scan_values(text)]
    parsed: Any = None
    valid = not cut and (mode in ("json", "tool_named") or bool(call_names))
    valid = valid and all(n == f"record_{question['kind']}" for n in call_names)
    if valid:
        try:
            parsed = json.loads(text)
            jsonschema.validate(parsed, question["schema"])
        except (ValueError, jsonschema.ValidationError):
            valid, parsed = False, None
    return {"valid": valid, "correct": parsed is not None
            and fields_match(question["expected"], parsed),
            "cut_inside_value": cut and is_cut_inside_value(text), "values": values}


def _lengths(answers: list[dict[str, Any]], kind: str) -> list[int]:
    return [v["length"] for a in answers for v in a["values"] if v["kind"] == kind]


def _quantiles(xs: list[int]) -> dict[str, float]:
    if not xs:
        return {"count": 0}
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return {"count": len(xs), "p50": statistics.median(xs), "p90": q[8], "max": max(xs)}


def summarize(answers: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(answers)
    count: Callable[[str], int] = lambda key: sum(1 for a in answers if a[key])  # noqa: E731
    numbers = _lengths(answers, "number")
    return {"questions": n, "valid": count("valid"), "correct": count("correct"),
            "cut_at_max_tokens": sum(1 for a in answers if a["finish_reason"] == "length"),
            "cut_inside_value": count("cut_inside_value"),
            "with_tool_calls": sum(1 for a in answers if a["num_calls"]),
            "number_chars": _quantiles(numbers),
            "numbers_over_15_chars": sum(1 for x in numbers if x > 15),
            "string_chars": _quantiles(_lengths(answers, "string"))}


def print_summary(summary: dict[str, dict[str, Any]], max_tokens: int) -> None:
    print(f"{'mode':<14} {'valid':>7} {'correct':>8} {'cut':>5} {'in value':>9} "
          f"{'calls':>6}  number chars p50/p90/max (>15)  string chars p50/p90/max"
          f"   [max_tokens {max_tokens}]")
    for mode, s in summary.items():
        nums, strs = s["number_chars"], s["string_chars"]
        num = (f"{nums['p50']:g}/{nums['p90']:g}/{nums['max']} ({s['numbers_over_15_chars']})"
               if nums["count"] else "-")
        st = f"{strs['p50']:g}/{strs['p90']:g}/{strs['max']}" if strs["count"] else "-"
        valid = "-" if mode == "plain" else f"{s['valid']}/{s['questions']}"
        print(f"{mode:<14} {valid:>7} {s['correct']:>4}/{s['questions']:<3} "
              f"{s['cut_at_max_tokens']:>5} {s['cut_inside_value']:>9} "
              f"{s['with_tool_calls']:>6}  {num:<31}  {st}")
