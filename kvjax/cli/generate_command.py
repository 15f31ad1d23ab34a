"""``python -m kvjax generate``: greedy generation from a checkpoint directory, a GGUF file (or an
installed GGUF model such as ``smollm2``) or a small preset.

Prompts are given as token ids (``--prompt-ids 1,2,3``) or, when the model has a tokenizer
(``tokenizer.json``, or a GGUF file's own), as text (``--prompt TEXT``); repeat either flag for
several prompts, served as one workload on one cache in the order given (later prompts reuse
earlier prefixes). ``--chat`` applies the model's chat template to each text prompt (one user
turn, the assistant's turn opened). Text is streamed as it is generated, prompt by prompt
(``kvjax.cli.text_stream``). ``--json`` prints ``{"outputs": [[ids per prompt], ...],
"cached_tokens": n, "prompt_tokens": n}`` (and ``"texts"`` with a tokenizer) at the end instead.

Images (a LLaVA checkpoint): ``--image FILE``, repeated, fills the prompts' image placeholders in
order (one placeholder id per image is expanded to the model's tokens per image); each file is
preprocessed as the checkpoint's ``preprocessor_config.json`` says (``kvjax.serve.image_files``)
and encoded through an embedding cache of ``--vlm-cache-size-mb`` MiB, whose counters are printed
(``"multimodal"`` with ``--json``). An unreadable file, an image count that does not match the
placeholders, a vision tower kvjax does not serve or a model that takes no images is one
``error:`` line, before the cache is built.

Several processes (``python -m kvjax launch --processes N -- generate ...``, or on a pod every
host with ``--distributed``; ``kvjax.cli.multihost_flags``): the prompts are served over one mesh
spanning every process's devices (``--tp`` over all of them, ``--dp`` ranks in process order),
every process scheduling the same requests (process 0's, broadcast with the step they arrive
at), so the tokens are those of one process. Process 0 prints the outputs as above; every other
process prints one status line on standard error (its count of generated tokens and a digest of
its outputs). A process that is lost, diverges or fails authentication is one ``error:`` line
(exit status 1), as for ``demo``. ``--dcp`` divides the mesh spanning the processes
(``group_tp_mesh``, ``group_dp_mesh``). Not across processes yet: ``--image`` and ``--pp``
(refused before jax starts).

Prefill/decode disaggregation (``--disaggregation-mode``; ``kvjax.cli.disaggregation_flags``):
``prefill`` takes no prompts and serves decode servers' until SIGINT or SIGTERM, after one line
``prefill server listening on HOST:PORT``; ``decode`` prints what a colocated run prints, each
prompt computed on a ``--disaggregation-prefill-addr`` server, with the decode server's counters
(``"disaggregation"`` with ``--json``); a request that failed is an ``error:`` line (exit status 1).

Bad input (a missing directory, no ``config.json`` or weights, a family kvjax cannot serve, a
missing or mis-shaped tensor, ``--prompt`` without a tokenizer, ids outside the vocabulary, a
pool too small for the longest request) exits 2 with one line naming the problem and the fix.
Everything that can be checked from the arguments and ``config.json`` is checked before jax is
imported or a weight is read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from typing import Any

from kvjax.cli import serving_args
from kvjax.cli.arg_types import non_negative_int, positive_int
from kvjax.cli.combination_flags import check_combinations
from kvjax.cli.disaggregation_flags import add_disaggregation_arguments, check_disaggregation, failed_requests
from kvjax.cli.messages import UsageError
from kvjax.cli.model_arg import model_spec
from kvjax.cli.multihost_flags import add_process_arguments, join_group, joins_group
from kvjax.cli.text_stream import PromptTextStream
from kvjax.errors import ConfigError
from kvjax.multihost.errors import AuthenticationError, CoordinatorError, DivergenceError, ProcessLostError
from kvjax.multihost.wire import WireError
from kvjax.text import TextTokenizer, text_tokenizer

OPTION_FLAGS = {
    **serving_args.SERVING_FLAGS,
    "vlm_cache_size_mb": "--vlm-cache-size-mb",
    "max_new_tokens": "--max-new-tokens",
    "max_batch_size": "--max-batch-size",
    "max_running_requests": "--max-batch-size",
}


def option_flags(args: argparse.Namespace) -> dict[str, str]:
    """Which flag of ``generate`` sets which option."""
    return OPTION_FLAGS


def cli_message(error: ConfigError, args: argparse.Namespace) -> str | None:
    """One image's error as ``--image FILE: fix`` (the file, not every ``--image``), the images'
    as ``--image given N times: fix`` or ``--image: fix``; None for the others (the shared
    rendering)."""
    fix = error.render_fix(OPTION_FLAGS)
    if error.option == "image":
        return f"--image {error.value}: {fix}"
    if error.option == "images":
        count = error.value
        return f"--image given {count} times: {fix}" if isinstance(count, int) else f"--image: {fix}"
    return None


class _AppendPrompt(argparse.Action):
    """Collect ``--prompt-ids`` and ``--prompt`` into one list, keeping the command line's order."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        prompts = list(getattr(namespace, "prompts", None) or [])
        prompts.append((self.const, values))
        namespace.prompts = prompts


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``generate`` sub-command."""
    gen = sub.add_parser("generate", help="greedy generation through the whole stack (plan, build, radix cache)")
    gen.add_argument(
        "--model",
        required=True,
        help="a Hugging Face checkpoint directory, a .gguf file, an installed GGUF model (smollm2), or a preset (tiny)",
    )
    gen.add_argument(
        "--prompt-ids", action=_AppendPrompt, const="ids", dest="prompts", metavar="IDS", help="comma-separated ids"
    )
    gen.add_argument(
        "--prompt",
        action=_AppendPrompt,
        const="text",
        dest="prompts",
        metavar="TEXT",
        help="text (needs the model's tokenizer)",
    )
    gen.add_argument(
        "--chat", action="store_true", help="apply the model's chat template to each --prompt (one user turn)"
    )
    gen.add_argument("--max-new-tokens", type=positive_int, default=16)
    gen.add_argument("--max-batch-size", type=positive_int, default=16, help="requests decoded together")
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument(
        "--cache-salt",
        action="append",
        metavar="SALT",
        help="the tenant's cache namespace: once for every prompt, or once per prompt in order "
        "(prompts of different salts share no cached page)",
    )
    gen.add_argument(
        "--priority",
        action="append",
        type=int,
        metavar="N",
        help="the request's priority (eviction under --radix-eviction-policy priority, and of its "
        "retention): once for every prompt, or once per prompt in order",
    )
    gen.add_argument(
        "--retention-seconds",
        action="append",
        type=_seconds,
        metavar="S",
        help="keep the prefix the prompt inserts: evicted after every unretained prefix until S seconds "
        "have passed (a bias, never a pin); once for every prompt, or once per prompt in order (0: none)",
    )
    gen.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image for the prompts' image placeholders (a LLaVA checkpoint), in order; repeat for several",
    )
    gen.add_argument(
        "--vlm-cache-size-mb",
        type=non_negative_int,
        default=None,
        metavar="MB",
        help="the image-embedding cache's size in MiB (default 100, SGLang's SGLANG_VLM_CACHE_SIZE_MB)",
    )
    add_process_arguments(gen)
    add_disaggregation_arguments(gen)
    serving_args.add_serving_arguments(
        gen,
        dtype_help="serve in this dtype",
        max_total_tokens=None,
        max_total_tokens_help="KV pool size in tokens (default: room for everything)",
    )


def parse_ids(text: str, index: int, vocab_size: int | None = None) -> list[int]:
    """``"1,2, 3"`` -> ``[1, 2, 3]``; a `UsageError` naming the prompt for text that is not ids, no
    ids, or an id outside ``[0, vocab_size)``."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise UsageError(
            f"--prompt-ids {text} (prompt {index}): write token ids as comma-separated integers, e.g. 1,2,3"
        ) from None
    if not ids:
        raise UsageError(f"--prompt-ids {text!r} (prompt {index}) is empty; give at least one token id")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        where = "are >= 0" if vocab_size is None else f"are in [0, {vocab_size}) (the model's vocab_size)"
        raise UsageError(f"--prompt-ids {text} (prompt {index}): token id {bad[0]} is out of range; ids {where}")
    return ids


