"""``python -m kvjax demo``: the main job, a reuse-heavy workload served cold and warm."""

from __future__ import annotations

import argparse
import json

from kvjax.cli.plan_command import UsageError
from kvjax.errors import ConfigError, OutOfMemoryError
from kvjax.serve.workload import Workload


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``demo`` sub-command."""
    demo = sub.add_parser("demo", help="serve a reuse-heavy workload (tiny model or a checkpoint), cold and warm")
    demo.add_argument("--json", action="store_true", help="print the report as one JSON object")
    demo.add_argument("--model", help="a Hugging Face checkpoint directory or a small preset (default: tiny)")
    demo.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="serve the checkpoint in this dtype")
    w = Workload()
    demo.add_argument("--groups", type=int, default=w.groups, help="groups of requests sharing a system prompt")
    demo.add_argument("--prompts-per-group", type=int, default=w.prompts_per_group)
    demo.add_argument("--system-tokens", type=int, default=w.system_tokens)
    demo.add_argument("--chats", type=int, default=w.chats, help="multi-turn conversations")
    demo.add_argument("--turns", type=int, default=w.turns)
    demo.add_argument("--output-tokens", type=int, default=w.output_tokens, help="tokens generated per request")
    demo.add_argument("--seed", type=int, default=w.seed)
    demo.add_argument("--page-size", type=int, default=16)
    demo.add_argument(
        "--max-total-tokens",
        type=int,
        default=16384,
        help="pool size in tokens (make it small to force eviction and retraction)",
    )
    demo.add_argument("--chunked-prefill-size", type=int, default=512)
    demo.add_argument("--radix-eviction-policy", default="lru")
    demo.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="add the host-memory tier (HiCache): evicted prefixes are kept in host memory and loaded back",
    )
    demo.add_argument(
        "--hicache-storage",
        metavar="DIR",
        default=None,
        help="with --enable-hierarchical-cache: a storage tier (L3) in DIR; host copies are written there "
        "and prefetched back on a miss",
    )


def run(args: argparse.Namespace) -> int:
    from kvjax.demo import run_demo
    from kvjax.serve.generate import resolve_model

    if args.dtype and not args.model:
        raise UsageError(f"--dtype {args.dtype} applies to a checkpoint: pass --model DIR with it")
    model = resolve_model(args.model, dtype=args.dtype) if args.model else None

    workload = Workload(
        groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        system_tokens=args.system_tokens,
        chats=args.chats,
        turns=args.turns,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )
    try:
        report = run_demo(
            workload=workload,
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            eviction_policy=args.radix_eviction_policy,
            enable_hierarchical_cache=args.enable_hierarchical_cache,
            hicache_storage=args.hicache_storage,
            progress=not args.json,
            model=model,
        )
    except NotImplementedError as e:
        model_name = args.model or "tiny"
        raise ConfigError("model", model_name, f"kvjax cannot serve it with these settings yet: {e}") from None
    except OutOfMemoryError as e:
        raise ConfigError("max_total_tokens", args.max_total_tokens, str(e)) from None
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report)
    return 0 if report.ok else 1
