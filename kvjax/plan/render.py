"""The human-readable form of a `CachePlan` (``str(plan)``, what ``python -m kvjax plan`` prints)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvjax.plan.cache_plan import CachePlan


def fmt_bytes(n: int | None) -> str:
    """``"16.00 GiB"``, ``"512.00 MiB"``, ``"12 B"``; ``"-"`` for None."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def render_plan(plan: CachePlan) -> str:
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
    if target.tp_size > 1:
        dp = f"dp {target.dp_size} x attention tp {target.attn_tp_size}" if target.dp_size > 1 else "attention tp"
        lines.append(
            f"  parallel: tp {target.tp_size} ({dp}); tokens and bytes below are per device"
            + (", each DP rank with its own pools" if target.dp_size > 1 else "")
        )
    dcp = plan.alloc_page_size // plan.sizes.page_size
    if dcp > 1:
        lines.append(
            f"  decode context parallel: dcp {dcp} x tp {target.tp_size}; each request's KV striped over {dcp} ranks: "
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