def _prompt_ids(args: argparse.Namespace, spec_vocab: int, tokenizer: TextTokenizer | None) -> list[list[int]]:
    """Every prompt's ids, in command-line order: ``--prompt-ids`` parsed, ``--prompt`` encoded
    (under the chat template with ``--chat``). `UsageError` for text without a tokenizer, and for
    ``--chat`` with only ids or without a template."""
    raw_prompts: list[tuple[str, str]] = args.prompts or []
    if not raw_prompts:
        raise UsageError("give at least one prompt: --prompt-ids 1,2,3 or --prompt TEXT")
    texts = [text for kind, text in raw_prompts if kind == "text"]
    if texts and tokenizer is None:
        raise UsageError(
            f"--prompt {texts[0][:40]!r}: {args.model} has no tokenizer.json; pass token ids with "
            "--prompt-ids, or add the model's tokenizer.json to the directory"
        )
    if args.chat and (not texts or tokenizer is None or tokenizer.chat_template is None):
        why = "applies to --prompt TEXT" if not texts else f"needs a chat template, and {args.model} has none"
        raise UsageError(f"--chat {why}; drop --chat or pass a model with a chat template")
    prompts = []
    for i, (kind, text) in enumerate(raw_prompts):
        if kind == "ids":
            prompts.append(parse_ids(text, i + 1, spec_vocab))
        elif args.chat:
            prompts.append(tokenizer.encode_chat(text))  # type: ignore[union-attr]
        else:
            prompts.append(tokenizer.encode(text))  # type: ignore[union-attr]
    return prompts


