"""The serving flags' combinations kvjax refuses, checked before jax is imported (issue 35's matrix,
``docs/combinations.md``).

``check_combinations(args, spec)`` runs in ``demo`` and ``generate`` after each flag's own checks
and raises one `UsageError` for the first refused pair: ``--flagA X with --flagB Y: why; what to
do``, the why being SGLang 0.5.23's reason and check (file: function) where SGLang refuses the pair
too, else ``not built in kvjax yet``. A refusal that depends on the model's cache kinds (the
sliding-window pair, recurrent state) names ``--model`` as the second flag. It reads the flags and
the model's ``config.json`` (its `ModelSpec`) only: nothing is loaded or allocated first.

The library keeps its own checks for callers of the API (``kvjax.plan.dcp``,
``kvjax.pipeline_check``, ``kvjax.plan.buildable``, ``kvjax.plan.draft``, the DP cache's build);
this module says the same refusals in the command line's words, early.
"""

from __future__ import annotations

import argparse

from kvjax.cli.messages import UsageError
from kvjax.cli.multihost_flags import joins_group
from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.mesh_check import check_dcp_sizes
from kvjax.plan.kinds import PlannerKind
from kvjax.plan.kinds.planning import kinds_for_model
from kvjax.spec import ModelSpec

__all__ = ["check_combinations"]

#: Where the flags of the fixes the library's kind refusals name come from (``{dcp_size}``).
_FLAGS = {"dcp_size": "--dcp", "pp_size": "--pp", "enable_hierarchical_cache": "--enable-hierarchical-cache"}
_GAP = "not built in kvjax yet"
#: What a cache kind's ``dcp_refusal`` says, in the command line's words (it names library options).
_DCP_WHY: dict[str, str] = {}
_SGL_PP_SPEC = (
    "refused, as in SGLang (validation_hook.py: check_pipeline_parallel_compat: pipeline parallelism supports "
    "EAGLE (non-multi-layer) speculative decoding only)"
)
_SGL_DCP_HICACHE = (
    "refused, as in SGLang for a model without MLA (hicache_hook.py: resolve_hicache_dcp_compatibility: HiCache "
    "with --dcp-size > 1 is only supported for MLA models; kvjax serves the host tier over DCP, the storage tier "
    "over DCP for MLA)"
)


def check_combinations(args: argparse.Namespace, spec: ModelSpec, *, model: str | None = None) -> None:
    """A `UsageError` for the first refused combination of ``args``' serving flags (module
    docstring); ``spec``: the target's (``--model``'s, or ``model``'s where ``--model`` is unset)."""
    if args.dp == 1:  # under DP attention: dp_attention_config's checks
        check_dcp_sizes(args.dcp, args.tp)  # a ConfigError naming --dcp and --tp
    model = getattr(args, "model", None) or model or spec.name
    kinds = kinds_for_model(spec, CacheConfig())
    dcp, pp = args.dcp, args.pp
    algorithm = args.speculative_algorithm
    storage = getattr(args, "hicache_storage", None)
    spec_flag = f"--speculative-algorithm {algorithm}"
    refusals: list[tuple[bool, str]] = [
        (
            pp > 1 and algorithm == "STANDALONE",
            f"--pp {pp} with {spec_flag}: {_SGL_PP_SPEC}; drop --pp or the speculative flags",
        ),
        (
            algorithm == "EAGLE3" and (args.tp > 1 or args.dp > 1),
            f"{spec_flag} with --tp {args.tp} --dp {args.dp}: the EAGLE3 draft over several devices is {_GAP}; "
            "serve it on one device (--tp 1 --dp 1)",
        ),
        (
            pp > 1 and algorithm == "EAGLE3",
            f"--pp {pp} with {spec_flag}: the EAGLE3 draft over pipeline stages is {_GAP}; drop --pp or the "
            "speculative flags",
        ),
        (
            pp > 1 and algorithm in ("EAGLE", "NEXTN") and args.dp > 1,
            f"--pp {pp} with {spec_flag} and --dp {args.dp}: the draft under DP attention over pipeline stages is "
            f"{_GAP}; drop one of them",
        ),
        (
            pp > 1 and algorithm in ("EAGLE", "NEXTN") and getattr(args, "enable_hierarchical_cache", False),
            f"--pp {pp} with {spec_flag} and --enable-hierarchical-cache: the host tier with a draft over pipeline "
            f"stages is {_GAP}; drop one of them",
        ),
        (
            dcp > 1 and storage is not None and all(k.splits_kv_heads for k in kinds),
            f"--dcp {dcp} with --hicache-storage {storage}: {_SGL_DCP_HICACHE}; drop --hicache-storage or --dcp",
        ),
        (
            dcp > 1 and storage is not None and joins_group(args),
            f"--dcp {dcp} with --hicache-storage {storage}: the storage tier over DCP across processes is {_GAP} (a "
            "process's host page holds its own devices' rows of a striped page); drop --num-processes, "
            "--hicache-storage or --dcp",
        ),
    ]
    for refused, line in refusals:
        if refused:
            raise UsageError(line)
    for kind in kinds:
        _check_kind(kind, model, args, storage)
    if algorithm == "STANDALONE" and args.speculative_draft_model_path:
        _check_draft_fits(args.speculative_draft_model_path, spec, model)


