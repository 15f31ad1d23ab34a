"""``python -m kvjax demo``: the main job, a reuse-heavy workload served cold and warm.

Every flag is checked before jax is imported: numbers by their argparse types, the workload and
the cache by `kvjax.demo_config.check_demo` (which plans the cache, jax-free), the storage
directory by `storage_dir`. Only then is the model loaded and the workload served.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from kvjax.cli.arg_types import non_negative_int, positive_int
from kvjax.cli.combination_flags import check_combinations
from kvjax.cli.disaggregation_flags import add_disaggregation_arguments, cache_mode, check_disaggregation, disaggregated
from kvjax.cli.messages import UsageError
from kvjax.cli.model_arg import model_spec
from kvjax.cli.multihost_flags import add_process_arguments, join_group, joins_group
from kvjax.cli.serving_args import (
    SERVING_FLAGS,
    add_serving_arguments,
    cache_options,
    dp_attention_config,
    kv_events_options,
    speculative_options,
)
from kvjax.config import EVICTION_POLICIES
from kvjax.errors import ConfigError, OutOfMemoryError
from kvjax.multihost.errors import AuthenticationError, CoordinatorError, DivergenceError, ProcessLostError
from kvjax.multihost.wire import WireError
from kvjax.serve.workload import Workload

# CacheConfig and Workload options -> this command's flags (error messages name these).
OPTION_FLAGS = {
    **SERVING_FLAGS,
    "groups": "--groups",
    "prompts_per_group": "--prompts-per-group",
    "system_tokens": "--system-tokens",
    "chats": "--chats",
    "turns": "--turns",
    "output_tokens": "--output-tokens",
    "seed": "--seed",
    "radix_eviction_policy": "--radix-eviction-policy",
    "hicache_storage_backend": "--hicache-storage",
    "hicache_storage_dir": "--hicache-storage",
}


def option_flags(args: argparse.Namespace) -> dict[str, str]:
    """Which flag of ``demo`` sets which option."""
    return OPTION_FLAGS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``demo`` sub-command."""
    demo = sub.add_parser("demo", help="serve a reuse-heavy workload (tiny model or a checkpoint), cold and warm")
    demo.add_argument("--json", action="store_true", help="print the report as one JSON object")
    demo.add_argument("--model", help="a Hugging Face checkpoint directory or a small preset (default: tiny)")
    w = Workload()
    count, positive = non_negative_int, positive_int
    demo.add_argument("--groups", type=count, default=w.groups, help="groups of requests sharing a system prompt")
    demo.add_argument("--prompts-per-group", type=positive, default=w.prompts_per_group)
    demo.add_argument("--system-tokens", type=count, default=w.system_tokens)
    demo.add_argument("--chats", type=count, default=w.chats, help="multi-turn conversations")
    demo.add_argument("--turns", type=positive, default=w.turns)
    demo.add_argument("--output-tokens", type=positive, default=w.output_tokens, help="tokens generated per request")
    demo.add_argument("--seed", type=count, default=w.seed)
    demo.add_argument("--radix-eviction-policy", choices=EVICTION_POLICIES, default="lru")
    demo.add_argument(
        "--hicache-storage",
        metavar="DIR",
        default=None,
        help="with --enable-hierarchical-cache: a storage tier (L3) in DIR, created when missing; host copies "
        "are written there and prefetched back on a miss",
    )
    add_process_arguments(demo)
    add_disaggregation_arguments(demo)
    add_serving_arguments(
        demo,
        dtype_help="serve the checkpoint in this dtype",
        max_total_tokens=16384,
        max_total_tokens_help="pool size in tokens (make it small to force eviction and retraction)",
    )


def storage_dir(path: str | None, *, host_tier: bool) -> tuple[Path | None, bool]:
    """``--hicache-storage``: ``(directory, whether it has to be created)``, or a `UsageError`
    for a directory the storage tier cannot use (a file, one it cannot write, or no host tier)."""
    if path is None:
        return None, False
    if not host_tier:
        raise UsageError(
            f"--hicache-storage {path}: the storage tier sits under the host tier; add --enable-hierarchical-cache"
        )
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f"--hicache-storage {path}: is a file, not a directory; give a directory (created if missing)")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"--hicache-storage {path}: {existing} is a file, so the directory cannot be created")
    if not _writable(existing):
        what = "the directory" if existing == target else f"its parent {existing}"
        raise UsageError(f"--hicache-storage {path}: {what} is not writable; give a directory you can write to")
    return target, existing != target


def _writable(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` (tried: permission bits do not bind root)."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".kvjax-write-check-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def run(args: argparse.Namespace) -> int:
    if args.dtype and not args.model:
        raise UsageError(f"--dtype {args.dtype} applies to a checkpoint: pass --model DIR with it")
    from kvjax.demo_config import DEMO_MODEL, check_demo

    spec = model_spec(args.model or DEMO_MODEL)
    workload = Workload(
        groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        system_tokens=args.system_tokens,
        chats=args.chats,
        turns=args.turns,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )
    speculative = speculative_options(args, spec.vocab_size, spec.hidden_size)
    if speculative.get("speculative_algorithm"):  # EAGLE / NEXTN
        raise UsageError(
            f"--speculative-algorithm {args.speculative_algorithm}: the MTP draft is served by generate; demo runs "
            "STANDALONE drafts"
        )
    check_disaggregation(args, command="demo", speculative=bool(speculative), processes=joins_group(args))
    storage, create = storage_dir(args.hicache_storage, host_tier=args.enable_hierarchical_cache)
    check_combinations(args, spec, model=DEMO_MODEL)
    check_demo(
        spec,
        workload,
        eviction_policy=args.radix_eviction_policy,
        **cache_options(args),
        **dp_attention_config(args),
        **cache_mode(args),
        **({} if storage is None else {"hicache_storage_backend": "file", "hicache_storage_dir": str(storage)}),
    )
    if storage is not None and create:
        try:
            storage.mkdir(parents=True)
        except OSError as e:
            raise UsageError(f"--hicache-storage {storage}: cannot create it ({e.strerror})") from None
        print(f"python -m kvjax demo: created the --hicache-storage directory {storage}", file=sys.stderr)

    # Every argument is checked: now jax (joining a multi-process run first) and the model.
    try:
        group = join_group(args)
    except CoordinatorError as e:
        raise UsageError(str(e)) from None
    from kvjax.demo import run_demo
    from kvjax.serve.generate import resolve_model

    model = resolve_model(args.model, dtype=args.dtype) if args.model else None
    if speculative:
        speculative["draft"] = resolve_model(speculative.pop("draft_path"), dtype=args.dtype)
    if disaggregated(args):  # a prefill or a decode server (kvjax.cli.disaggregation_run)
        from kvjax.cli.disaggregation_run import demo_disaggregated

        options = dict(cache_options(args), eviction_policy=args.radix_eviction_policy)
        return demo_disaggregated(args, workload, model, options)
    try:
        report = run_demo(
            group=group,
            workload=workload,
            eviction_policy=args.radix_eviction_policy,
            hicache_storage=args.hicache_storage,
            progress=not args.json,
            model=model,
            overlap=not args.disable_overlap_schedule,
            dp_routing=args.dp_routing,
            **cache_options(args),
            **speculative,
            **kv_events_options(args),
        )
    except OutOfMemoryError as e:
        raise ConfigError("max_total_tokens", args.max_total_tokens, str(e)) from None
    except (ProcessLostError, DivergenceError, AuthenticationError, WireError) as e:
        print(f"python -m kvjax demo: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report)
    return 0 if report.ok else 1