def run(args: argparse.Namespace) -> int:
    spec = model_spec(args.model)
    check_disaggregation(
        args, command="generate", speculative=bool(args.speculative_algorithm), processes=joins_group(args)
    )
    if args.disaggregation_mode == "prefill":  # serves decode servers' prompts (kvjax.cli.disaggregation_run)
        from kvjax.cli.disaggregation_run import generate_prefill

        try:
            prefill_group = join_group(args)
        except CoordinatorError as e:
            raise UsageError(str(e)) from None
        return generate_prefill(args, prefill_group)
    try:
        tokenizer = text_tokenizer(args.model)
    except ConfigError:
        if any(kind == "text" for kind, _ in args.prompts or []):
            raise
        tokenizer = None  # ids in, ids out: a tokenizer kvjax cannot build is not needed
    prompts = _prompt_ids(args, spec.vocab_size, tokenizer)
    salts = _cache_salts(args.cache_salt, len(prompts))
    priorities = _each_prompt(args.priority, len(prompts), "--priority")
    retention = _each_prompt(args.retention_seconds, len(prompts), "--retention-seconds")
    _check_room(args, spec.context_length, max(len(p) for p in prompts))
    speculative = serving_args.speculative_options(args, spec.vocab_size, spec.hidden_size)
    dp_attention = bool(serving_args.dp_attention_config(args))
    check_combinations(args, spec)
    if args.image and dp_attention:
        raise UsageError(f"--image {args.image[0]} with --dp {args.dp}: images are served on one device; drop --dp")
    if joins_group(args):
        _check_across_processes(args)

    # Every argument is checked: now jax (joining a multi-process run first) and the model.
    try:
        group = join_group(args)
    except CoordinatorError as e:
        raise UsageError(str(e)) from None
    from kvjax.serve.generate import generate, generate_dp, resolve_draft, resolve_model

    vision = _image_options(args, spec.model_type) if args.image else {}
    model = resolve_model(args.model, dtype=args.dtype)
    if speculative:  # STANDALONE: a model of its own; EAGLE / NEXTN: the checkpoint's MTP layer
        algorithm = speculative.pop("speculative_algorithm", "STANDALONE")
        speculative["draft"] = resolve_draft(
            speculative.pop("draft_path"), model, algorithm=algorithm, dtype=args.dtype
        )
    options = serving_args.cache_options(args)
    prints = group is None or group.process_id == 0  # the outputs: process 0's alone
    stream = None
    if prints and not args.json and tokenizer is not None:
        stream = PromptTextStream(tokenizer, [len(p) for p in prompts])
    common = dict(
        max_new_tokens=args.max_new_tokens,
        max_batch_size=args.max_batch_size,
        stop_token_ids=() if args.ignore_eos else None,
        on_step=stream,
        cache_salts=salts,
        priorities=priorities,
        retention_seconds=retention,
        group=group,
    )
    if args.vlm_cache_size_mb is not None:
        common["vlm_cache_size_mb"] = args.vlm_cache_size_mb
    try:
        if args.disaggregation_mode == "decode":  # each prompt prefilled on a prefill server
            from kvjax.cli.disaggregation_run import generate_decode

            result = generate_decode(args, model, prompts, common)
        elif dp_attention:
            result, _ = generate_dp(
                model,
                prompts,
                dp_routing=args.dp_routing,
                overlap=not args.disable_overlap_schedule,
                **common,
                **options,
                **serving_args.kv_events_options(args),
                **speculative,
            )
        else:
            result, _ = generate(
                model,
                prompts,
                overlap=not args.disable_overlap_schedule,
                **common,
                **options,
                **serving_args.kv_events_options(args),
                **speculative,
                **vision,
            )
    except NotImplementedError as e:
        raise ConfigError("model", args.model, f"kvjax cannot serve it yet: {e}") from None
    except (ProcessLostError, DivergenceError, AuthenticationError, WireError) as e:
        print(f"python -m kvjax generate: error: {e}", file=sys.stderr)
        return 1
    if not prints:
        _print_status(group, result.outputs)
        return 0
    if args.json:
        report = result.to_dict()
        if tokenizer is not None:
            report["texts"] = [tokenizer.decode(output) for output in result.outputs]
        print(json.dumps(report))
        return failed_requests("generate", result.disaggregation)
    if stream is not None:
        stream.finish(result.outputs)
    else:
        for i, (prompt, output) in enumerate(zip(prompts, result.outputs, strict=True)):
            print(f"prompt {i + 1}: {len(prompt)} tokens -> {len(output)} generated: {output}")
    hit = result.cached_tokens / result.prompt_tokens if result.prompt_tokens else 0.0
    print(f"cached tokens {result.cached_tokens} of {result.prompt_tokens} prompt tokens ({hit:.1%})")
    if result.multimodal is not None:
        mm = result.multimodal
        print(
            f"images: {mm['images_encoded']} encoded in {mm['encoder_runs']} encoder runs; embedding cache "
            f"{mm['hits']} hits, {mm['misses']} misses, {mm['evictions']} evictions, {mm['bytes_used']} of "
            f"{mm['max_bytes']} bytes"
        )
    if result.speculative is not None:
        sp = result.speculative
        print(
            f"speculative: {sp['accepted_tokens']} of {sp['proposed_tokens']} draft tokens accepted "
            f"({sp['acceptance_rate']:.1%}), {sp['accept_length']:.2f} tokens per target step"
        )
    if result.disaggregation is not None:
        from kvjax.cli.disaggregation_run import disaggregation_line

        print(disaggregation_line(result.disaggregation))
    return failed_requests("generate", result.disaggregation)


