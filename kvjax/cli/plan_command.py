"""python -m kvjax plan: capacity planning from a preset or a config.json, without jax.

Sizing, one of:
  --memory 16GiB       the KV-cache budget of one device, as is;
  --tpu v5e [--chips 8] [--weights-bytes 16GB]
                       the chip's HBM times --mem-fraction-static (SGLang's 0.9 by default),
                       minus the chip's share of the weights when their size is given (kvjax
                       does not guess it); --chips sets --tp when that is not given;
  --max-total-tokens N a pool of N tokens, whatever it costs.

Parallelism: --tp N (KV heads split over N ranks, replicated when N exceeds them), --dp M (DP
attention: M ranks of N/M attention-TP ranks, each with its own pools), --pp P, --dcp D (decode
context parallelism, dividing --tp as in SGLang: on the same N chips the KV heads go over N/D ranks
and each request's KV is striped over D, the weights staying split over all N; the pool counts the
striped tokens, the device holds 1/D of them). Tokens and bytes are per device.

Answers: --context N (how many requests of N tokens fit), --concurrency M (the longest context
M requests can each have), --sweep (a table over page sizes, KV dtypes and TP).

Every bad input is one line on stderr naming the flag, the value and the fix, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable
from typing import Any

from kvjax.chips import TPU_CHIPS, tpu_chip, weights_per_chip
from kvjax.cli.arg_types import fraction, parse_bytes, positive_int
from kvjax.cli.messages import UsageError, config_error_line
from kvjax.config import KV_CACHE_DTYPES, PLATFORMS, CacheConfig
from kvjax.errors import ConfigError
from kvjax.mesh_check import check_dcp_sizes, check_parallel_sizes
from kvjax.spec import ModelSpec

# CacheConfig / planner options -> the flag of this command that sets them (see ``option_flags``).
FLAG_FOR_OPTION = {
    "memory_budget_bytes": "--memory",
    "mem_fraction_static": "--mem-fraction-static",
    "device_memory_bytes": "--tpu",
    "reserved_memory_bytes": "--weights-bytes",
    "weights_bytes": "--weights-bytes",
    "max_total_tokens": "--max-total-tokens",
    "page_size": "--page-size",
    "kv_cache_dtype": "--kv-cache-dtype",
    "tp_size": "--tp",
    "attn_tp_size": "--tp",
    "dp_size": "--dp",
    "dcp_size": "--dcp",
    "pp_size": "--pp",
    "context_length": "--context-length",
    "max_running_requests": "--max-running-requests",
    "platform": "--platform",
    "disable_radix_cache": "--disable-radix-cache",
    "enable_hierarchical_cache": "--enable-hierarchical-cache",
    "disaggregation_mode": "--disaggregation-mode",
    "tokens_per_request": "--context",
    "num_requests": "--concurrency",
    "tpu": "--tpu",
    "model": "--model",
}


def option_flags(args: argparse.Namespace) -> dict[str, str]:
    """``FLAG_FOR_OPTION`` for this command line: without ``--tp``, ``--chips`` sets the TP size,
    so a refused TP size is the ``--chips`` the user typed."""
    flags = dict(FLAG_FOR_OPTION)
    if getattr(args, "tp", None) is None and getattr(args, "chips", None) is not None:
        flags["tp_size"] = flags["attn_tp_size"] = "--chips"
    return flags


SWEEP_PAGE_SIZES = (16, 32, 64, 128)
SWEEP_KV_DTYPES = ("auto", "fp8_e4m3")
SWEEP_TP_SIZES = (1, 2, 4, 8)

__all__ = ["FLAG_FOR_OPTION", "UsageError", "add_parser", "option_flags", "parse_bytes", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``plan`` sub-command."""
    plan = sub.add_parser(
        "plan",
        help="plan a KV cache: tokens that fit, per-pool bytes, decisions",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("--model", required=True, help=f"a preset ({', '.join(ModelSpec.presets())}) or a config.json")
    size = plan.add_argument_group("sizing (one of --memory, --tpu, --max-total-tokens)")
    size.add_argument("--memory", type=parse_bytes, default=None, help="KV-cache budget per device, e.g. 16GiB")
    size.add_argument("--tpu", choices=sorted(TPU_CHIPS), default=None, help="size from one chip's HBM")
    size.add_argument("--chips", type=positive_int, default=None, help="chips in the slice (default: --tp x --pp)")
    size.add_argument("--mem-fraction-static", type=fraction, default=None, help="share of HBM for weights + KV (0.9)")
    size.add_argument(
        "--weights-bytes", type=parse_bytes, default=None, help="checkpoint size, split over tp x pp chips (with --tpu)"
    )
    size.add_argument("--max-total-tokens", type=positive_int, default=None)
    plan.add_argument("--page-size", type=positive_int, default=16)
    plan.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    plan.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel size (KV heads split over it)")
    plan.add_argument(
        "--dp",
        type=positive_int,
        default=1,
        help="DP-attention size (enable_dp_attention): dp ranks of tp/dp attention-TP ranks, each with its own pools",
    )
    plan.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size (layers split over it)")
    plan.add_argument(
        "--dcp",
        type=positive_int,
        default=1,
        help="decode-context-parallel size, dividing --tp: KV heads over tp/D ranks, each request's KV "
        "striped over D (the same tp chips; weights split over all of them)",
    )
    plan.add_argument("--context-length", type=positive_int, default=None)
    plan.add_argument("--max-running-requests", type=positive_int, default=None)
    plan.add_argument("--platform", choices=PLATFORMS, default="tpu", help="storage layout target (default tpu)")
    plan.add_argument("--disable-radix-cache", action="store_true")
    plan.add_argument("--enable-hierarchical-cache", action="store_true")
    plan.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null")
    ask = plan.add_argument_group("questions")
    ask.add_argument("--context", type=positive_int, default=None, help="how many requests of N tokens fit")
    ask.add_argument("--concurrency", type=positive_int, default=None, help="the longest context for M requests")
    ask.add_argument("--sweep", action="store_true", help="a table over page sizes, KV dtypes and TP")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")


# --- sizing -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizing:
    """How one device's budget was set, for the report and the planner call."""

    device_memory_bytes: int | None
    chips: int
    replicas: int
    note: str


def _sizing(args: argparse.Namespace, tp: int) -> Sizing:
    model_parallel = tp * args.pp  # chips one replica spans (DCP divides tp); weights split over tp x pp
    chips = args.chips if args.chips is not None else model_parallel
    if args.tpu is None:
        for flag, value in (("--chips", args.chips), ("--weights-bytes", args.weights_bytes)):
            if value is not None:
                raise UsageError(f"{flag} {value}: it needs --tpu (the chip whose HBM is split); or drop it")
        if args.mem_fraction_static is not None:
            raise UsageError(
                f"--mem-fraction-static {args.mem_fraction_static}: it is a share of a chip's HBM; add --tpu"
            )
        if args.memory is None and args.max_total_tokens is None:
            raise UsageError(
                "--memory is missing: give the KV-cache budget per device (e.g. --memory 16GiB), "
                "a chip (--tpu v5e --chips 8) or a pool size (--max-total-tokens 100000)"
            )
        return Sizing(None, chips, 1, "")
    if args.memory is not None:
        raise UsageError(f"--memory {args.memory} and --tpu {args.tpu} both set the budget; give one of them")
    if chips % model_parallel:
        raise UsageError(
            f"--chips {chips}: not a multiple of --tp {tp} x --pp {args.pp} = {model_parallel}; "
            "use a chip count that the model-parallel group divides"
        )
    chip = tpu_chip(args.tpu)
    fraction = args.mem_fraction_static or 0.9
    if args.weights_bytes is None:
        weights = "weights not subtracted (pass --weights-bytes with the checkpoint size)"
    else:
        share = weights_per_chip(args.weights_bytes, tp * args.pp)
        weights = f"minus weights {_gib(share)} per chip ({_gib(args.weights_bytes)} over {tp * args.pp} chips)"
    note = (
        f"{chip.slice_name(chips)}: {chips} chips x {_gib(chip.hbm_bytes)} HBM; tp {tp} x pp {args.pp}"
        + (f" (dcp {args.dcp} of the tp ranks)" if args.dcp > 1 else "")
        + ", "
        f"{chips // model_parallel} replica(s); budget per chip = {_gib(chip.hbm_bytes)} x {fraction}, {weights}"
    )
    return Sizing(chip.hbm_bytes, chips, chips // model_parallel, note)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


#: CacheConfig options set as typed by the flag of the same name (``--max-total-tokens``, ...).
_OPTIONS_AS_TYPED = (
    "max_total_tokens",
    "context_length",
    "max_running_requests",
    "platform",
    "disable_radix_cache",
    "enable_hierarchical_cache",
    "disaggregation_mode",
)


def _config(args: argparse.Namespace, *, page_size: int, kv_dtype: str, tp: int) -> CacheConfig:
    """The ``CacheConfig`` this command line plans (``--dp`` > 1 turns on DP attention, as
    SGLang's ``--dp N --enable-dp-attention``). Raises ``ConfigError`` for ``--dp`` not dividing
    the TP size (``kvjax.mesh_check``)."""
    check_parallel_sizes(tp, args.dp, args.dp > 1)
    reserved = 0
    if args.tpu is not None and args.weights_bytes is not None:
        reserved = weights_per_chip(args.weights_bytes, tp * args.pp)
    check_dcp_sizes(args.dcp, tp, args.dp > 1, args.dp)
    return CacheConfig(
        page_size=page_size,
        kv_cache_dtype=kv_dtype,
        memory_budget_bytes=args.memory,
        mem_fraction_static=(args.mem_fraction_static or 0.9) if args.tpu is not None else None,
        reserved_memory_bytes=reserved,
        tp_size=tp,
        dp_size=args.dp,
        enable_dp_attention=args.dp > 1,
        pp_size=args.pp,
        dcp_size=args.dcp,
        **{option: getattr(args, option) for option in _OPTIONS_AS_TYPED},
    )


# --- errors ---------------------------------------------------------------------------------------


_BYTE_FLAGS = ("--memory", "--weights-bytes")


def cli_message(error: ConfigError, args: argparse.Namespace, *, sweep: bool = False) -> str:
    """A `ConfigError` in this command's words: the flag and the value the user typed (sizes
    also in GiB), then the fix with options spelled as flags. In a sweep row the TP size is the
    row's own (``--tp``), whatever set it."""
    show = {}
    for flag in _BYTE_FLAGS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if value is not None:
            show[flag] = f"{value} ({_gib(value)})"
    if error.option == "reserved_memory_bytes" and isinstance(error.value, int) and "--weights-bytes" in show:
        show["--weights-bytes"] += f", {_gib(error.value)} per chip"
    return config_error_line(error, FLAG_FOR_OPTION if sweep else option_flags(args), args, show=show)


# --- output ---------------------------------------------------------------------------------------


def _answers(plan: Any, args: argparse.Namespace) -> dict[str, int]:
    out: dict[str, int] = {}
    if args.context is not None:
        out["requests_that_fit"] = _ask(plan, "requests_that_fit", args.context)
    if args.concurrency is not None:
        out["max_context"] = _ask(plan, "max_context_for", args.concurrency)
    return out


def _ask(plan: Any, method: str, value: int) -> int:
    fn: Callable[[int], int] | None = getattr(plan, method, None)
    if fn is None:
        raise NotImplementedError(f"this planner has no CachePlan.{method}; update kvjax")
    return int(fn(value))


def _answer_lines(answers: dict[str, int], args: argparse.Namespace, sizing: Sizing, context_length: int) -> list[str]:
    lines = []
    per = "" if sizing.replicas == 1 else f" per replica, {sizing.replicas} replicas"
    if "requests_that_fit" in answers:
        n = answers["requests_that_fit"]
        why = ""
        if args.context > context_length:
            why = f" (longer than the context length {context_length:,}; raise --context-length if the model allows)"
        lines.append(f"requests of {args.context:,} tokens that fit at once: {n:,}{per}{why}")
    if "max_context" in answers:
        t = answers["max_context"]
        why = " (not even one token each fits; lower --concurrency or raise the budget)" if t == 0 else ""
        lines.append(f"longest context for {args.concurrency:,} concurrent requests: {t:,} tokens{per}{why}")
    return lines


def _sweep_rows(spec: ModelSpec, args: argparse.Namespace, plan_fn: Callable[..., Any]) -> list[dict[str, Any]]:
    rows = []
    # Under --dcp D only the TP sizes D divides (DCP divides the TP group).
    tps: Iterable[int] = (args.tp,) if args.tp is not None else [tp for tp in SWEEP_TP_SIZES if tp % args.dcp == 0]
    for tp in tps:
        for page in SWEEP_PAGE_SIZES:
            for dtype in SWEEP_KV_DTYPES:
                row: dict[str, Any] = {"tp": tp, "page_size": page, "kv_cache_dtype": dtype}
                try:
                    sizing = _sizing(args, tp)
                    plan = plan_fn(
                        spec,
                        _config(args, page_size=page, kv_dtype=dtype, tp=tp),
                        device_memory_bytes=sizing.device_memory_bytes,
                    )
                except ConfigError as e:
                    row["refused"] = cli_message(e, args, sweep=True)
                except UsageError as e:
                    row["refused"] = str(e)
                else:
                    row.update(
                        max_total_tokens=plan.max_total_tokens,
                        bytes_per_token=plan.bytes_per_token,
                        device_bytes=plan.device_bytes,
                        **_answers(plan, args),
                    )
                rows.append(row)
    return rows


def _sweep_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = f"{'tp':>3} {'page':>5} {'kv dtype':<9} {'tokens/device':>14} {'bytes/token':>12} {'device':>11}"
    if args.context is not None:
        head += f" {'fit@' + str(args.context):>12}"
    if args.concurrency is not None:
        head += f" {'ctx@' + str(args.concurrency):>12}"
    lines = [head]
    for r in rows:
        line = f"{r['tp']:>3} {r['page_size']:>5} {r['kv_cache_dtype']:<9}"
        if "refused" in r:
            lines.append(f"{line} refused: {r['refused']}")
            continue
        line += f" {r['max_total_tokens']:>14,} {r['bytes_per_token']:>12,} {_gib(r['device_bytes']):>11}"
        if "requests_that_fit" in r:
            line += f" {r['requests_that_fit']:>12,}"
        if "max_context" in r:
            line += f" {r['max_context']:>12,}"
        lines.append(line)
    return "\n".join(lines)


# --- entry ----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Plan and print; raises `UsageError` or `ConfigError` (the dispatcher prints them)."""
    from kvjax.plan import plan_kv_cache

    spec = ModelSpec.resolve(args.model)
    if args.sweep:
        rows = _sweep_rows(spec, args, plan_kv_cache)
        print(json.dumps({"model": spec.name, "rows": rows}) if args.json else _sweep_table(rows, args))
        return 0
    tp = args.tp if args.tp is not None else max(1, (args.chips or 1) // args.pp) if args.tpu else 1
    sizing = _sizing(args, tp)
    config = _config(args, page_size=args.page_size, kv_dtype=args.kv_cache_dtype, tp=tp)
    plan = plan_kv_cache(spec, config, device_memory_bytes=sizing.device_memory_bytes)
    answers = _answers(plan, args)
    if args.json:
        out = plan.to_dict()
        out["answers"] = answers
        if sizing.note:
            out["sizing"] = {"note": sizing.note, "chips": sizing.chips, "replicas": sizing.replicas}
        print(json.dumps(out, indent=2))
        return 0
    lines = [str(plan)]
    if sizing.note:
        lines.append(f"  sizing: {sizing.note}")
    lines += _answer_lines(answers, args, sizing, plan.context_length)
    print("\n".join(lines))
    return 0
