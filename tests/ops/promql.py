"""Which metric names a PromQL expression reads, and which names a live /metrics exports.

Not a PromQL parser: it removes what cannot be a metric name (strings, label matchers, ranges,
label lists after by/on/..., Grafana variables, function calls, keywords, numbers) and keeps the
identifiers left. Enough for our own dashboards and rules, which the tests below pin.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                      "group_left", "group_right", "inf", "nan", "Inf", "NaN",
                      # aggregations, which may be followed by `by (...)` before their "("
                      "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                      "count_values", "bottomk", "topk", "quantile"})
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                            "_created"),
            "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",),
            "stateset": ("",), "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
            "unknown": ("",)}


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r" \1 ", s)
    s = re.sub(r"\$\{[^}]*\}|\$\w+", " ", s)
    names = set()
    for match in re.finditer(r"(?<![\w:.])[A-Za-z_:][\w:]*", s):
        token = match.group(0)
        if token in KEYWORDS or s[match.end():].lstrip().startswith("("):
            continue
        names.add(token)
    return names


def exported_names(metrics_text: str) -> set[str]:
    """Every series name a /metrics exposition can yield: its samples' names, and for each
    family (even one with no sample yet) the names its type gives it (a counter `x` is
    `x_total`, a histogram `x` is `x_bucket`, `x_sum`, `x_count`)."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names
