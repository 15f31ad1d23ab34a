"""The combination matrix: every pair of serving features, per cache kind, constructed (issue 35).

``construct(kind, a, b)`` builds what a user would build for the cache kind ``kind`` with the two
features ``a`` and ``b`` (``a == b``: that feature alone) through kvjax's own public paths, without
serving a request: first the command line's own jax-free flag checks (``python -m kvjax
generate``'s, for the features it has a flag for: ``kvjax.cli.serving_args``,
``kvjax.cli.multihost_flags``, ``kvjax.cli.disaggregation_flags`` and the command's check across
processes), then the cache and its scheduler as ``kvjax.serve.generate`` builds them (``CacheConfig``,
``build_kv_cache`` over ``tp_mesh``, ``scheduler_for`` / the speculative scheduler,
``build_pipeline_cache`` + ``pipeline_scheduler``, ``LockstepDPScheduler.build_lockstep`` over a
``("data", "tp")`` mesh), with small pools and nothing compiled. It returns `SERVED` or the
refusal (``"ExceptionType (stage): message"``). Several processes cannot be joined here: their cell is the
command line's check across processes and then the one-process construction (a multi-process run
builds the same scheduler over a mesh spanning the processes).

The curated table (``expected``): ``REFUSED`` lists every refused or dropped cell with its reason,
SGLang 0.5.23's own check (file and condition) or ``kvjax: not built yet`` (where no SGLang check
refusing it was found); ``PROOFS`` the served cells, each with the test that serves it end to end
(checked to exist); every other cell constructs, unproven. When a refusal is lifted, its cell moves
from ``REFUSED`` to ``PROOFS`` (with its test) or to neither. ``tests/mesh/test_combination_matrix.py``
computes every cell, fails on any that disagrees with the table, and checks ``docs/combinations.md``
is ``render()``; ``python -m tests.combinations --write`` regenerates it (8 CPU devices).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "combinations.md"
DEVICES = 8
SERVED = "served"

#: The cache kinds, each with the model constructed for it (a preset, or a tiny recurrent config
#: of ``tests.serve.random_workloads``).
KINDS: dict[str, str] = {
    "full": "tiny",
    "swa": "gemma3-tiny",
    "mla": "deepseek-tiny",
    "recurrent": "qwen3-next-tiny",
}
KIND_TITLES = {
    "full": "Full attention (`tiny`)",
    "swa": "Sliding window, interleaved with full attention (`gemma3-tiny`)",
    "mla": "MLA (`deepseek-tiny`)",
    "recurrent": "Recurrent state with full attention (Qwen3-Next, tiny: `tests/serve/random_workloads.py`)",
}

#: The features, each as constructed: its settings and the command line's flags (when it has one).
FEATURES: dict[str, str] = {
    "tp": "tp 2 (`--tp 2`; `--tp 4` with DP attention)",
    "dp": "DP attention, 2 ranks (`--dp 2`)",
    "dcp": "DCP 2, dividing tp (`--tp 2 --dcp 2`; `--tp 4 --dcp 2` with tp)",
    "pp": "pp 2 (`--pp 2`)",
    "standalone": "STANDALONE draft (`--speculative-algorithm STANDALONE`; the target as its own draft, a "
    "full-attention `tiny` of its vocabulary for a recurrent target)",
    "eagle": "EAGLE (`--speculative-algorithm EAGLE`: the checkpoint's MTP layer drafts, DeepSeek's or Qwen3-Next's; "
    "a checkpoint directory with `num_nextn_predict_layers: 1` for MLA, `mtp_num_hidden_layers: 1` for the "
    "recurrent kind; for the full-attention kind an EAGLE head, `--speculative-draft-model-path` a "
    "`LlamaForCausalLMEagle` config of the target's shapes; the kind's own config for the others)",
    "host": "host tier (`--enable-hierarchical-cache`)",
    "storage": "storage tier (`hicache_storage_backend='memory'`, with the host tier; `demo`'s `--hicache-storage "
    "DIR`)",
    "retraction": "retraction backup (`disaggregation_decode_retraction_backup='cpu_tensor'`)",
    "overlap": "overlap scheduling (on unless `--disable-overlap-schedule`)",
    "processes": "several processes (`--num-processes 2`)",
}
SHORT = {
    "tp": "tp",
    "dp": "DP attn",
    "dcp": "DCP",
    "pp": "pp",
    "standalone": "STANDALONE",
    "eagle": "EAGLE",
    "host": "host tier",
    "storage": "storage",
    "retraction": "retraction",
    "overlap": "overlap",
    "processes": "processes",
}


#: Two values of one option (``speculative_algorithm``), not a pair of features.
ONE_FLAG = {"standalone", "eagle"}


def cells() -> list[tuple[str, str, str]]:
    """Every cell ``(kind, a, b)``: each feature alone (``a == b``) and every pair, in ``FEATURES`` order."""
    names = list(FEATURES)
    pairs = [(a, a) for a in names] + [pair for pair in itertools.combinations(names, 2) if set(pair) != ONE_FLAG]
    return [(kind, a, b) for kind in KINDS for a, b in pairs]


# --- construction -----------------------------------------------------------------------------------


@functools.cache
def _model(kind: str) -> Any:
    """The kind's ``LoadedModel`` (random weights, seed 0; cached)."""
    from kvjax.serve.checkpoint import LoadedModel
    from kvjax.serve.model_fingerprint import random_weights_fingerprint
    from tests.serve.random_workloads import model

    spec, config, params = model(KINDS[kind])
    return LoadedModel(
        name=KINDS[kind], spec=spec, config=config, params=params, fingerprint=random_weights_fingerprint(config, 0)
    )


#: The recurrent kind's model where a cell splits its state over 4 devices of one group (``--tp 4
#: --dcp 2``: the state's heads over all 4, ``kvjax.plan.kinds.recurrent``): ``qwen3-next-tiny`` with
#: 4 key heads, as its own 2 do not split over 4 (SGLang refuses that split too).
RECURRENT_4_HEADS: dict[str, Any] = dict(
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8
)


@functools.cache
def _four_heads_model(kind: str) -> Any:
    """``_model(kind)`` with ``RECURRENT_4_HEADS`` (the recurrent kind's), random weights, seed 0."""
    from kvjax.serve.checkpoint import LoadedModel
    from kvjax.serve.model import init_params
    from kvjax.serve.model_config import model_config_from_spec
    from kvjax.serve.model_fingerprint import random_weights_fingerprint
    from kvjax.spec import ModelSpec

    base = _model(kind)
    spec = ModelSpec.from_hf_config(dict(base.spec.extra, **RECURRENT_4_HEADS), name=f"{base.name}-4-heads")
    config = model_config_from_spec(spec)
    return LoadedModel(
        name=spec.name,
        spec=spec,
        config=config,
        params=init_params(config),
        fingerprint=random_weights_fingerprint(config, 0),
    )


@functools.cache
def _draft(kind: str) -> Any:
    """The STANDALONE draft: the target itself, or (a target with recurrent layers, whose draft
    must be of the pool's attention layers) the full-attention ``tiny`` with the target's vocabulary."""
    target = _model(kind)
    if not target.spec.recurrent_layer_ids():
        return target
    from kvjax.serve.checkpoint import LoadedModel
    from kvjax.serve.model import init_params
    from kvjax.serve.model_config import model_config_from_spec
    from kvjax.spec import ModelSpec

    spec = dataclasses.replace(ModelSpec.preset("tiny"), vocab_size=target.spec.vocab_size)
    config = model_config_from_spec(spec)
    return LoadedModel(name="tiny", spec=spec, config=config, params=init_params(config), fingerprint="draft")