def _check_across_processes(args: argparse.Namespace) -> None:
    """A `UsageError` for what several processes do not serve yet (before jax starts)."""
    refused = [
        *([f"--image {args.image[0]}"] if args.image else []),
        *([f"--pp {args.pp}"] if args.pp > 1 else []),
    ]
    if refused:
        raise UsageError(
            f"{refused[0]} across processes: several processes serve generate with --tp, --dp, --dcp and "
            "speculative decoding only for now; "
            f"drop {refused[0].split()[0]}, or serve it in one process"
        )


def _print_status(group: Any, outputs: list[list[int]]) -> None:
    """A process other than 0: one line on standard error (process 0 prints the outputs)."""
    digest = hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]
    print(
        f"python -m kvjax generate: process {group.process_id} of {group.num_processes} served {len(outputs)} "
        f"prompt(s) in step with process 0: {sum(map(len, outputs))} tokens generated, outputs sha256 {digest} "
        "(process 0 prints them)",
        file=sys.stderr,
    )


def _image_options(args: argparse.Namespace, model_type: str) -> dict[str, Any]:
    """``generate``'s image arguments from ``--image``: the checkpoint's vision settings checked
    (a tower kvjax does not serve is refused), every file read and preprocessed as its
    ``preprocessor_config.json`` says, then the encoder's weights loaded. `ConfigError` naming the
    model or the file; nothing of the cache is built before."""
    if model_type != "llava":
        raise ConfigError(
            "image", args.image[0], f"{args.model} ({model_type}) takes no images; give a LLaVA checkpoint directory"
        )
    from kvjax.serve.checkpoint import read_config
    from kvjax.serve.families.llava import LlavaSettings
    from kvjax.serve.image_encoder import load_image_encoder
    from kvjax.serve.image_files import ImagePreprocessing, read_image

    _, raw = read_config(args.model, servable=False)
    settings = LlavaSettings.from_config(raw)
    preprocessing = ImagePreprocessing.from_directory(args.model, settings.vision.image_size)
    pixels = [read_image(path, preprocessing) for path in args.image]
    return dict(
        images=pixels,
        image_encoder=load_image_encoder(args.model, dtype=args.dtype),
        image_preprocessing=preprocessing.settings(),
    )


