"""`make_policy`: a routing policy (a named `Pipeline` configuration) by name, with its options
checked at the boundary."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from kvserve.gateway.core.pipeline.cache_aware import CacheAwarePolicy
from kvserve.gateway.core.pipeline.least_load import LeastLoadPolicy
from kvserve.gateway.core.pipeline.lora_affinity import LoRAAffinityPolicy
from kvserve.gateway.core.pipeline.pipeline import Pipeline
from kvserve.gateway.core.pipeline.precise import PrecisePolicy
from kvserve.gateway.core.pipeline.prefix_hash import PrefixHashPolicy
from kvserve.gateway.core.pipeline.round_robin import RoundRobinPolicy

POLICIES: Mapping[str, Callable[..., Pipeline]] = MappingProxyType(
    {
        RoundRobinPolicy.name: RoundRobinPolicy,
        LeastLoadPolicy.name: LeastLoadPolicy,
        PrefixHashPolicy.name: PrefixHashPolicy,
        CacheAwarePolicy.name: CacheAwarePolicy,
        PrecisePolicy.name: PrecisePolicy,
        LoRAAffinityPolicy.name: LoRAAffinityPolicy,
    }
)
"""Every policy by name (read-only)."""

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
"""The valid `make_policy` names (for a CLI's choices)."""


def make_policy(name: str, **options: Any) -> Pipeline:
    """A new policy instance. Raises ValueError naming the valid choices when the name or an
    option is unknown, or when an option's value is out of range."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    accepted = list(inspect.signature(factory).parameters)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no option {', '.join(unknown)}; "
            f"its options are: {', '.join(accepted) or '(none)'}"
        )
    return factory(**options)


def parse_policy_options(specs: Sequence[str]) -> dict[str, int | float | bool | str]:
    """`KEY=VALUE` strings (a CLI's `--policy-option`) as `make_policy` options: a value reads as
    an int, else a float, else true/false, else stays a string. Raises ValueError naming the
    spec that has no `=` or an empty key; `make_policy` then checks the names and ranges."""
    options: dict[str, int | float | bool | str] = {}
    for spec in specs:
        key, sep, raw = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"policy option {spec!r}: write KEY=VALUE, e.g. backlog_weight=0.5")
        options[key] = _option_value(raw.strip())
    return options


def split_policy_spec(spec: str) -> tuple[str, list[str]]:
    """`POLICY@KEY=VALUE[@KEY=VALUE]` as the policy's name and its `KEY=VALUE` strings (checked
    with `parse_policy_options`, so a malformed one raises ValueError here)."""
    name, *options = spec.strip().split("@")
    parse_policy_options(options)
    return name, options


def _option_value(raw: str) -> int | float | bool | str:
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return raw
