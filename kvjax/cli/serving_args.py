"""The flags ``demo`` and ``generate`` share: the serving cache's size and shape, the model's dtype,
the host tier and the schedule, added to a parser in one call, the flag of each option, and the
cache options they set (``cache_options``)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from kvjax.cli.arg_types import positive_int
from kvjax.cli.messages import UsageError
from kvjax.cli.model_arg import model_spec
from kvjax.mesh_check import check_dcp_sizes, check_parallel_sizes

#: CacheConfig / model options -> the shared flag that sets them (error messages name these).
SERVING_FLAGS = {
    "model": "--model",
    "dtype": "--dtype",
    "page_size": "--page-size",
    "max_total_tokens": "--max-total-tokens",
    "chunked_prefill_size": "--chunked-prefill-size",
    "enable_hierarchical_cache": "--enable-hierarchical-cache",
    "tp_size": "--tp",
    "dp_size": "--dp",
    "speculative_algorithm": "--speculative-algorithm",
    "speculative_num_steps": "--speculative-num-steps",
    "speculative_eagle_topk": "--speculative-eagle-topk",
    "speculative_num_draft_tokens": "--speculative-num-draft-tokens",
    "draft": "--speculative-draft-model-path",
    "dcp_size": "--dcp",
    "pp_size": "--pp",
    "kv_events_config": "--kv-events-config",
}


def add_serving_arguments(
    parser: argparse.ArgumentParser, *, dtype_help: str, max_total_tokens: int | None, max_total_tokens_help: str
) -> None:
    """Add ``--dtype``, ``--page-size`` (16), ``--max-total-tokens`` (default ``max_total_tokens``),
    ``--chunked-prefill-size`` (512), ``--enable-hierarchical-cache``,
    ``--disable-overlap-schedule``, ``--tp`` (1), ``--dcp`` (1), ``--pp`` (1), ``--dp`` (1), ``--dp-routing``
    (cache_aware) and the speculative flags (``--speculative-algorithm``,
    ``--speculative-draft-model-path``, ``--speculative-num-steps``, ``--speculative-eagle-topk``,
    ``--speculative-num-draft-tokens``: SGLang's names) to ``parser``."""
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
        help="decode-context-parallel size: divides --tp; the TP group's KV heads over tp/N ranks and each "
        "request's KV striped over N (a (tp/N, N) mesh of the --tp devices, weights split over all of them)",
    )
    parser.add_argument(
        "--pp",
        type=positive_int,
        default=1,
        help="pipeline-parallel size: the layers split into N stages of --tp devices each (pp x tp local "
        "devices), micro-batches overlapping the stages",
    )
    parser.add_argument(
        "--dp",
        type=positive_int,
        default=1,
        help="DP attention ranks (SGLang's --dp M --enable-dp-attention): the --tp devices split into M ranks, "
        "each with its own radix tree, pool slice (--max-total-tokens each) and batch, all ranks in one step "
        "(overlap scheduling unless --disable-overlap-schedule); M must divide --tp",
    )
    parser.add_argument(
        "--dp-routing",
        choices=["cache_aware", "round_robin"],
        default="cache_aware",
        help="with --dp: send each request to the rank whose tree holds its longest prefix (cache_aware, the "
        "default) or to the ranks in turn (round_robin, SGLang's)",
    )
    parser.add_argument(
        "--speculative-algorithm",
        choices=["STANDALONE", "EAGLE", "EAGLE3", "NEXTN"],
        help="speculative decoding, the target verifying greedily: STANDALONE, a separate small draft model "
        "proposes; EAGLE (NEXTN, SGLang's alias for DeepSeek's MTP), the checkpoint's MTP layer proposes from "
        "the target's hidden states; EAGLE3, a LlamaForCausalLMEagle3 draft reads three of the target's layers",
    )
    parser.add_argument(
        "--speculative-draft-model-path",
        metavar="DIR",
        help="the draft: a checkpoint or a preset (STANDALONE); the checkpoint whose MTP layer drafts "
        "(EAGLE / NEXTN; default --model); the EAGLE3 draft's checkpoint (EAGLE3)",
    )
    parser.add_argument("--speculative-num-steps", type=positive_int, help="draft tokens per round (default 3)")
    parser.add_argument(
        "--speculative-eagle-topk", type=positive_int, help="EAGLE candidates per step: 1 (one chain) is served"
    )
    parser.add_argument(
        "--speculative-num-draft-tokens",
        type=positive_int,
        help="tokens the target verifies per round: --speculative-num-steps + 1 (the default) with topk 1",
    )
    parser.add_argument(
        "--kv-events-config",
        metavar="JSON",
        type=kv_events_config,
        help="publish the radix cache's KV events for fleet routers (SGLang's flag, vLLM's wire format), e.g. "
        '\'{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}\'; '
        'add "block_hash": "sha256_cbor" for vLLM\'s block hashes (seeded by PYTHONHASHSEED or "hash_seed"); '
        "with --dp, rank r publishes at each port + r",
    )


