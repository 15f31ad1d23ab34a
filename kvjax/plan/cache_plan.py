"""`CachePlan`: the decided KV cache, as sub-records with SGLang's flat names on top.

A plan holds one record per planner stage (``kind``, ``target``, ``sizes``, ``tree``, ``host``) and
the pools to allocate. Every field of those records reads under its flat name too
(``plan.max_total_tokens``, ``plan.tree_cache_kind``, ...), and ``to_dict()`` keeps the flat keys.
Two pure questions a capacity planner asks: :meth:`CachePlan.requests_that_fit` and
:meth:`CachePlan.max_context_for`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvjax.layout.pool_plan import PoolPlan
from kvjax.plan.forwarded import Forwarded
from kvjax.plan.records import DraftModel, HostTier, ModelKind, Sizes, Target, TreeChoice
from kvjax.plan.tree_options import TreeOptions, tree_options

FLAT_FIELDS = (
    "model",
    "platform",
    "kv_cache_dtype",
    "storage_dtype",
    "is_hybrid_swa",
    "is_hybrid_ssm",
    "is_dsa",
    "is_mla",
    "kv_pool_kind",
    "sliding_window_size",
    "page_size",
    "alloc_page_size",
    "head_dim_padded",
    "num_kv_heads_per_rank",
    "num_kv_layers",
    "num_full_layers",
    "num_swa_layers",
    "num_recurrent_layers",
    "start_layer",
    "end_layer",
    "bytes_per_token",
    "kv_budget_bytes",
    "max_total_tokens",
    "num_pages",
    "full_tokens_per_layer",
    "swa_tokens_per_layer",
    "max_mamba_cache_size",
    "mamba_state_bytes_per_req",
    "max_running_requests",
    "context_length",
    "req_to_token_width",
    "need_sort",
    "disable_radix_cache",
    "chunked_prefill_size",
    "tree_cache_kind",
    "tree_components",
    "tree_page_size",
    "radix_eviction_policy",
    "is_eagle",
    "enable_kv_cache_events",
    "enable_metrics",
    "enable_session_radix_cache",
    "decode_retraction_backup",
    "hicache_ratio",
    "attach_host_tier",
    "host_pool_tokens",
    "draft_host_pools",
    "draft_bytes_per_token",
    "mm_embedding_cache_bytes",
    "hicache_write_policy",
    "hicache_mem_layout",
    "kv_head_replicas",
    "padding",
    "tp_size",
    "attn_tp_size",
    "dp_size",
)
"""The flat names of ``to_dict()``, in order (``pools``, ``warnings``, ``device_bytes`` and
``host_bytes`` follow)."""


@dataclass(frozen=True)
class CachePlan:
    """The decided KV cache. Token counts are per layer; bytes are per device (per TP/PP rank).

    Invariant: ``device_bytes <= kv_budget_bytes`` whenever a budget sized the plan (the trash
    page and the recurrent padding slot included).
    """

    model: str
    kind: ModelKind
    target: Target
    sizes: Sizes
    tree: TreeChoice
    host: HostTier
    pools: tuple[PoolPlan, ...]
    warnings: tuple[str, ...] = field(default=())
    draft: DraftModel | None = None  # the speculative draft model (kvjax.plan.draft), None without one

    # --- the flat names (SGLang's and kvjax's first release) ------------------------------------

    # --- target ---
    platform = Forwarded[str]("target")
    kv_cache_dtype = Forwarded[str]("target")
    storage_dtype = Forwarded[str]("target")
    head_dim_padded = Forwarded[int]("target")
    num_kv_heads_per_rank = Forwarded[int]("target")
    # --- kind ---
    is_hybrid_swa = Forwarded[bool]("kind")
    is_hybrid_ssm = Forwarded[bool]("kind")
    is_dsa = Forwarded[bool]("kind")
    is_mla = Forwarded[bool]("kind")
    kv_pool_kind = Forwarded[str]("kind")
    sliding_window_size = Forwarded[int | None]("kind")
    # --- sizes ---
    page_size = Forwarded[int]("sizes")
    alloc_page_size = Forwarded[int]("sizes")
    bytes_per_token = Forwarded[int]("sizes")
    kv_budget_bytes = Forwarded[int | None]("sizes")
    max_total_tokens = Forwarded[int]("sizes")
    num_pages = Forwarded[int]("sizes")
    full_tokens_per_layer = Forwarded[int | None]("sizes")
    swa_tokens_per_layer = Forwarded[int | None]("sizes")
    max_mamba_cache_size = Forwarded[int | None]("sizes")
    mamba_state_bytes_per_req = Forwarded[int]("sizes")
    max_running_requests = Forwarded[int]("sizes")
    context_length = Forwarded[int]("sizes")
    req_to_token_width = Forwarded[int]("sizes")
    need_sort = Forwarded[bool]("sizes")
    # --- tree ---
    disable_radix_cache = Forwarded[bool]("tree")
    chunked_prefill_size = Forwarded[int | None]("tree")
    tree_cache_kind = Forwarded[str]("tree")
    tree_components = Forwarded[tuple[str, ...]]("tree")
    tree_page_size = Forwarded[int]("tree")
    enable_mamba_extra_buffer = Forwarded[bool]("tree")
    mamba_max_states_per_path = Forwarded[int]("tree")
    radix_eviction_policy = Forwarded[str]("tree")
    is_eagle = Forwarded[bool]("tree")
    enable_kv_cache_events = Forwarded[bool]("tree")
    enable_metrics = Forwarded[bool]("tree")
    enable_session_radix_cache = Forwarded[bool]("tree")

    @property
    def tree_options(self) -> TreeOptions:
        """The typed record the tree cache is built from (``kvjax.radix.create_tree_cache``)."""
        return tree_options(self.kind, self.tree, self.host)

    # --- host ---
    decode_retraction_backup = Forwarded[str]("host")
    decode_retraction_active = Forwarded[bool](
        "host",
        "Whether retracted requests are backed up (``decode_retraction_backup``) at all.",
    )
    hicache_ratio = Forwarded[float]("host")
    attach_host_tier = Forwarded[bool]("host")
    host_pool_tokens = Forwarded[int]("host")
    draft_host_pools = Forwarded[bool]("host")
    draft_bytes_per_token = Forwarded[int](
        "sizes",
        "Bytes of one token in the draft model's pool ``kv_draft`` (0 without one); the budget "
        "pays for them with ``bytes_per_token``.",
    )
    mm_embedding_cache_bytes = Forwarded[int]("host")
    hicache_write_policy = Forwarded[str]("host")
    hicache_mem_layout = Forwarded[str]("host")
    kv_head_replicas = Forwarded[int](
        "target",
        "Ranks holding a copy of each KV head (> 1 when the TP size exceeds the KV heads).",
    )
    tp_size = Forwarded[int]("target", "Tensor-parallel ranks in all (chips of one model replica per stage).")
    attn_tp_size = Forwarded[int](
        "target", "Attention-TP ranks: ``tp_size / dp_size`` under DP attention, else ``tp_size``."
    )
    dp_size = Forwarded[int]("target", "DP-attention ranks, each with its own pools (1 without DP attention).")
    padding = Forwarded[tuple[str, ...]](
        "target",
        "What the layout pads on this platform, in words (``head_dim 64 -> 128 (TPU lane width)``).",
    )

    # --- stage layers ---
    @property
    def num_full_layers(self) -> int:
        """Full-attention and MLA layers of this pipeline stage."""
        return len(self.sizes.stage.full)

    @property
    def num_swa_layers(self) -> int:
        return len(self.sizes.stage.swa)

    @property
    def num_kv_layers(self) -> int:
        return self.sizes.stage.kv_layers

    @property
    def num_recurrent_layers(self) -> int:
        return len(self.sizes.stage.recurrent)

    @property
    def start_layer(self) -> int:
        return self.sizes.stage.start

    @property
    def end_layer(self) -> int:
        return self.sizes.stage.end

    # --- totals -----------------------------------------------------------------------------------

    @property
    def device_bytes(self) -> int:
        """Bytes of all device buffers in the plan (per device)."""
        return sum(p.nbytes for p in self.pools if p.memory == "device")

    @property
    def host_bytes(self) -> int:
        """Bytes of all host buffers in the plan (request table, host KV tier)."""
        return sum(p.nbytes for p in self.pools if p.memory == "host")

    def pool(self, name: str) -> PoolPlan:
        """The planned buffer called ``name`` (``KeyError`` naming the choices otherwise)."""
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"no pool {name!r} in this plan; pools: {[p.name for p in self.pools]}")

    # --- capacity questions -------------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.alloc_page_size)

    def requests_that_fit(self, tokens_per_request: int) -> int:
        """How many requests of ``tokens_per_request`` tokens (prompt + output) can run at once.

        The minimum of: request rows (``max_running_requests``); full-attention pages over the
        pages one request needs (``ceil(tokens / page)``, no prefix shared); for hybrid SWA, SWA
        pages over the pages one request's window needs (``min(ceil(tokens / page),
        ceil(window / page) + 1)``: the window plus the page being filled). 0 when the request is
        longer than ``context_length``. Recurrent-state slots already cap the rows.
        """
        _check_positive("tokens_per_request", tokens_per_request)
        if tokens_per_request > self.context_length:
            return 0
        limits = [self.max_running_requests]
        need = self._pages(tokens_per_request)
        ps = self.alloc_page_size
        if self.swa_tokens_per_layer is not None:  # the sliding-window split
            if self.full_tokens_per_layer:
                limits.append(self.full_tokens_per_layer // ps // need)
            window = self.sliding_window_size or tokens_per_request
            limits.append((self.swa_tokens_per_layer or 0) // ps // min(need, self._pages(window) + 1))
        else:
            limits.append(self.num_pages // need)
        return max(0, min(limits))

    def max_context_for(self, num_requests: int) -> int:
        """The longest request (tokens) of which ``num_requests`` fit at once; 0 when not even
        ``num_requests`` one-token requests fit. At most ``context_length``. The largest ``t`` with
        ``requests_that_fit(t) >= num_requests`` (that count never grows with ``t``)."""
        _check_positive("num_requests", num_requests)
        if self.requests_that_fit(1) < num_requests:
            return 0
        lo, hi = 1, self.context_length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.requests_that_fit(mid) >= num_requests:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # --- output -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every flat field, the pools, the warnings and the byte totals."""
        d: dict[str, Any] = {name: getattr(self, name) for name in FLAT_FIELDS}
        d["tree_components"] = list(self.tree_components)
        d["padding"] = list(self.padding)
        d["pools"] = [p.to_dict() for p in self.pools]
        d["warnings"] = list(self.warnings)
        d["device_bytes"] = self.device_bytes
        d["host_bytes"] = self.host_bytes
        return d

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        """The human-readable form (what ``python -m kvjax plan`` prints): a short header of
        decisions, then one row per pool, then the warnings."""
        return _render(self)


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}: use a positive integer")