def _check_draft_fits(path: str, spec: ModelSpec, model: str) -> None:
    """The STANDALONE draft at ``path`` (its ``config.json`` or preset) fits the target's draft
    pool, as the plan decides (``kvjax.plan.draft``: its layers of the target pool's attention):
    a `UsageError` naming both flags, before a weight is read."""
    from kvjax.cli.model_arg import model_spec
    from kvjax.plan.draft import decide_draft
    from kvjax.plan.model_kind import decide_model_kind

    config = CacheConfig(speculative_algorithm="STANDALONE")
    try:
        draft, warnings = decide_draft(spec, config, decide_model_kind(spec, config), model_spec(path))
    except ConfigError as e:
        why = e.render_fix(_FLAGS)
        raise UsageError(f"--speculative-draft-model-path {path} with --model {model}: {why}") from None
    if draft is None and warnings:  # no draft pool planned for this target: the build refuses it
        why = warnings[0].removesuffix("; build_kv_cache refuses this configuration")
        raise UsageError(f"--speculative-draft-model-path {path} with --model {model}: {why}; {_GAP}")


def _check_kind(kind: PlannerKind, model: str, args: argparse.Namespace, storage: str | None) -> None:
    """The refusals of a cache kind the model needs (the sliding-window pair, recurrent state),
    each naming ``--model`` and the flag it is refused with."""
    algorithm = args.speculative_algorithm
    if args.dcp > 1 and kind.dcp_refusal is not None:
        why = _DCP_WHY.get(kind.name) or ConfigError("dcp_size", args.dcp, kind.dcp_refusal).render_fix(_FLAGS)
        raise UsageError(f"--dcp {args.dcp} with --model {model}: {why} is {_GAP}; drop --dcp")
    if args.pp > 1 and kind.name == "recurrent" and (args.enable_hierarchical_cache or args.dp > 1):
        other = "--enable-hierarchical-cache" if args.enable_hierarchical_cache else f"--dp {args.dp}"
        what = (
            "the host copies of its recurrent-state checkpoints over pipeline stages"
            if args.enable_hierarchical_cache
            else "DP attention's per-rank recurrent-state copies over pipeline stages"
        )
        raise UsageError(f"--pp {args.pp} with {other}: for --model {model}, {what} are {_GAP}; drop one of the two")
    if args.enable_hierarchical_cache and kind.no_host_copy is not None:
        raise UsageError(
            f"--enable-hierarchical-cache with --model {model}: host copies of its {kind.no_host_copy} are {_GAP}; "
            "drop --enable-hierarchical-cache"
        )
    if args.enable_hierarchical_cache and algorithm is not None and kind.draft_host_refusal is not None:
        raise UsageError(
            f"--enable-hierarchical-cache with --speculative-algorithm {algorithm}: for --model {model}, "
            f"{kind.draft_host_refusal.removesuffix(' is not built')} is {_GAP}; drop one of the two"
        )
    if storage is not None and kind.name == "swa" and (args.dp > 1 or args.pp > 1 or joins_group(args)):
        layout = f"--dp {args.dp}" if args.dp > 1 else f"--pp {args.pp}" if args.pp > 1 else "several processes"
        raise UsageError(
            f"--hicache-storage {storage} with --model {model}: the storage tier under the hybrid sliding-window "
            f"tree with {layout} is {_GAP} (its sliding layers' pages are stored on one device or a TP mesh in one "
            "process); drop --hicache-storage"
        )
    if args.enable_hierarchical_cache and kind.name == "recurrent" and joins_group(args):
        raise UsageError(
            f"--enable-hierarchical-cache across processes: for --model {model}, the host copies of recurrent-state "
            f"checkpoints over several processes are {_GAP} (each process would copy its own devices' shards); "
            "drop --enable-hierarchical-cache or serve in one process"
        )
    if storage is not None and kind.name == "recurrent" and (args.dp > 1 or joins_group(args)):
        layout = f"--dp {args.dp}" if args.dp > 1 else "several processes"
        raise UsageError(
            f"--hicache-storage {storage} with --model {model}: the storage tier under the recurrent-state tree with "
            f"{layout} is {_GAP} (its checkpoints are stored on one device or a TP mesh in one process); drop "
            "--hicache-storage"
        )