def _cache_salts(salts: list[str] | None, prompts: int) -> list[str | None] | None:
    """Each prompt's ``--cache-salt``: one for all, one per prompt, or none (`UsageError` for
    another count or an empty salt)."""
    if not salts:
        return None
    if any(not salt for salt in salts):
        raise UsageError("--cache-salt '' is empty; give the tenant's name, e.g. --cache-salt tenant-a")
    each: list[str | None] = list(salts)
    if len(each) == 1:
        return each * prompts
    if len(each) != prompts:
        raise UsageError(
            f"--cache-salt is given {len(each)} times for {prompts} prompts; give it once (every prompt) or once "
            "per prompt"
        )
    return each


def _each_prompt(values: list[Any] | None, prompts: int, flag: str) -> list[Any] | None:
    """A flag given once for every prompt or once per prompt, as one value per prompt (None when
    not given; `UsageError` naming ``flag`` for another count)."""
    if not values:
        return None
    if len(values) == 1:
        return values * prompts
    if len(values) != prompts:
        raise UsageError(
            f"{flag} is given {len(values)} times for {prompts} prompts; give it once (every prompt) or once per prompt"
        )
    return list(values)


def _seconds(text: str) -> float:
    """``--retention-seconds``: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds >= 0")
    return value


def _check_room(args: argparse.Namespace, context_length: int, longest_prompt: int) -> None:
    """The longest request (prompt and new tokens) fits the model's context, and the pool when
    ``--max-total-tokens`` sizes it."""
    longest = longest_prompt + args.max_new_tokens
    if longest > context_length:
        raise ConfigError(
            "max_new_tokens",
            args.max_new_tokens,
            f"the longest prompt plus {args.max_new_tokens} new tokens is {longest} tokens, more than the model's "
            f"context of {context_length}; shorten it",
        )
    need = -(-longest // args.page_size) * args.page_size
    if args.max_total_tokens is not None and args.max_total_tokens < need:
        raise ConfigError(
            "max_total_tokens",
            args.max_total_tokens,
            f"the pool must hold the longest request, {longest} tokens with its output in pages of "
            f"{args.page_size}; use {{max_total_tokens}} {need} or more",
        )