@functools.cache
def _checkpoint_dir(kind: str, mtp: bool) -> str:
    """A directory holding the kind's ``config.json`` (what the command line's checks read of a
    checkpoint; no weights), with its one MTP layer when ``mtp`` (``_mtp_key``); removed when the
    process exits."""
    import atexit
    import json
    import shutil
    import tempfile

    spec = _model(kind).spec
    config = dict(spec.extra, torch_dtype=spec.dtype, **({_mtp_key(kind): 1} if mtp else {}))
    directory = tempfile.mkdtemp(prefix=f"kvjax-combinations-{kind}-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    Path(directory, "config.json").write_text(json.dumps(config))
    return directory


@functools.cache
def _draft_dir(kind: str) -> str:
    """The STANDALONE draft's directory for the command line: the kind's checkpoint (the target as
    its own draft), or ``_draft``'s ``config.json`` (removed when the process exits)."""
    import atexit
    import json
    import shutil
    import tempfile

    draft = _draft(kind)
    if draft is _model(kind):
        return _checkpoint_dir(kind, False)
    directory = tempfile.mkdtemp(prefix=f"kvjax-combinations-{kind}-draft-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    Path(directory, "config.json").write_text(json.dumps(dict(draft.spec.extra, vocab_size=draft.spec.vocab_size)))
    return directory


def _mtp(kind: str) -> bool:
    """Whether the kind's checkpoint carries an MTP layer (DeepSeek's or Qwen3-Next's, the EAGLE
    drafts kvjax reads)."""
    return _model(kind).spec.extra.get("model_type") in ("deepseek_v2", "deepseek_v3", "qwen3_next")


def _mtp_key(kind: str) -> str:
    """The config key that counts the kind's MTP layers (Qwen3-Next's ``mtp_num_hidden_layers``)."""
    return (
        "mtp_num_hidden_layers"
        if _model(kind).spec.extra.get("model_type") == "qwen3_next"
        else "num_nextn_predict_layers"
    )


def _head(kind: str) -> bool:
    """Whether the kind's EAGLE draft is an EAGLE head (``LlamaForCausalLMEagle``: a Llama target)."""
    from kvjax.serve.speculative.eagle_head import EAGLE_HEAD_FAMILIES

    return _model(kind).config.family in EAGLE_HEAD_FAMILIES and _model(kind).config.family_config is None


@functools.cache
def _head_dir(kind: str) -> str:
    """The EAGLE head's directory for the command line: the kind's ``config.json`` naming
    ``LlamaForCausalLMEagle`` with one layer (removed when the process exits)."""
    import atexit
    import json
    import shutil
    import tempfile

    spec = _model(kind).spec
    config = dict(spec.extra, torch_dtype=spec.dtype, architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1)
    directory = tempfile.mkdtemp(prefix=f"kvjax-combinations-{kind}-head-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    Path(directory, "config.json").write_text(json.dumps(config))
    return directory


@functools.cache
def _eagle(kind: str) -> tuple[Any, Any]:
    """``(target, draft)`` for EAGLE: the kind's model as the checkpoint with its MTP layer would
    load (``_mtp_key``: 1 where the family has one) and the MTP draft
    (``NextNDraftModel``, zero weights of ``nextn_param_shapes``: ``ConfigError`` for a family
    kvjax reads no MTP layer from)."""
    import jax
    import jax.numpy as jnp

    from kvjax.serve.checkpoint import LoadedModel
    from kvjax.serve.speculative.nextn import NextNDraftModel, nextn_param_shapes
    from kvjax.spec import ModelSpec

    model = _model(kind)
    extra = dict(model.spec.extra, **{_mtp_key(kind): 1}) if _mtp(kind) else dict(model.spec.extra)
    spec = dataclasses.replace(ModelSpec.from_hf_config(extra, name=model.spec.name), dtype=model.spec.dtype)
    target = LoadedModel(
        name=model.name, spec=spec, config=model.config, params=model.params, fingerprint=model.fingerprint
    )
    shapes = nextn_param_shapes(model.config)
    params = jax.tree_util.tree_map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shapes)
    if _head(kind):  # the EAGLE head's checkpoint, planned for EAGLE
        return target, NextNDraftModel(name=model.name, params=params, path=Path(_head_dir(kind)), algorithm="EAGLE")
    return target, NextNDraftModel(name=model.name, params=params, path=Path(_checkpoint_dir(kind, True)))


def _cli_argv(kind: str, features: set[str]) -> list[str]:
    """``python -m kvjax generate``'s arguments for the features it has a flag for, ``--model`` a
    directory of the kind's ``config.json`` (``_checkpoint_dir``)."""
    checkpoint = _checkpoint_dir(kind, "eagle" in features and _mtp(kind))
    argv = ["generate", "--model", checkpoint, "--prompt-ids", "1,2,3"]
    pairs = ({"tp", "dp"}, {"tp", "dcp"}, {"dp", "dcp"})
    tp = 4 if any(p <= features for p in pairs) else 2 if features & {"tp", "dp", "dcp"} else 1
    argv += ["--tp", str(tp)] if tp > 1 else []
    argv += ["--dp", "2"] if "dp" in features else []
    argv += ["--dcp", "2"] if "dcp" in features else []
    argv += ["--pp", "2"] if "pp" in features else []
    argv += ["--enable-hierarchical-cache"] if features & {"host", "storage"} else []
    if "standalone" in features:
        argv += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", _draft_dir(kind)]
    if "eagle" in features:  # the draft: the MTP layer of --model's checkpoint, or an EAGLE head
        argv += ["--speculative-algorithm", "EAGLE"]
        argv += ["--speculative-draft-model-path", _head_dir(kind)] if _head(kind) else []
    argv += [] if "overlap" in features else ["--disable-overlap-schedule"]
    if "processes" in features:
        argv += ["--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1"]
    return argv


def _cli_checks(kind: str, features: set[str]) -> None:
    """The jax-free checks ``generate`` makes before jax starts (``generate_command.run``'s order)."""
    from kvjax.cli import _parser, serving_args
    from kvjax.cli import generate_command as gen
    from kvjax.cli.combination_flags import check_combinations
    from kvjax.cli.disaggregation_flags import check_disaggregation
    from kvjax.cli.model_arg import model_spec
    from kvjax.cli.multihost_flags import joins_group

    args = _parser("generate").parse_args(_cli_argv(kind, features))
    check_disaggregation(
        args, command="generate", speculative=bool(args.speculative_algorithm), processes=joins_group(args)
    )
    spec = model_spec(args.model)
    serving_args.speculative_options(args, spec.vocab_size, spec.hidden_size)
    serving_args.dp_attention_config(args)
    if "storage" in features:  # demo's --hicache-storage DIR (generate has no flag for the storage tier)
        args.hicache_storage = "DIR"
    check_combinations(args, spec)
    if joins_group(args):
        gen._check_across_processes(args)


def _config(kind: str, features: set[str]) -> Any:
    from kvjax.config import CacheConfig

    model = _model(kind)
    options: dict[str, Any] = dict(
        page_size=4,
        max_total_tokens=256,
        max_running_requests=4,
        context_length=64,
        chunked_prefill_size=32,
    )
    if kind == "recurrent":  # a state per page boundary needs pages of one token (or the extra buffer)
        options.update(page_size=1, max_mamba_cache_size=8)
        if "dcp" in features:  # the striped page (page_size * dcp_size): the extra buffer, as generate sets it
            options.update(enable_mamba_extra_buffer=True, max_mamba_cache_size=10)
    if "dp" in features:
        options.update(dp_size=2, enable_dp_attention=True, tp_size=4 if "tp" in features else 2)
    elif "tp" in features:
        options.update(tp_size=2)
    if "dcp" in features:  # DCP divides the (DP rank's) TP group: tp 2 (4 with tp or dp), its KV striped over 2
        options.update(dcp_size=2, tp_size=4 if features & {"tp", "dp"} else 2)
    if "pp" in features:
        options.update(pp_size=2)
    if features & {"host", "storage"}:
        options.update(enable_hierarchical_cache=True, hicache_ratio=2.0)
    if "storage" in features:
        options.update(hicache_storage_backend="memory", hicache_storage_model_fingerprint=model.fingerprint)
    if "retraction" in features:
        options.update(disaggregation_decode_retraction_backup="cpu_tensor")
    # EAGLE: the cache of the MTP layer's draft, as generate builds it (speculative_algorithm NEXTN).
    eagle = "EAGLE" if _head(kind) else "NEXTN"  # an EAGLE head's cache plans one draft layer
    algorithm = "STANDALONE" if "standalone" in features else eagle if "eagle" in features else None
    if algorithm is not None:
        options.update(speculative_algorithm=algorithm, speculative_num_steps=3, speculative_num_draft_tokens=4)
    return CacheConfig(**options)


#: The stage of a refusal raised once the cache is allocated (not "before anything is allocated").
AFTER_BUILD = "the scheduler, after the cache was built"


def _construct(kind: str, features: set[str], stage: list[str]) -> list[Any]:
    """Build the cache and its scheduler as ``kvjax.serve.generate`` does (module docstring)."""
    import jax

    from kvjax.serve.generate import PP_MICRO_BATCHES, _rank_draft, scheduler_for

    stage[:] = ["the command line"]
    _cli_checks(kind, features)
    model, draft = _model(kind), _draft(kind) if "standalone" in features else None
    if kind == "recurrent" and {"tp", "dcp"} <= features:  # --tp 4 --dcp 2: the state's heads over 4
        model = _four_heads_model(kind)
    if "eagle" in features:  # resolve_draft: the MTP layer, read before the cache is built
        stage[:] = ["the draft model"]
        model, draft = _eagle(kind)
    stage[:] = ["CacheConfig"]
    config = _config(kind, features)
    stage[:] = ["the cache's build"]
    # Speculative rounds overlap too (kvjax.serve.speculative.overlap), under DP attention's lockstep
    # rounds as on one rank (kvjax.dp.speculative).
    overlap = "overlap" in features
    options: dict[str, Any] = dict(max_batch_size=2, chunked_prefill_size=config.chunked_prefill_size)
    if config.pp_size > 1 and not config.enable_dp_attention:
        from kvjax.serve.pipeline_cache import build_pipeline_cache
        from kvjax.serve.pipeline_stepping import pipeline_scheduler

        pipeline = build_pipeline_cache(model.spec, config)
        stage[:] = [AFTER_BUILD]
        if "eagle" in features:  # EAGLE over pipeline stages: the draft on the last stage, as generate builds it
            from kvjax.serve.pipeline_eagle import pipeline_eagle_scheduler

            assert draft is not None
            eagle_options = dict(micro_batches=PP_MICRO_BATCHES, overlap=overlap, **options)
            return [
                pipeline_eagle_scheduler(
                    model.config, pipeline, model.params, draft_params=draft.params, num_steps=3, **eagle_options
                )
            ]
        return [
            pipeline_scheduler(
                model.config, pipeline, model.params, micro_batches=PP_MICRO_BATCHES, overlap=overlap, **options
            )
        ]
    elif config.enable_dp_attention:
        from kvjax.dp.lockstep import LockstepDPScheduler
        from kvjax.mesh_check import make_serving_mesh

        devices = jax.local_devices()
        dp_mesh: Any = make_serving_mesh(
            config.tp_size, config.dp_size, True, devices=devices, dcp_size=config.dcp_size
        )
        if config.pp_size > 1:  # one ("data", "tp") mesh per stage (kvjax.dp.pipeline)
            from kvjax.dp.pipeline import dp_stage_meshes

            dp_mesh = dp_stage_meshes(config, devices)
        stage[:] = ["build_lockstep (the DP cache, then each rank's scheduler)"]
        # Every rank drafts: a STANDALONE draft with its spec, or the MTP layer (generate's draft).
        rank_draft = None if draft is None else _rank_draft(draft, 3)
        server = LockstepDPScheduler.build_lockstep(
            model.spec,
            config,
            model.params,
            dp_mesh,
            model_config=model.config,
            overlap=overlap,
            draft=rank_draft,
            **options,
        )
        return list(server.schedulers)
    else:
        from kvjax.build import build_kv_cache
        from kvjax.serve.tp_mesh import tp_mesh

        tp = tp_mesh(config.tp_size, config.dcp_size)
        # STANDALONE: the draft's own spec; the MTP layer's pool is planned from the target's.
        draft_spec = draft.spec if "standalone" in features and draft is not None else None
        cache = build_kv_cache(model.spec, config, mesh=tp, draft_spec=draft_spec)
        stage[:] = [AFTER_BUILD]
        return [scheduler_for(model, cache, draft=draft, num_steps=3, overlap=overlap, **options)]


def construct(kind: str, a: str, b: str) -> str:
    """`SERVED`, ``"dropped: ..."`` or the refusal as ``"ExceptionType (stage): message"``, the stage
    being where it was raised: the command line's checks, ``CacheConfig``, the cache's build (its
    checks run before anything is allocated), ``build_lockstep``, or the scheduler's construction
    once the cache was built (module docstring)."""
    from kvjax.cli.messages import UsageError
    from kvjax.errors import ConfigError

    features = {a, b}
    stage: list[str] = []  # where a refusal is raised
    try:
        schedulers = _construct(kind, features, stage)
    except (ConfigError, NotImplementedError, UsageError, ValueError) as e:
        return _without_directories(kind, f"{type(e).__name__} ({stage[0]}): {e}")
    return _dropped(features, schedulers) or SERVED


def _without_directories(kind: str, text: str) -> str:
    """``text`` with this run's checkpoint directories (temporary) written as ``DIR``."""
    for mtp in (False, True):
        text = text.replace(_checkpoint_dir(kind, mtp), "DIR")
    if _head(kind):
        text = text.replace(_head_dir(kind), "HEAD")
    return text.replace(_draft_dir(kind), "DRAFT")


def _dropped(features: set[str], schedulers: list[Any]) -> str | None:
    """``"dropped: ..."`` when a feature asked for is accepted but not in effect in what was built
    (the plan drops the host tier; no retraction backup is attached; overlap turned off)."""
    from kvjax.serve.retraction_extension import RetractionBackupExtension

    for scheduler in schedulers:
        plan = scheduler.cache.plan
        if features & {"host", "storage"} and not plan.attach_host_tier:
            return "dropped: the plan attaches no host tier"
        if "retraction" in features and not any(
            isinstance(ext, RetractionBackupExtension) for ext in scheduler.extensions
        ):
            return "dropped: no retraction backup is attached (retracted requests are recomputed)"
        if "overlap" in features and not scheduler.overlap:
            return "dropped: the scheduler runs without overlap"
        if "overlap" in features and features & ONE_FLAG and not getattr(scheduler.proposer, "chains", False):
            return "dropped: the speculative rounds run without overlap (each read before the next)"
    return None


# --- the curated table ------------------------------------------------------------------------------

#: A refusal kvjax shares with SGLang 0.5.23: its own check, file and condition (what it says).
SGL_PP_SPEC = (
    "sglang/srt/arg_groups/validation_hook.py (check_pipeline_parallel_compat, pp_size > 1): speculative_algorithm "
    'is not None and not (speculative_algorithm.upper() == "EAGLE" and not enable_multi_layer_eagle) ("Pipeline '
    'parallelism currently only supports EAGLE (non-multi-layer) speculative decoding")'
)
SGL_HICACHE_DCP_MHA = (
    "sglang/srt/arg_groups/hicache_hook.py (resolve_hicache_dcp_compatibility): dcp_size > 1 and "
    'enable_hierarchical_cache and not use_mla_backend(server_args) ("HiCache with --dcp-size > 1 is only '
    'supported for MLA models"; kvjax serves the host tier over DCP, and the storage tier over it for MLA only)'
)

#: What kvjax does not build yet, where no SGLang 0.5.23 check refuses it.
GAP = "kvjax: not built yet"
GAP_EAGLE = (
    f"{GAP}: an EAGLE draft model for this kind (kvjax drafts with a checkpoint's own MTP layer, DeepSeek's or "
    "Qwen3-Next's, or a Llama EAGLE head for a full-attention Llama)"
)
GAP_PROCESSES = f"{GAP}: across processes (one process serves it)"
GAP_SPEC_OVERLAP_RECURRENT = (
    f"{GAP}: speculative rounds of recurrent state overlapped (the state replay needs the accepted counts on the "
    "host; kvjax reads each round before launching the next)"
)
GAP_SWA_STORAGE = (
    f"{GAP}: the storage tier under the hybrid sliding-window tree with DP attention, pipeline stages or several "
    "processes (its sliding layers' pages are stored on one device or a TP mesh in one process)"
)
GAP_SWA_DRAFT_STORAGE = (
    f"{GAP}: the storage tier under the hybrid sliding-window tree with a draft model's host pool (its pages are not "
    "stored with the full side's)"
)
#: Qwen3-Next under DCP (tests/mesh/test_dcp_recurrent.py): KV striped, the state split by heads over the group.
DCP_RECURRENT = "tests/mesh/test_dcp_recurrent.py::"
GAP_RECURRENT_PP_HOST = f"{GAP}: the host copies of recurrent-state checkpoints over pipeline stages"
GAP_RECURRENT_DP_PP = f"{GAP}: DP attention's recurrent-state copies over pipeline stages"
#: Qwen3-Next over 2 stages (each holding recurrent layers), two micro-batches, overlap on.
PP_RECURRENT = "tests/mesh/test_pp_recurrent.py::test_qwen3_next_reuse_chunked_prefill_eviction_and_retraction"
GAP_RECURRENT_STORAGE = (
    f"{GAP}: the storage tier under the recurrent-state tree with DP attention (its checkpoints are stored on one "
    "device or a TP mesh in one process)"
)
GAP_RECURRENT_DRAFT_STORAGE = (
    f"{GAP}: the storage tier under the recurrent-state tree with a draft model's host pool (its pages are not "
    "stored with the KV pages)"
)
GAP_RECURRENT_HOST_PROCESSES = f"{GAP}: host copies of recurrent-state checkpoints over several processes"


@dataclasses.dataclass(frozen=True)
class Cell:
    """A cell's expected status: served (``proof``: the test ``path::name`` that serves it end to
    end; None: it constructs, unproven), refused (``reason``: SGLang's check or a kvjax gap), or
    ``dropped`` (accepted, but the feature is not in effect; ``reason`` as for a refusal)."""

    proof: str | None = None
    reason: str | None = None
    dropped: bool = False

    @property
    def outcome(self) -> str:
        """What ``construct`` must give: ``served``, ``refused`` or ``dropped``."""
        return "dropped" if self.dropped else "refused" if self.reason is not None else SERVED

    @property
    def status(self) -> str:
        """The documented status: served, constructs (unproven), refused/dropped as SGLang, a kvjax gap."""
        if self.reason is not None:
            verb = "dropped" if self.dropped else "refused"
            return f"{verb}, as in SGLang" if self.reason.startswith("sglang/") else f"{verb}: kvjax gap"
        return SERVED if self.proof is not None else "constructs, unproven"


def refused(reason: str) -> Cell:
    return Cell(reason=reason)


def dropped(reason: str) -> Cell:
    return Cell(reason=reason, dropped=True)


#: The served cells and the test serving each end to end (both features on; a pair of one
#: feature with itself is that feature alone).
#: The cpu_tensor retraction backup with the host tier at tp 2 (Llama and DeepSeek-V2, overlap on).
MATRIX_PAIRS_RETRACTION = "tests/mesh/test_matrix_pairs.py::test_tp2_cpu_tensor_retraction_backup_with_the_host_tier"
#: The same over DCP (Llama at tp 2 x dcp 2, DeepSeek-V2 at tp 4 x dcp 2).
#: Gemma 3's hybrid sliding-window pools striped over DCP ranks, with each feature.
SWA_DCP_TESTS = "tests/mesh/test_dcp_swa.py"
MATRIX_PAIRS_DCP_RETRACTION = (
    "tests/mesh/test_matrix_pairs.py::test_dcp2_cpu_tensor_retraction_backup_with_the_host_tier"
)
#: The cpu_tensor retraction backup at tp 2 over two processes (Llama and Gemma 3).
MATRIX_PAIRS_RETRACTION_PROCESSES = (
    "tests/mesh/test_matrix_pairs.py::test_cpu_tensor_retraction_backup_over_two_processes"
)
#: The cpu_tensor retraction backup with the target as its own STANDALONE draft (Llama, DeepSeek-V2, Gemma 3).
SPEC_RETRACTION_STANDALONE = (
    "tests/serve/test_speculative_retraction.py::test_retracted_requests_are_restored_with_the_drafts_pages"
)
#: The storage tier with the cpu_tensor retraction backup (Llama and DeepSeek-V2, overlap on).
MATRIX_PAIRS_STORAGE = (
    "tests/serve/test_matrix_pairs.py::test_storage_with_the_cpu_tensor_retraction_backup_under_overlap"
)
#: STANDALONE with the storage tier, the target as its own draft (Llama and DeepSeek-V2): every proposal
#: accepted after the prefixes come back from storage (a stored page holds the draft's layers too).
MATRIX_PAIRS_STANDALONE_STORAGE = (
    "tests/serve/test_matrix_pairs.py::test_standalone_target_as_its_own_draft_accepts_everything_after_storage_hits"
)

PROOFS: dict[tuple[str, str, str], str] = {
    # Full attention.
    ("full", "tp", "tp"): "tests/mesh/test_tp_parity.py::test_gqa_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "dp", "dp"): "tests/mesh/test_dp_lockstep.py::test_lockstep_dp2_serves_the_single_scheduler_tokens",
    ("full", "dcp", "dcp"): "tests/mesh/test_dcp_parity.py::test_llama_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "pp", "pp"): "tests/mesh/test_pp_parity.py::test_llama_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "standalone", "standalone"): (
        "tests/serve/test_speculative_parity.py::test_page_16_with_prefix_reuse_multi_turn_and_chunked_prefill"
    ),
    ("full", "host", "host"): (
        "tests/serve/test_host_tier_serving.py::test_host_tier_serves_evicted_prefixes_from_host_with_the_same_tokens"
    ),
    ("full", "storage", "storage"): (
        "tests/serve/test_storage_tier_serving.py::test_storage_serves_prefixes_evicted_from_device_and_host_with_cold_tokens"
    ),
    ("full", "retraction", "retraction"): (
        "tests/serve/test_retraction_cpu_tensor.py::test_decode_retraction_restores_cpu_tensor_copies_with_the_same_tokens"
    ),
    ("full", "overlap", "overlap"): (
        "tests/serve/test_overlap.py::test_retraction_and_eviction_under_overlap_give_the_same_tokens"
    ),
    # A tiny preset as its own draft at tp 4 over two processes (tiny, gemma3-tiny, deepseek-tiny).
    **dict.fromkeys(
        [("full", "standalone", "processes"), ("swa", "standalone", "processes"), ("mla", "standalone", "processes")],
        "tests/mesh/test_multihost_speculative.py::"
        "test_standalone_over_two_processes_accepts_every_proposal_of_the_model_as_its_own_draft",
    ),
    ("mla", "eagle", "processes"): (
        "tests/mesh/test_multihost_speculative.py::test_eagle_over_two_processes_gives_transformers_tokens"
    ),
    ("recurrent", "standalone", "standalone"): (
        "tests/serve/test_speculative_recurrent.py::"
        "test_rejected_drafts_roll_the_state_back_with_reuse_multi_turn_and_chunked_prefill"
    ),
    ("full", "processes", "processes"): (
        "tests/mesh/test_multihost_serving.py::test_demo_at_tp_8_over_two_processes_gives_the_single_process_tokens"
    ),
    ("full", "tp", "dp"): "tests/mesh/test_dp_parity.py::test_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "eagle", "eagle"): (
        "tests/serve/test_eagle_head.py::test_reuse_chunked_prefill_eviction_retraction_and_the_heads_own_proposals"
    ),
    # STANDALONE under DP attention: SGLang 0.5.23 refuses it (speculative_hook.py, _handle_eagle_family:
    # "Currently standalone speculative decoding does not support dp attention."); kvjax serves it.
    ("full", "dp", "standalone"): (
        "tests/mesh/test_dp_speculative.py::test_standalone_reuse_chunked_eviction_retraction_and_rollback"
    ),
    ("full", "tp", "dcp"): "tests/mesh/test_dcp_parity.py::test_llama_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "tp", "pp"): "tests/mesh/test_pp_parity.py::test_llama_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "dcp", "pp"): "tests/mesh/test_pp_dcp.py::test_striped_stages_reuse_chunk_evict_and_retract",
    ("full", "dp", "pp"): "tests/mesh/test_dp_pp.py::test_every_ranks_batch_through_both_stages",
    ("full", "dp", "eagle"): "tests/mesh/test_dp_speculative.py::test_llama_eagle_head_under_dp_attention",
    # DeepSeek-V2 as its own STANDALONE draft with the retraction backup, rounds chained (overlap on).
    ("mla", "standalone", "overlap"): (
        "tests/serve/test_speculative_retraction.py::test_retracted_requests_are_restored_with_the_drafts_pages"
    ),
    ("full", "dcp", "eagle"): "tests/mesh/test_dcp_speculative.py::test_llama_eagle_head_at_tp2_dcp2",
    ("full", "eagle", "storage"): (
        "tests/serve/test_matrix_pairs.py::test_eagle_with_the_storage_tier_hashes_bigram_pages"
    ),
    ("mla", "eagle", "storage"): (
        "tests/serve/test_matrix_pairs.py::test_eagle_with_the_storage_tier_hashes_bigram_pages"
    ),
    ("swa", "dp", "pp"): "tests/mesh/test_dp_pp.py::test_every_ranks_batch_through_both_stages",
    ("mla", "dp", "pp"): "tests/mesh/test_dp_pp.py::test_every_ranks_batch_through_both_stages",
    ("full", "tp", "standalone"): "tests/mesh/test_tp_speculative.py::test_tp2_page_16_reuse_multi_turn_chunked",
    ("full", "tp", "host"): "tests/mesh/test_tp_host_tier.py::test_llama_host_tier_loads_back_per_shard_pages",
    ("full", "pp", "host"): "tests/mesh/test_pp_host_tier.py::test_host_tier_loads_back_every_stage",
    ("full", "pp", "storage"): "tests/mesh/test_pp_tiers.py::test_llama_storage_tier_stores_every_stages_layers",
    ("full", "pp", "retraction"): (
        "tests/mesh/test_pp_tiers.py::test_llama_cpu_tensor_retraction_backup_restores_every_stage"
    ),
    ("full", "tp", "storage"): (
        "tests/mesh/test_tp_host_tier.py::test_storage_entries_per_rank_read_back_by_a_cold_server_of_the_same_tp"
    ),
    ("full", "tp", "overlap"): "tests/mesh/test_tp_parity.py::test_gqa_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "tp", "processes"): (
        "tests/mesh/test_multihost_parity.py::test_llama_at_tp_8_over_two_processes_matches_transformers"
    ),
    (
        "full",
        "dp",
        "overlap",
    ): "tests/mesh/test_dp_overlap.py::test_lockstep_overlap_serves_the_tokens_of_the_loop_without_it",
    ("full", "dp", "processes"): (
        "tests/mesh/test_multihost_dp.py::test_demo_at_dp_2_tp_4_over_two_processes_gives_the_single_process_tokens"
    ),
    ("full", "dp", "dcp"): "tests/mesh/test_dp_dcp.py::test_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "dp", "host"): "tests/mesh/test_dp_host_tier.py::test_llama_host_tier_loads_prefixes_back_on_both_ranks",
    (
        "full",
        "dp",
        "storage",
    ): "tests/mesh/test_dp_host_tier.py::test_llama_storage_tier_per_rank_read_back_by_a_cold_dp_server",
    ("full", "dp", "retraction"): "tests/mesh/test_dp_host_tier.py::test_llama_retraction_backups_per_rank",
    ("full", "dcp", "host"): (
        "tests/mesh/test_dcp_host_tier.py::test_llama_loads_back_striped_pages_from_the_host_with_transformers_tokens"
    ),
    ("full", "dcp", "standalone"): (
        "tests/mesh/test_dcp_speculative.py::test_llama_standalone_draft_at_tp2_dcp2_accepts_every_proposal"
    ),
    ("full", "dcp", "processes"): (
        "tests/mesh/test_multihost_dcp.py::test_generate_with_dcp_over_two_processes_gives_the_single_process_tokens"
    ),
    (
        "full",
        "dcp",
        "overlap",
    ): "tests/mesh/test_dcp_parity.py::test_llama_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "pp", "overlap"): "tests/mesh/test_pp_parity.py::test_llama_reuse_chunked_prefill_eviction_and_retraction",
    ("full", "standalone", "overlap"): (
        "tests/serve/test_speculative_overlap.py::test_standalone_page_16_equals_transformers_and_the_run_without_overlap"
    ),
    ("full", "eagle", "overlap"): (
        "tests/serve/test_speculative_overlap.py::test_llama_eagle_head_page_1_evicts_and_retracts"
    ),
    ("full", "standalone", "host"): (
        "tests/serve/test_speculative_parity.py::test_host_tier_loads_the_drafts_pages_with_the_targets"
    ),
    ("full", "host", "storage"): (
        "tests/serve/test_storage_tier_serving.py::test_storage_serves_prefixes_evicted_from_device_and_host_with_cold_tokens"
    ),
    ("full", "standalone", "storage"): MATRIX_PAIRS_STANDALONE_STORAGE,
    ("full", "host", "overlap"): "tests/serve/test_overlap.py::test_host_tier_under_overlap_gives_the_same_tokens",
    ("full", "host", "processes"): (
        "tests/mesh/test_multihost_host_tier.py::test_host_tier_with_a_delayed_process_gives_the_single_process_tokens"
    ),
    ("full", "storage", "overlap"): "tests/serve/test_random_workloads.py::test_random_workload",
    ("full", "storage", "processes"): (
        "tests/mesh/test_multihost_storage.py::test_storage_hits_and_prefetches_are_agreed_with_a_short_store_on_one_process"
    ),
    ("full", "retraction", "overlap"): (
        "tests/serve/test_parity_transformers.py::test_page_1_small_pool_restoring_retracted_requests_from_cpu_tensor_copies"
    ),
    ("full", "overlap", "processes"): (
        "tests/mesh/test_multihost_serving.py::test_demo_at_tp_8_over_two_processes_gives_the_single_process_tokens"
    ),
    # The cpu_tensor retraction backup with the host tier at tp 2 (Llama).
    **dict.fromkeys([("full", "tp", "retraction"), ("full", "host", "retraction")], MATRIX_PAIRS_RETRACTION),
    ("full", "storage", "retraction"): MATRIX_PAIRS_STORAGE,
    ("full", "dcp", "retraction"): MATRIX_PAIRS_DCP_RETRACTION,
    # The cpu_tensor retraction backup at tp 2 over two processes (each keeps its devices' blocks).
    ("full", "retraction", "processes"): MATRIX_PAIRS_RETRACTION_PROCESSES,
    # The cpu_tensor retraction backup with a draft: the draft's pages restored with the target's.
    ("full", "standalone", "retraction"): SPEC_RETRACTION_STANDALONE,
    ("full", "eagle", "retraction"): (
        "tests/serve/test_eagle_head.py::test_the_cpu_tensor_backup_restores_the_heads_pages_with_the_targets"
    ),
    # Llama's EAGLE head at tp 2 with the host tier.
    **dict.fromkeys(
        [("full", "tp", "eagle"), ("full", "eagle", "host")],
        "tests/mesh/test_matrix_pairs.py::test_llama_eagle_head_at_tp2_with_the_host_tier",
    ),
    # Sliding window (Gemma 3: sliding layers interleaved with full attention).
    # The cpu_tensor retraction backup: the full side and the window's sliding side restored.
    ("swa", "retraction", "retraction"): (
        "tests/serve/test_parity_gemma3.py::test_retracted_requests_are_restored_with_their_window"
    ),
    **dict.fromkeys(
        [("swa", "tp", "retraction"), ("swa", "host", "retraction"), ("swa", "retraction", "overlap")],
        MATRIX_PAIRS_RETRACTION,
    ),
    ("swa", "dp", "retraction"): (
        "tests/mesh/test_matrix_pairs.py::test_gemma3_cpu_tensor_retraction_backup_per_dp_rank"
    ),
    ("swa", "standalone", "retraction"): SPEC_RETRACTION_STANDALONE,
    ("swa", "retraction", "processes"): MATRIX_PAIRS_RETRACTION_PROCESSES,
    ("swa", "tp", "tp"): "tests/mesh/test_tp_parity.py::test_gemma3_sliding_window_pools",
    ("swa", "standalone", "standalone"): (
        "tests/serve/test_speculative_swa.py::test_the_target_as_its_own_draft_accepts_everything_and_warm_gives_the_cold_tokens"
    ),
    ("swa", "tp", "standalone"): (
        "tests/mesh/test_tp_speculative_swa.py::test_tp2_a_partly_agreeing_draft_evicts_retracts_and_rolls_back"
    ),
    ("swa", "pp", "pp"): "tests/mesh/test_pp_parity.py::test_gemma3_hybrid_sliding_window_over_stages",
    (
        "swa",
        "host",
        "host",
    ): "tests/serve/test_parity_gemma3.py::test_host_tier_loads_evicted_prefixes_back_with_the_last_window",
    ("swa", "overlap", "overlap"): "tests/serve/test_random_workloads.py::test_random_workload",
    ("swa", "processes", "processes"): (
        "tests/mesh/test_multihost_parity.py::test_gemma3_hybrid_swa_at_tp_4_over_two_processes_matches_transformers"
    ),
    ("swa", "tp", "dp"): "tests/mesh/test_dp_parity.py::test_gemma3_sliding_window_pools",
    ("swa", "dp", "standalone"): "tests/mesh/test_dp_speculative.py::test_standalone_sliding_window_pools",
    ("swa", "standalone", "overlap"): (
        "tests/serve/test_speculative_swa.py::test_overlap_chains_rounds_over_the_sliding_window_pools"
    ),
    ("swa", "standalone", "host"): (
        "tests/serve/test_speculative_swa_host_tier.py::test_the_target_as_its_own_draft_accepts_everything_after_load_backs"
    ),
    ("swa", "tp", "host"): "tests/mesh/test_tp_host_tier.py::test_gemma3_sliding_window_host_pools_at_tp_2",
    # Gemma 3's hybrid pools, both striped over DCP ranks (tests/mesh/test_dcp_swa.py).
    **dict.fromkeys(
        [("swa", "dcp", "dcp"), ("swa", "tp", "dcp"), ("swa", "dcp", "retraction"), ("swa", "dcp", "overlap")],
        f"{SWA_DCP_TESTS}::test_gemma3_hybrid_pools_striped_reuse_chunk_evict_window_free_and_retract",
    ),
    ("swa", "dp", "dcp"): f"{SWA_DCP_TESTS}::test_gemma3_dp_attention_ranks_each_stripe_both_pools",
    ("swa", "dcp", "pp"): f"{SWA_DCP_TESTS}::test_gemma3_pipeline_stages_each_stripe_their_pools",
    ("swa", "dcp", "standalone"): f"{SWA_DCP_TESTS}::test_gemma3_standalone_draft_rolls_back_on_striped_pools",
    ("swa", "dcp", "host"): f"{SWA_DCP_TESTS}::test_gemma3_host_tier_loads_striped_pages_of_both_pools_back",
    ("swa", "dcp", "processes"): (
        f"{SWA_DCP_TESTS}::test_generate_at_tp_2_dcp_2_and_over_two_processes_gives_the_single_device_tokens"
    ),
    # The storage tier under the sliding-window tree (with the host tier, overlap on): prefixes back
    # from storage with the sliding layers' pages of their last window (Gemma 3, gpt-oss).
    **dict.fromkeys(
        [("swa", "storage", "storage"), ("swa", "host", "storage"), ("swa", "storage", "overlap")],
        "tests/serve/test_swa_storage.py::test_prefixes_come_back_from_storage_with_their_last_window_and_transformers_tokens",
    ),
    ("swa", "storage", "retraction"): (
        "tests/serve/test_swa_storage.py::test_retracted_requests_restore_their_window_beside_the_storage_tier"
    ),
    ("swa", "tp", "storage"): (
        "tests/mesh/test_swa_storage_tp.py::test_gemma3_storage_tier_at_tp_2_stores_each_ranks_heads"
    ),
    ("swa", "pp", "host"): "tests/mesh/test_pp_host_tier.py::test_host_tier_loads_back_every_stage",
    # pp 4 with the cpu_tensor backup: every stage's sliding window pages and full pages restored.
    ("swa", "pp", "retraction"): "tests/mesh/test_pp_parity.py::test_gemma3_hybrid_sliding_window_over_stages",
    ("swa", "tp", "overlap"): "tests/mesh/test_tp_parity.py::test_gemma3_sliding_window_pools",
    ("swa", "tp", "processes"): (
        "tests/mesh/test_multihost_parity.py::test_gemma3_hybrid_swa_at_tp_4_over_two_processes_matches_transformers"
    ),
    ("swa", "dp", "overlap"): "tests/mesh/test_dp_parity.py::test_gemma3_sliding_window_pools",
    ("swa", "pp", "overlap"): "tests/mesh/test_pp_parity.py::test_gemma3_hybrid_sliding_window_over_stages",
    ("swa", "host", "overlap"): "tests/serve/test_random_workloads.py::test_random_workload",
    ("swa", "dp", "dp"): "tests/mesh/test_dp_parity.py::test_gemma3_sliding_window_pools",
    ("swa", "dp", "host"): "tests/mesh/test_dp_hybrid_host_tier.py::test_gemma3_sliding_window_host_pools_per_rank",
    ("swa", "host", "processes"): "tests/mesh/test_matrix_pairs.py::test_gemma3_host_tier_at_tp2_over_two_processes",
    ("swa", "tp", "pp"): "tests/mesh/test_matrix_pairs.py::test_over_two_pipeline_stages_at_tp2",
    ("swa", "overlap", "processes"): (
        "tests/mesh/test_multihost_parity.py::test_gemma3_hybrid_swa_at_tp_4_over_two_processes_matches_transformers"
    ),
    # MLA (DeepSeek-V2's latent pool).
    ("mla", "tp", "tp"): "tests/mesh/test_tp_parity.py::test_deepseek_v2_mla_latent_replicated_heads_split",
    (
        "mla",
        "eagle",
        "eagle",
    ): "tests/serve/test_speculative_eagle.py::test_page_16_with_prefix_reuse_multi_turn_and_chunked_prefill",
    ("mla", "dcp", "dcp"): "tests/mesh/test_dcp_parity.py::test_deepseek_v2_latent_striped_over_dcp_heads_over_tp",
    ("mla", "tp", "eagle"): "tests/mesh/test_tp_eagle.py::test_tp2_page_16_reuse_multi_turn_chunked",
    # EAGLE over pipeline stages: the draft on the last stage (kvjax.serve.pipeline_eagle).
    ("mla", "pp", "eagle"): "tests/mesh/test_pp_eagle.py::test_deepseek_nextn_over_stages",
    ("full", "pp", "eagle"): "tests/mesh/test_pp_eagle.py::test_llama_eagle_head_over_stages",
    ("recurrent", "pp", "eagle"): "tests/mesh/test_pp_eagle.py::test_qwen3_next_mtp_over_stages",
    ("mla", "eagle", "overlap"): (
        "tests/serve/test_speculative_overlap.py::test_eagle_page_16_equals_transformers_and_the_run_without_overlap"
    ),
    ("mla", "dp", "eagle"): "tests/mesh/test_dp_speculative.py::test_eagle_mtp_layer_page_1_evicts_and_retracts",
    ("mla", "eagle", "host"): (
        "tests/serve/test_eagle_host_tier.py::test_the_mtp_layers_pool_goes_to_the_host_and_back_with_the_targets"
    ),
    ("mla", "host", "host"): "tests/serve/test_random_workloads.py::test_random_workload_sweep",
    ("mla", "overlap", "overlap"): (
        "tests/serve/test_parity_deepseek_v2.py::test_page_1_with_a_pool_small_enough_to_evict_and_retract"
    ),
    ("mla", "tp", "dp"): "tests/mesh/test_dp_parity.py::test_reuse_chunked_prefill_eviction_and_retraction",
    ("mla", "dp", "standalone"): "tests/mesh/test_dp_speculative.py::test_standalone_mla_target_as_its_own_draft",
    ("mla", "tp", "dcp"): "tests/mesh/test_dcp_parity.py::test_deepseek_v2_latent_striped_over_dcp_heads_over_tp",
    ("mla", "tp", "overlap"): "tests/mesh/test_tp_parity.py::test_deepseek_v2_mla_latent_replicated_heads_split",
    ("mla", "dp", "overlap"): "tests/mesh/test_dp_parity.py::test_reuse_chunked_prefill_eviction_and_retraction",
    ("mla", "dp", "dcp"): "tests/mesh/test_dp_dcp.py::test_reuse_chunked_prefill_eviction_and_retraction",
    ("mla", "dcp", "overlap"): "tests/mesh/test_dcp_parity.py::test_deepseek_v2_latent_striped_over_dcp_heads_over_tp",
    ("mla", "dcp", "eagle"): "tests/mesh/test_dcp_speculative.py::test_deepseek_v2_mtp_layer_at_tp4_dcp2",
    ("mla", "host", "overlap"): "tests/serve/test_random_workloads.py::test_random_workload_sweep",
    ("mla", "dp", "dp"): "tests/mesh/test_dp_parity.py::test_reuse_chunked_prefill_eviction_and_retraction",
    ("mla", "standalone", "standalone"): (
        "tests/mesh/test_dp_speculative.py::test_standalone_mla_target_as_its_own_draft"
    ),
    # The cpu_tensor retraction backup with the host tier at tp 2, overlap on (DeepSeek-V2).
    **dict.fromkeys(
        [
            ("mla", "retraction", "retraction"),
            ("mla", "tp", "host"),
            ("mla", "tp", "retraction"),
            ("mla", "host", "retraction"),
            ("mla", "retraction", "overlap"),
        ],
        MATRIX_PAIRS_RETRACTION,
    ),
    # The storage tier behind the host tier with the cpu_tensor retraction backup, overlap on (DeepSeek-V2).
    **dict.fromkeys(
        [
            ("mla", "storage", "storage"),
            ("mla", "host", "storage"),
            ("mla", "storage", "retraction"),
            ("mla", "storage", "overlap"),
        ],
        MATRIX_PAIRS_STORAGE,
    ),
    ("mla", "tp", "storage"): "tests/mesh/test_matrix_pairs.py::test_deepseek_v2_storage_tier_at_tp2",
    **dict.fromkeys(
        [("mla", "pp", "pp"), ("mla", "tp", "pp"), ("mla", "pp", "overlap")],
        "tests/mesh/test_matrix_pairs.py::test_over_two_pipeline_stages_at_tp2",
    ),
    ("mla", "dcp", "pp"): "tests/mesh/test_pp_dcp.py::test_striped_stages_reuse_chunk_evict_and_retract",
    ("mla", "retraction", "processes"): MATRIX_PAIRS_RETRACTION_PROCESSES,
    ("mla", "dcp", "processes"): (
        "tests/mesh/test_multihost_dcp.py::test_mla_latent_striped_over_two_processes_gives_the_single_process_tokens"
    ),
    # DeepSeek-V2 at pp 2: every stage's cpu_tensor backup restored; evicted to the host, stored, read back cold.
    **dict.fromkeys(
        [("mla", "pp", "host"), ("mla", "pp", "storage"), ("mla", "pp", "retraction")],
        "tests/mesh/test_pp_tiers.py::test_deepseek_v2_cpu_tensor_backup_host_tier_and_storage_over_stages",
    ),
    ("mla", "dp", "storage"): (
        "tests/mesh/test_matrix_pairs.py::test_deepseek_v2_storage_tier_per_dp_rank_read_back_by_a_cold_server"
    ),
    # The cpu_tensor retraction backup with the host tier at tp 4 x dcp 2 (DeepSeek-V2).
    **dict.fromkeys([("mla", "dcp", "host"), ("mla", "dcp", "retraction")], MATRIX_PAIRS_DCP_RETRACTION),
    # The storage tier over DCP at tp 2 x dcp 2 (DeepSeek-V2): an entry is the striped page, every rank's rows.
    ("mla", "dcp", "storage"): (
        "tests/mesh/test_matrix_pairs.py::test_deepseek_v2_storage_tier_at_tp2_dcp2_stores_striped_pages"
    ),
    ("mla", "standalone", "storage"): MATRIX_PAIRS_STANDALONE_STORAGE,
    # DeepSeek-V2 as its own STANDALONE draft at tp 2 with the host tier.
    **dict.fromkeys(
        [("mla", "tp", "standalone"), ("mla", "standalone", "host")],
        "tests/mesh/test_matrix_pairs.py::test_deepseek_v2_standalone_at_tp2_with_the_host_tier",
    ),
    ("mla", "dp", "retraction"): (
        "tests/mesh/test_matrix_pairs.py::test_deepseek_v2_cpu_tensor_retraction_backup_per_dp_rank"
    ),
    # The cpu_tensor retraction backup with a draft: the draft's pages restored with the target's.
    ("mla", "standalone", "retraction"): SPEC_RETRACTION_STANDALONE,
    ("mla", "eagle", "retraction"): (
        "tests/serve/test_speculative_eagle.py::test_the_cpu_tensor_backup_restores_the_mtp_layers_pages_with_the_targets"
    ),
    # DeepSeek-V2 at tp 2 over two processes, overlap on.
    **dict.fromkeys(
        [("mla", "tp", "processes"), ("mla", "overlap", "processes")],
        "tests/mesh/test_matrix_pairs.py::test_deepseek_v2_at_tp2_over_two_processes",
    ),
    # DeepSeek-V3 (MLA, its MTP layer drafting): dp 2 x tp 4 over two processes with the host tier.
    **dict.fromkeys(
        [
            ("mla", "processes", "processes"),
            ("mla", "dp", "host"),
            ("mla", "dp", "processes"),
            ("mla", "host", "processes"),
        ],
        "tests/mesh/test_deepseek_v3_composition.py::"
        "test_dp_2_tp_4_over_two_processes_with_mtp_and_the_host_tier_under_pressure",
    ),
    # Recurrent state (Qwen3-Next: gated delta net layers and a full-attention layer).
    ("recurrent", "tp", "tp"): (
        "tests/mesh/test_tp_parity_qwen3_next.py::test_head_parallel_gated_delta_net_reuse_eviction_and_retraction"
    ),
    ("recurrent", "overlap", "overlap"): (
        "tests/serve/test_parity_qwen3_next.py::test_eviction_of_kv_and_checkpoints_and_retraction"
    ),
    ("recurrent", "tp", "dp"): "tests/mesh/test_dp_parity.py::test_qwen3_next_recurrent_state_per_rank",
    # Every state fork and checkpoint applied on every stage's state pool (pp 2 and pp 2 x tp 2; at
    # pp 2 x tp 2 retracted requests restored from every stage's cpu_tensor backup of pages and state).
    **dict.fromkeys(
        [
            ("recurrent", "pp", "pp"),
            ("recurrent", "tp", "pp"),
            ("recurrent", "pp", "overlap"),
            ("recurrent", "pp", "retraction"),
        ],
        PP_RECURRENT,
    ),
    ("recurrent", "eagle", "eagle"): (
        "tests/serve/test_qwen3_next_mtp.py::test_reuse_multi_turn_chunked_prefill_and_the_mtp_layers_own_proposals"
    ),
    ("recurrent", "host", "host"): (
        "tests/serve/test_recurrent_host_tier.py::test_qwen3_next_prefixes_and_checkpoints_come_back_from_the_host"
    ),
    ("recurrent", "standalone", "host"): (
        "tests/serve/test_speculative_recurrent_host_tier.py::"
        "test_the_drafts_pages_come_back_with_the_kv_and_acceptance_is_unchanged"
    ),
    ("recurrent", "eagle", "host"): (
        "tests/serve/test_speculative_recurrent_host_tier.py::test_the_mtp_layers_pages_come_back_with_the_kv"
    ),
    ("recurrent", "host", "overlap"): (
        "tests/serve/test_recurrent_host_tier.py::test_qwen3_next_retraction_and_evicted_checkpoints_with_the_host_tier"
    ),
    ("recurrent", "tp", "overlap"): (
        "tests/mesh/test_tp_parity_qwen3_next.py::test_head_parallel_gated_delta_net_reuse_eviction_and_retraction"
    ),
    ("recurrent", "dp", "overlap"): "tests/mesh/test_dp_parity.py::test_qwen3_next_recurrent_state_per_rank",
    ("recurrent", "tp", "processes"): (
        "tests/mesh/test_multihost_parity.py::"
        "test_qwen3_next_recurrent_state_at_tp_4_over_two_processes_matches_transformers"
    ),
    ("recurrent", "dp", "processes"): (
        "tests/mesh/test_multihost_dp_recurrent.py::test_qwen3_next_at_dp_2_tp_2_over_two_processes_matches_transformers"
    ),
    ("recurrent", "dp", "dp"): "tests/mesh/test_dp_parity.py::test_qwen3_next_recurrent_state_per_rank",
    # Each rank's KV pages and state rows restored from the cpu_tensor backup, within its slices.
    ("recurrent", "dp", "retraction"): "tests/mesh/test_dp_parity.py::test_qwen3_next_recurrent_state_per_rank",
    ("recurrent", "dp", "host"): (
        "tests/mesh/test_dp_hybrid_host_tier.py::test_qwen3_next_checkpoints_through_each_ranks_host"
    ),
    ("recurrent", "tp", "host"): "tests/mesh/test_matrix_pairs.py::test_qwen3_next_tp2_with_the_host_tier",
    # The cpu_tensor retraction backup copies the request's state slot with its KV pages and
    # restores it into its new slot (Qwen3-Next at page 1, overlap on; with the host tier; at tp 2).
    **dict.fromkeys(
        [("recurrent", "retraction", "retraction"), ("recurrent", "retraction", "overlap")],
        "tests/serve/test_recurrent_retraction.py::test_qwen3_next_retracted_requests_are_restored_with_their_state",
    ),
    ("recurrent", "host", "retraction"): (
        "tests/serve/test_recurrent_retraction.py::test_qwen3_next_restores_beside_the_host_tier"
    ),
    ("recurrent", "tp", "retraction"): (
        "tests/mesh/test_recurrent_retraction_tp.py::"
        "test_qwen3_next_tp2_restores_retracted_requests_state_beside_the_host_tier"
    ),
    ("recurrent", "standalone", "retraction"): (
        "tests/serve/test_recurrent_retraction.py::"
        "test_qwen3_next_with_a_standalone_draft_restores_the_state_and_the_drafts_pages"
    ),
    ("recurrent", "eagle", "retraction"): (
        "tests/serve/test_recurrent_retraction.py::test_qwen3_next_mtp_layer_restores_the_state_and_the_drafts_pages"
    ),
    # The storage tier under the recurrent-state tree (with the host tier, overlap on): prefixes back
    # from storage with the state after them (Qwen3-Next; at tp 2 every rank's share of the state).
    **dict.fromkeys(
        [("recurrent", "storage", "storage"), ("recurrent", "host", "storage"), ("recurrent", "storage", "overlap")],
        "tests/serve/test_recurrent_storage.py::test_prefixes_and_their_checkpoints_come_back_from_storage",
    ),
    ("recurrent", "storage", "retraction"): (
        "tests/serve/test_recurrent_storage.py::test_retracted_requests_restore_their_state_beside_the_storage_tier"
    ),
    ("recurrent", "tp", "storage"): (
        "tests/mesh/test_recurrent_storage_tp.py::test_qwen3_next_storage_tier_at_tp_2_brings_back_every_ranks_state"
    ),
    ("recurrent", "tp", "standalone"): (
        "tests/mesh/test_matrix_pairs.py::test_qwen3_next_standalone_at_tp2_evicts_retracts_and_replays"
    ),
    ("recurrent", "tp", "eagle"): (
        "tests/mesh/test_matrix_pairs.py::test_qwen3_next_mtp_layer_at_tp2_evicts_retracts_and_replays"
    ),
    # Speculative decoding of recurrent state under DP attention: each rank's rejected rounds
    # restored in its slice and replayed as a DP step of its batch (kvjax.dp.speculative).
    ("recurrent", "dp", "standalone"): (
        "tests/mesh/test_dp_speculative_recurrent.py::"
        "test_standalone_replays_each_ranks_rejected_rounds_through_reuse_and_eviction"
    ),
    ("recurrent", "dp", "eagle"): (
        "tests/mesh/test_dp_speculative_recurrent.py::test_eagle_mtp_layer_replays_each_ranks_rejected_rounds"
    ),
    # Qwen3-Next's MTP layer at dp 2 x tp 2 over two processes, both replaying alike.
    ("recurrent", "eagle", "processes"): (
        "tests/mesh/test_multihost_dp_speculative_recurrent.py::"
        "test_qwen3_next_mtp_at_dp_2_tp_2_over_two_processes_replays_alike"
    ),
    **dict.fromkeys(
        [("recurrent", "processes", "processes"), ("recurrent", "overlap", "processes")],
        "tests/mesh/test_multihost_dp_recurrent.py::test_qwen3_next_at_dp_2_tp_2_over_two_processes_matches_transformers",
    ),
    # Under DCP (the extra buffer's checkpoints on the striped page; at tp 2 x dcp 2 and tp 4 x dcp 2,
    # overlap on): reuse, chunked prefill, eviction and retraction against Transformers.
    **dict.fromkeys(
        [("recurrent", "dcp", "dcp"), ("recurrent", "tp", "dcp"), ("recurrent", "dcp", "overlap")],
        DCP_RECURRENT + "test_qwen3_next_reuse_chunked_prefill_eviction_and_retraction",
    ),
    **dict.fromkeys(
        [("recurrent", "dcp", "host"), ("recurrent", "dcp", "retraction")],
        DCP_RECURRENT + "test_cpu_tensor_retraction_backup_beside_the_host_tier",
    ),
    ("recurrent", "dcp", "pp"): DCP_RECURRENT + "test_over_two_pipeline_stages_with_two_micro_batches",
    ("recurrent", "dp", "dcp"): DCP_RECURRENT + "test_dp_attention_each_rank_a_dcp_group",
    # Rejecting rounds restored and replayed, the extra buffer recording only states within the kept tokens.
    ("recurrent", "dcp", "standalone"): DCP_RECURRENT
    + "test_standalone_draft_at_tp2_dcp2_replays_and_tracks_the_kept_tokens",
    ("recurrent", "dcp", "eagle"): DCP_RECURRENT + "test_mtp_layer_at_tp2_dcp2_replays_and_tracks_the_kept_tokens",
    ("recurrent", "dcp", "processes"): DCP_RECURRENT + "test_generate_at_tp4_dcp2_in_one_process_and_over_two",
}