def kv_events_config(text: str) -> Any:
    """``--kv-events-config``: the parsed ``KVEventsConfig`` (jax-free, no msgspec), its
    ``sha256_cbor`` seed taken from ``PYTHONHASHSEED`` when the JSON gives none (as vLLM seeds its
    hash); an ``argparse`` error naming the bad field otherwise."""
    from kvjax.errors import ConfigError
    from kvjax.kv_events.config import KVEventsConfig

    try:
        config = KVEventsConfig.from_json(text).with_seed(os.environ.get("PYTHONHASHSEED"))
        if config.publishes and config.block_hash == "sha256_cbor" and config.hash_seed is None:
            raise ConfigError("hash_seed", None, 'sha256_cbor needs a seed: set PYTHONHASHSEED or give "hash_seed"')
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return config


def kv_events_options(args: argparse.Namespace) -> dict[str, Any]:
    """What ``--kv-events-config`` adds to the serving entry points' arguments: ``{"kv_events":
    config}``, or nothing without the flag (or with a configuration that publishes nothing)."""
    config = getattr(args, "kv_events_config", None)
    return {"kv_events": config} if config is not None and config.publishes else {}


def speculative_options(
    args: argparse.Namespace, target_vocab_size: int, target_hidden_size: int | None = None
) -> dict[str, Any]:
    """The speculative flags, checked without jax: ``{}`` without ``--speculative-algorithm``, else
    ``draft_path`` and ``speculative_num_steps`` (a `UsageError` for a missing or mismatched draft
    or steps without an algorithm; an MTP draft's ``hidden_size`` is checked
    against ``target_hidden_size`` when given, a STANDALONE draft's is its own)."""
    topk = getattr(args, "speculative_eagle_topk", None)
    draft_tokens = getattr(args, "speculative_num_draft_tokens", None)
    if args.speculative_algorithm is None:
        if args.speculative_draft_model_path or args.speculative_num_steps or topk or draft_tokens:
            raise UsageError(
                "--speculative-draft-model-path/--speculative-num-steps/--speculative-eagle-topk/"
                "--speculative-num-draft-tokens need --speculative-algorithm"
            )
        return {}
    steps = args.speculative_num_steps or 3
    if draft_tokens is not None and draft_tokens != steps + 1:
        raise UsageError(
            f"--speculative-num-draft-tokens {draft_tokens}: one chain of {steps} draft tokens is verified as "
            f"{steps + 1} tokens; give {steps + 1} or drop it"
        )
    if args.speculative_algorithm in ("EAGLE", "NEXTN"):
        return _eagle_options(args, topk, steps, target_vocab_size, target_hidden_size)
    if args.speculative_algorithm == "EAGLE3":
        return _eagle3_options(args, topk, steps, target_vocab_size, target_hidden_size)
    if topk is not None:
        raise UsageError(f"--speculative-eagle-topk {topk}: only EAGLE / NEXTN / EAGLE3 take it; drop it")
    if not args.speculative_draft_model_path:
        raise UsageError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path DIR (or a preset)")
    path = args.speculative_draft_model_path
    try:
        draft = model_spec(path)
    except UsageError as e:  # model_spec names --model; this is the draft's flag
        raise UsageError(str(e).replace(f"--model {path}", f"--speculative-draft-model-path {path}", 1)) from None
    if draft.vocab_size != target_vocab_size:
        raise UsageError(
            f"--speculative-draft-model-path {args.speculative_draft_model_path}: vocab_size {draft.vocab_size}, "
            f"the target's is {target_vocab_size}; give a draft of the same family and tokenizer"
        )
    return {"draft_path": args.speculative_draft_model_path, "speculative_num_steps": steps}


