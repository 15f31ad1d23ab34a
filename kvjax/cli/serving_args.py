"""The flags ``demo`` and ``generate`` share: the serving cache's size and shape, the model's dtype,
the host tier and the schedule, added to a parser in one call, the flag of each option, and the
cache options they set (``cache_options``)."""

from __future__ import annotations

import argparse
from typing import Any

from kvjax.cli.arg_types import positive_int

#: CacheConfig / model options -> the shared flag that sets them (error messages name these).
SERVING_FLAGS = {
    "model": "--model",
    "dtype": "--dtype",
    "page_size": "--page-size",
    "max_total_tokens": "--max-total-tokens",
    "chunked_prefill_size": "--chunked-prefill-size",
    "enable_hierarchical_cache": "--enable-hierarchical-cache",
    "tp_size": "--tp",
    "dcp_size": "--dcp",
}


def add_serving_arguments(
    parser: argparse.ArgumentParser, *, dtype_help: str, max_total_tokens: int | None, max_total_tokens_help: str
) -> None:
    """Add ``--dtype``, ``--page-size`` (16), ``--max-total-tokens`` (default ``max_total_tokens``),
    ``--chunked-prefill-size`` (512), ``--enable-hierarchical-cache``,
    ``--disable-overlap-schedule``, ``--tp`` (1) and ``--dcp`` (1) to ``parser``."""
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help=dtype_help)
    parser.add_argument("--page-size", type=positive_int, default=16)
    parser.add_argument("--max-total-tokens", type=positive_int, default=max_total_tokens, help=max_total_tokens_help)
    parser.add_argument("--chunked-prefill-size", type=positive_int, default=512, help="prefill tokens per step")
    parser.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="add the host-memory tier (HiCache): evicted prefixes are kept in host memory and loaded back",
    )
    parser.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="run each step to completion before forming the next (default: overlap scheduling, the next "
        "batch is formed while a step runs)",
    )
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="tensor-parallel size: KV heads and weights split over the first N local devices",
    )
    parser.add_argument(
        "--dcp",
        type=positive_int,
        default=1,
        help="decode-context-parallel size: each request's KV striped over N ranks (a (dcp, tp) mesh of "
        "dcp x tp local devices)",
    )


def cache_options(args: argparse.Namespace) -> dict[str, Any]:
    """What the shared cache flags set, as the keyword arguments the serving entry points take
    (``check_demo``, ``run_demo``, ``generate``): ``page_size``, ``max_total_tokens`` (None: room
    for everything), ``chunked_prefill_size``, ``enable_hierarchical_cache``, ``tp_size`` and
    ``dcp_size``."""
    return {
        "page_size": args.page_size,
        "max_total_tokens": args.max_total_tokens,
        "chunked_prefill_size": args.chunked_prefill_size,
        "enable_hierarchical_cache": args.enable_hierarchical_cache,
        "tp_size": args.tp,
        "dcp_size": args.dcp,
    }