#: The refused (and dropped) cells, each with its reason.
REFUSED: dict[tuple[str, str, str], Cell] = {
    ("full", "dcp", "storage"): refused(SGL_HICACHE_DCP_MHA),
    ("full", "pp", "standalone"): refused(SGL_PP_SPEC),
    ("full", "pp", "processes"): refused(GAP_PROCESSES),
    ("swa", "eagle", "eagle"): refused(GAP_EAGLE),
    ("swa", "tp", "eagle"): refused(GAP_EAGLE),
    ("swa", "dp", "eagle"): refused(GAP_EAGLE),
    ("swa", "dp", "storage"): refused(GAP_SWA_STORAGE),
    ("swa", "dcp", "eagle"): refused(GAP_EAGLE),
    ("swa", "dcp", "storage"): refused(SGL_HICACHE_DCP_MHA),
    ("swa", "pp", "standalone"): refused(SGL_PP_SPEC),
    ("swa", "pp", "eagle"): refused(GAP_EAGLE),
    ("swa", "pp", "storage"): refused(GAP_SWA_STORAGE),
    ("swa", "pp", "processes"): refused(GAP_PROCESSES),
    ("swa", "standalone", "storage"): refused(GAP_SWA_DRAFT_STORAGE),
    ("swa", "eagle", "host"): refused(GAP_EAGLE),
    ("swa", "eagle", "storage"): refused(GAP_EAGLE),
    ("swa", "eagle", "retraction"): refused(GAP_EAGLE),
    ("swa", "eagle", "overlap"): refused(GAP_EAGLE),
    ("swa", "eagle", "processes"): refused(GAP_EAGLE),
    ("swa", "storage", "processes"): refused(GAP_SWA_STORAGE),
    ("mla", "pp", "standalone"): refused(SGL_PP_SPEC),
    ("mla", "pp", "processes"): refused(GAP_PROCESSES),
    ("recurrent", "dp", "pp"): refused(GAP_RECURRENT_DP_PP),
    ("recurrent", "dp", "storage"): refused(GAP_RECURRENT_STORAGE),
    ("recurrent", "dcp", "storage"): refused(SGL_HICACHE_DCP_MHA),
    ("recurrent", "pp", "standalone"): refused(SGL_PP_SPEC),
    ("recurrent", "pp", "host"): refused(GAP_RECURRENT_PP_HOST),
    ("recurrent", "pp", "storage"): refused(GAP_RECURRENT_PP_HOST),
    ("recurrent", "pp", "processes"): refused(GAP_PROCESSES),
    ("recurrent", "standalone", "storage"): refused(GAP_RECURRENT_DRAFT_STORAGE),
    ("recurrent", "standalone", "overlap"): dropped(GAP_SPEC_OVERLAP_RECURRENT),
    ("recurrent", "eagle", "storage"): refused(GAP_RECURRENT_DRAFT_STORAGE),
    ("recurrent", "eagle", "overlap"): dropped(GAP_SPEC_OVERLAP_RECURRENT),
    ("recurrent", "host", "processes"): refused(GAP_RECURRENT_HOST_PROCESSES),
    ("recurrent", "storage", "processes"): refused(GAP_RECURRENT_HOST_PROCESSES),
}