def _eagle_options(
    args: argparse.Namespace, topk: int | None, steps: int, target_vocab_size: int, target_hidden_size: int | None
) -> dict[str, Any]:
    """``speculative_options`` for EAGLE / NEXTN: the MTP layer of ``--speculative-draft-model-path``
    (default ``--model``, which must then be a checkpoint directory), or the EAGLE head there (its
    ``config.json`` names ``LlamaForCausalLMEagle``: the cache is then planned for ``EAGLE``, one
    draft layer), ``--speculative-eagle-topk`` 1 only (jax-free checks)."""
    if topk is not None and topk != 1:
        raise UsageError(
            f"--speculative-eagle-topk {topk}: kvjax drafts one chain per request (greedy verification of a "
            "chain, no token tree); give 1 or drop it"
        )
    path = args.speculative_draft_model_path or getattr(args, "model", None)
    if not path:
        raise UsageError(
            f"--speculative-algorithm {args.speculative_algorithm} needs --speculative-draft-model-path DIR (or "
            "--model DIR): a checkpoint with an MTP layer"
        )
    flag = "--speculative-draft-model-path" if args.speculative_draft_model_path else "--model"
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(
            f"{flag} {path}: --speculative-algorithm {args.speculative_algorithm} reads the MTP layer from a "
            "checkpoint directory (config.json and *.safetensors with DeepSeek-V3's model.layers.<num_hidden_layers>.* "
            "or Qwen3-Next's mtp.*)"
        )
    spec = model_spec(path)
    head = _names_eagle_head(path)
    if not head and spec.num_nextn_predict_layers != 1:
        raise UsageError(
            f"--speculative-algorithm {args.speculative_algorithm}: {flag} {path} has num_nextn_predict_layers="
            f"{spec.num_nextn_predict_layers}; kvjax drafts with a checkpoint's one MTP layer (DeepSeek-V3's, or "
            "Qwen3-Next's mtp.* with mtp_num_hidden_layers 1), or for a Llama target with an EAGLE head "
            "(--speculative-draft-model-path DIR of a LlamaForCausalLMEagle checkpoint)"
        )
    if spec.vocab_size != target_vocab_size:
        raise UsageError(
            f"{flag} {path}: vocab_size {spec.vocab_size}, the target's is {target_vocab_size}; its MTP layer "
            "shares the target's embedding and head"
        )
    if target_hidden_size is not None and spec.hidden_size != target_hidden_size:
        raise UsageError(
            f"{flag} {path}: hidden_size {spec.hidden_size}, the target's is {target_hidden_size}; its MTP layer "
            "reads the target's hidden states: give the target's own checkpoint (or one of the same hidden size)"
        )
    algorithm = "EAGLE" if head else "NEXTN"  # a head's cache plans one draft layer; an MTP layer's, NEXTN
    return {"draft_path": path, "speculative_num_steps": steps, "speculative_algorithm": algorithm}