def fmt_bytes(n: int | None) -> str:
    """``"16.00 GiB"``, ``"512.00 MiB"``, ``"12 B"``; ``"-"`` for None."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _render(plan: CachePlan) -> str:
    """A short header of decisions, then one row per pool, then the warnings."""
    lines = [
        f"KV cache plan for {plan.model} (planned for {plan.platform}; {plan.kv_cache_dtype} stored as "
        f"{plan.storage_dtype})",
        f"  tokens: {plan.max_total_tokens:,} ({plan.num_pages:,} pages of {plan.alloc_page_size}), "
        f"{plan.bytes_per_token:,} bytes/token"
        + (f" (+ {plan.draft_bytes_per_token:,} for the draft model)" if plan.draft_bytes_per_token else "")
        + f", budget {fmt_bytes(plan.kv_budget_bytes)}",
        f"  kind: pool={plan.kv_pool_kind} hybrid_swa={plan.is_hybrid_swa} hybrid_ssm={plan.is_hybrid_ssm} "
        f"dsa={plan.is_dsa} window={plan.sliding_window_size}",
        f"  heads per rank: {plan.num_kv_heads_per_rank} (x{plan.kv_head_replicas} replicas), "
        f"head dim {plan.head_dim_padded}",
    ]
    target = plan.target
    dcp = plan.alloc_page_size // plan.sizes.page_size
    group = target.attn_tp_size * dcp  # a DP rank's attention TP group (DCP divides it)
    if target.tp_size > 1:
        dp = f"dp {target.dp_size} x attention tp {group}" if target.dp_size > 1 else "attention tp"
        lines.append(
            f"  parallel: tp {target.tp_size} ({dp}); tokens and bytes below are per device"
            + (", each DP rank with its own pools" if target.dp_size > 1 else "")
        )
    if dcp > 1:
        tp = f"attention tp {group}" if target.dp_size > 1 else f"tp {target.tp_size}"
        lines.append(
            f"  decode context parallel: {tp} (dcp {dcp}): KV over {target.attn_tp_size} head rank(s), "
            f"each request's KV striped over {dcp} ranks: "
            f"{plan.max_total_tokens // dcp:,} token rows per device (pages of {plan.sizes.page_size} rows); "
            "bytes below are per device"
        )
    for note in plan.padding:
        lines.append(f"  padding: {note}")
    if plan.swa_tokens_per_layer is not None:  # a kind split the tokens between two pools
        lines.append(
            f"  per layer: full={plan.full_tokens_per_layer or 0:,} tokens, "
            f"swa={plan.swa_tokens_per_layer or 0:,} tokens"
        )
    lines += [
        f"  requests: {plan.max_running_requests:,} rows x {plan.req_to_token_width:,} tokens "
        f"(context {plan.context_length:,})",
        f"  tree: {plan.tree_cache_kind} {list(plan.tree_components)} page={plan.tree_page_size} "
        f"policy={plan.radix_eviction_policy} radix_disabled={plan.disable_radix_cache} "
        f"chunked_prefill={plan.chunked_prefill_size}",
        f"  retraction backup: {plan.decode_retraction_backup}, hicache_ratio={plan.hicache_ratio}, "
        f"host tier={plan.attach_host_tier}, draft host pools={plan.draft_host_pools}",
        "",
        f"  {'pool':<14} {'kind':<14} {'where':<7} {'count':>5}  {'shape':<32} {'dtype':<14} "
        f"{'bytes/token':>11} {'bytes':>11}",
    ]
    for p in plan.pools:
        shape = "[" + ", ".join(f"{d:,}" for d in p.shape) + "]"
        per_token = f"{p.bytes_per_token:,}" if p.bytes_per_token else "-"
        mark = "" if p.built else "  (not built yet)"
        lines.append(
            f"  {p.name:<14} {p.kind:<14} {p.memory:<7} {p.count:>5}  {shape:<32} {p.dtype:<14} "
            f"{per_token:>11} {fmt_bytes(p.nbytes):>11}{mark}"
        )
    lines.append(
        f"  {'total device':<14} {'':<14} {'':<7} {'':>5}  {'':<32} {'':<14} {'':>11} "
        f"{fmt_bytes(plan.device_bytes):>11}"
    )
    for w in plan.warnings:
        lines.append(f"  warning: {w}")
    return "\n".join(lines)