def expected(kind: str, a: str, b: str) -> Cell:
    """The curated cell: refused or dropped (``REFUSED``), served (``PROOFS``), else constructs, unproven."""
    key = (kind, a, b)
    if key in REFUSED:
        return REFUSED[key]
    return Cell(proof=PROOFS.get(key))


def computed_outcome(result: str) -> str:
    """``construct``'s result as an outcome: ``served``, ``dropped`` or ``refused``."""
    return SERVED if result == SERVED else "dropped" if result.startswith("dropped:") else "refused"


# --- the document -------------------------------------------------------------------------------

SYMBOLS = {
    SERVED: "✓",
    "constructs, unproven": "○",
    "refused, as in SGLang": "S",
    "refused: kvjax gap": "✗",
    "dropped, as in SGLang": "s",
    "dropped: kvjax gap": "d",
}


def render(results: dict[tuple[str, str, str], str]) -> str:
    """``docs/combinations.md``: per cache kind a grid and every cell's evidence; ``results``:
    ``construct``'s result per cell (the refusals quoted)."""
    lines = [
        "# Combination matrix",
        "",
        "<!-- Generated: python -m tests.combinations --write (tests/mesh/test_combination_matrix.py checks it). -->",
        "",
        "Every pair of serving features, for each cache kind, as kvjax constructs it: the command line's",
        "own flag checks (`python -m kvjax generate`), then the cache and its scheduler as",
        "`kvjax.serve.generate` builds them (tiny pools, nothing compiled, no request served).",
        "`tests/mesh/test_combination_matrix.py` constructs every cell and fails when one disagrees with",
        "the curated table in `tests/combinations.py`, or when this page is not that table rendered.",
        "",
        "A cell is **served** (✓, with the test that serves it end to end), **constructs, unproven** (○:",
        "kvjax builds it, no test serves it yet), **refused** as SGLang 0.5.23 refuses it (S, its own check",
        "cited) or as a kvjax gap (✗: SGLang has no check refusing it), or **dropped** (d: accepted, but the",
        "feature is not in effect). Several processes are checked as the command line checks them, then",
        "constructed in one process (a run over processes builds the same scheduler over a wider mesh).",
        "The last column quotes kvjax's refusal and where it is raised: the command line's checks and",
        "the cache's build refuse before anything is allocated; a refusal from the scheduler comes after",
        "the cache was built. Every refusal a `generate` or `demo` command line can reach is the command",
        "line's own (`kvjax/cli/combination_flags.py` and the flag checks before it: one `error:` line",
        "naming both flags, before jax is imported); the library keeps the same checks for its callers.",
        "The retraction backup has no flag: its refusals stay the cache's build's.",
        "",
        "Features:",
        "",
    ]
    lines += [f"- **{SHORT[f]}**: {FEATURES[f]}" for f in FEATURES]
    lines += ["", "STANDALONE and EAGLE are two values of one option, not a pair.", ""]
    lines += [
        "EAGLE3 (`--speculative-algorithm EAGLE3`, a `LlamaForCausalLMEagle3` draft checkpoint) is not a column:",
        "it is served on one device for full-attention Llama and gpt-oss targets (`tests/serve/test_eagle3.py`) and",
        "refused with tp, DP attention and pp (not built yet) and with the storage tier (as EAGLE).",
        "",
    ]
    counts: dict[str, int] = {}
    for kind in KINDS:
        for c in [c for c in cells() if c[0] == kind]:
            status = expected(*c).status
            counts[status] = counts.get(status, 0) + 1
    lines += ["Totals over every kind: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", ""]
    names = list(FEATURES)
    for kind in KINDS:
        lines += [f"## {KIND_TITLES[kind]}", ""]
        lines += ["| | " + " | ".join(SHORT[f] for f in names) + " |", "|---" * (len(names) + 1) + "|"]
        for i, a in enumerate(names):
            row = []
            for j, b in enumerate(names):
                pair = (a, b) if i <= j else (b, a)
                if set(pair) == ONE_FLAG or j < i:
                    row.append("")
                else:
                    row.append(SYMBOLS[expected(kind, *pair).status])
            lines.append(f"| **{SHORT[a]}** | " + " | ".join(row) + " |")
        lines += ["", "| features | status | evidence | kvjax's refusal (where) |", "|---|---|---|---|"]
        for _, a, b in [c for c in cells() if c[0] == kind]:
            cell = expected(kind, a, b)
            what = SHORT[a] if a == b else f"{SHORT[a]} + {SHORT[b]}"
            evidence = f"`{cell.proof}`" if cell.proof else (_escape(cell.reason) if cell.reason else "")
            result = results[(kind, a, b)]
            said = "" if result == SERVED else _escape(result)
            lines.append(f"| {what} | {cell.status} | {evidence} | {said} |")
        lines.append("")
    return "\n".join(lines)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def compute() -> dict[tuple[str, str, str], str]:
    """``construct`` of every cell."""
    return {c: construct(*c) for c in cells()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.combinations", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"regenerate {DOC.relative_to(ROOT)}")
    parser.add_argument("--kind", choices=list(KINDS), action="append", help="only these kinds (print)")
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    if args.write:
        DOC.write_text(render(compute()) + "\n")
        print(f"wrote {DOC.relative_to(ROOT)}")
        return 0
    for kind, a, b in cells():
        if args.kind and kind not in args.kind:
            continue
        print(f"{kind}\t{a}\t{b}\t{construct(kind, a, b)}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
