"""``python -m kvjax plan``: capacity planning from a preset or a ``config.json``, without jax."""

from __future__ import annotations

import argparse
import re

from kvjax.config import KV_CACHE_DTYPES, PLATFORMS, CacheConfig
from kvjax.plan import plan_kv_cache
from kvjax.spec import ModelSpec

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"16GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``"1073741824"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"memory {text!r}: write a size such as 16GiB, 512MiB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``plan`` sub-command."""
    plan = sub.add_parser("plan", help="plan a KV cache: tokens that fit, per-pool bytes, decisions")
    plan.add_argument("--model", required=True, help=f"a preset ({', '.join(ModelSpec.presets())}) or a config.json")
    plan.add_argument(
        "--memory", type=parse_bytes, default=None, help="KV-cache budget per device, e.g. 16GiB (memory_budget_bytes)"
    )
    plan.add_argument("--max-total-tokens", type=int, default=None)
    plan.add_argument("--page-size", type=int, default=16)
    plan.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size (KV heads are split over it)")
    plan.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (layers are split over it)")
    plan.add_argument("--context-length", type=int, default=None)
    plan.add_argument("--max-running-requests", type=int, default=None)
    plan.add_argument("--platform", choices=PLATFORMS, default="tpu", help="storage layout target (default tpu)")
    plan.add_argument("--disable-radix-cache", action="store_true")
    plan.add_argument("--enable-hierarchical-cache", action="store_true")
    plan.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def run(args: argparse.Namespace) -> int:
    spec = ModelSpec.resolve(args.model)
    config = CacheConfig(
        page_size=args.page_size,
        kv_cache_dtype=args.kv_cache_dtype,
        memory_budget_bytes=args.memory,
        max_total_tokens=args.max_total_tokens,
        tp_size=args.tp,
        pp_size=args.pp,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        platform=args.platform,
        disable_radix_cache=args.disable_radix_cache,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        disaggregation_mode=args.disaggregation_mode,
    )
    plan = plan_kv_cache(spec, config)
    print(plan.to_json(indent=2) if args.json else plan)
    return 0