def _eagle3_options(
    args: argparse.Namespace, topk: int | None, steps: int, target_vocab_size: int, target_hidden_size: int | None
) -> dict[str, Any]:
    """``speculative_options`` for EAGLE3: the ``LlamaForCausalLMEagle3`` checkpoint of
    ``--speculative-draft-model-path`` (required), its ``hidden_size`` and ``vocab_size`` the
    target's, ``--speculative-eagle-topk`` 1 only (jax-free checks; the rest when it is loaded:
    ``kvjax.serve.speculative.eagle3_checkpoint``)."""
    if topk is not None and topk != 1:
        raise UsageError(
            f"--speculative-eagle-topk {topk}: kvjax drafts one chain per request (greedy verification of a "
            "chain, no token tree); give 1 or drop it"
        )
    path = args.speculative_draft_model_path
    if not path:
        raise UsageError(
            "--speculative-algorithm EAGLE3 needs --speculative-draft-model-path DIR: a LlamaForCausalLMEagle3 "
            "checkpoint"
        )
    raw = _draft_config(path)
    if raw is None or "LlamaForCausalLMEagle3" not in (raw.get("architectures") or []):
        raise UsageError(
            f"--speculative-draft-model-path {path}: --speculative-algorithm EAGLE3 reads a checkpoint directory whose "
            "config.json names LlamaForCausalLMEagle3 (fc.*, midlayer.*, norm.*, lm_head.*, d2t in safetensors)"
        )
    for key, want in (("vocab_size", target_vocab_size), ("hidden_size", target_hidden_size)):
        if want is not None and raw.get(key) is not None and raw[key] != want:
            raise UsageError(
                f"--speculative-draft-model-path {path}: {key} {raw[key]}, the target's is {want}; the EAGLE3 draft "
                "shares the target's embedding and reads its hidden states: give a draft trained for this target"
            )
    return {"draft_path": path, "speculative_num_steps": steps, "speculative_algorithm": "EAGLE3"}


def _draft_config(path: str) -> dict[str, Any] | None:
    """The parsed ``config.json`` of the checkpoint ``path``, or None (no file, not a JSON object)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _names_eagle_head(path: str) -> bool:
    """Whether the checkpoint ``path``'s ``config.json`` names an EAGLE head's architecture
    (``LlamaForCausalLMEagle``: ``kvjax.serve.speculative.eagle_head``; read here without jax)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and "LlamaForCausalLMEagle" in (raw.get("architectures") or [])


def cache_options(args: argparse.Namespace) -> dict[str, Any]:
    """What the shared cache flags set, as the keyword arguments the serving entry points take
    (``check_demo``, ``run_demo``, ``generate``): ``page_size``, ``max_total_tokens`` (None: room
    for everything), ``chunked_prefill_size``, ``enable_hierarchical_cache``, ``tp_size``,
    ``dcp_size`` and, with ``--dp`` / ``--pp`` above 1, ``dp_size`` / ``pp_size`` (the jax-free checks add
    ``dp_attention_config``)."""
    return {
        "page_size": args.page_size,
        "max_total_tokens": args.max_total_tokens,
        "chunked_prefill_size": args.chunked_prefill_size,
        "enable_hierarchical_cache": args.enable_hierarchical_cache,
        "tp_size": args.tp,
        "dcp_size": args.dcp,
        **({"dp_size": args.dp} if args.dp > 1 else {}),
        **({"pp_size": args.pp} if args.pp > 1 else {}),
    }


def dp_attention_config(args: argparse.Namespace) -> dict[str, Any]:
    """What ``--dp`` above 1 adds to ``cache_options`` for the jax-free checks that plan the cache
    (``enable_dp_attention``; the serving entry points set it themselves), after checking, before
    jax starts, that ``--dp`` divides ``--tp`` (``ConfigError`` naming ``dp_size``), that ``--dcp`` divides
    each DP rank's ``--tp / --dp`` chips (naming ``dcp_size``) and that no
    flag asks for what DP attention does not serve with yet (`UsageError`: the host tier over
    pipeline stages)."""
    if args.dp == 1:
        return {}
    check_parallel_sizes(args.tp, args.dp, True)
    if args.pp > 1 and args.enable_hierarchical_cache:
        raise UsageError(
            f"--dp {args.dp} with --pp {args.pp} and --enable-hierarchical-cache: the host tier of pipeline stages "
            "under DP attention is not built in kvjax yet (a rank's copies would reach stage 0's layers only); drop "
            "--enable-hierarchical-cache, --dp or --pp"
        )
    check_dcp_sizes(args.dcp, args.tp, True, args.dp)
    return {"enable_dp_attention": True}
