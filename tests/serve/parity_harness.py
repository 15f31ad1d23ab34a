"""The shared harness of the Transformers parity tests (``test_parity_*.py``).

Each parity test builds a tiny random-weight checkpoint with Transformers (float32, fixed seed),
saves it with ``save_pretrained`` and loads it with kvjax (``load_checkpoint``), then serves, on one
cache, the two rounds of ``serve_two_rounds`` with chunked prefill of ``CHUNK`` tokens:

* round 1: three prompts sharing a 24-token system prompt (``a``, ``b``, ``c``) and the first turn
  of a chat (``chat1``);
* round 2: the chat's second turn (turn 1's prompt + its output + ``chat2_new``) and a prompt that
  shares the system prompt again (``d``).

Prompts are drawn from ``numpy.random.default_rng(PROMPT_SEED)`` (or a test's own seed) over
``VOCAB`` tokens (``prompts``). Each request is compared with Transformers' own greedy ``generate`` on the same
full prompt (``assert_matches_transformers``): the same tokens, logits within a tolerance, and the
near-tie guard: Transformers' top-1/top-2 logit margin is asserted to be at least ``10x`` the
tolerance at every compared step (``assert_no_near_tie``), so a token can only differ if the logits
really disagree, and a near-tie shows up as a clear failure, not a flaky one.
"""

from __future__ import annotations

import functools
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="parity tests need the 'parity' extra (torch, transformers)")
transformers = pytest.importorskip("transformers", reason="parity tests need the 'parity' extra (torch, transformers)")

from kvjax import CacheConfig, build_kv_cache  # noqa: E402
from kvjax.radix import MambaRadixCache  # noqa: E402
from kvjax.serve.checkpoint import LoadedModel, load_checkpoint  # noqa: E402
from kvjax.serve.scheduler import Scheduler, ServingReq  # noqa: E402
from tests.serve.random_workloads import TINY_SIZES  # noqa: E402

CHUNK = 8
PROMPT_SEED = 3
VOCAB = 128
CONTEXT_LENGTH = 124
MARGIN_FACTOR = 10  # the near-tie guard's margin, in multiples of the logit tolerance

# What every parity test's tiny Transformers config shares (each adds its family's own fields):
# weights drawn with ``initializer_range=0.2`` (logits of order 1, so greedy tokens are not all
# alike), no special tokens (greedy decoding never stops early).
TINY_CONFIG: dict[str, Any] = dict(
    TINY_SIZES,
    vocab_size=VOCAB,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


@functools.cache
def prompts(seed: int = PROMPT_SEED) -> dict[str, list[int]]:
    """The rounds' prompts by name (``chat2_new``: the tokens turn 2 adds after turn 1's output),
    drawn from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, VOCAB, n)]

    system = draw(24)
    return {
        "a": system + draw(6),
        "b": system + draw(9),
        "c": system + draw(5),
        "chat1": draw(18),
        "chat2_new": draw(7),
        "d": system + draw(11),
    }


def save_pretrained(hf: Any, tmp_path_factory: pytest.TempPathFactory, name: str, **save: Any) -> Path:
    """Save the Transformers model ``hf`` into a new temporary directory ``name`` (``save``: extra
    ``save_pretrained`` arguments); returns the directory (``load_checkpoint`` reads it)."""
    directory: Path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(directory, **save)
    return directory


def random_transformers_model(config: Any, seed: int = 0) -> Any:
    """Transformers' causal LM of ``config`` with float32 weights drawn after ``torch.manual_seed(seed)``,
    in eval mode."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def saved_transformers_model(
    config: Any, tmp_path_factory: pytest.TempPathFactory, name: str, *, seed: int = 0
) -> tuple[Any, Path]:
    """``(hf, directory)``: ``random_transformers_model(config, seed)`` and the new temporary
    directory ``name`` its checkpoint is saved into (for a program of its own to load)."""
    hf = random_transformers_model(config, seed)
    return hf, save_pretrained(hf, tmp_path_factory, name)


def tiny_checkpoint(
    config: Any, tmp_path_factory: pytest.TempPathFactory, name: str, *, seed: int = 0
) -> tuple[Any, LoadedModel]:
    """``(hf, model)``: ``random_transformers_model(config, seed)`` and kvjax's load of its checkpoint,
    saved into a new temporary directory ``name``."""
    hf, directory = saved_transformers_model(config, tmp_path_factory, name, seed=seed)
    return hf, load_checkpoint(directory)


def parity_cache_config(**fields: Any) -> CacheConfig:
    """The parity tests' ``CacheConfig``: context ``CONTEXT_LENGTH``, chunked prefill of ``CHUNK``,
    and ``fields`` (the other ``CacheConfig`` fields)."""
    return CacheConfig(context_length=CONTEXT_LENGTH, chunked_prefill_size=CHUNK, **fields)


def build_scheduler(
    model: LoadedModel, *, max_batch_size: int = 4, overlap: bool = True, mesh: Any = None, **cache_config: Any
) -> Scheduler:
    """A scheduler recording logits over a new cache of ``model`` (``parity_cache_config``: context
    ``CONTEXT_LENGTH``, chunked prefill of ``CHUNK``; ``overlap``: overlap scheduling, the
    scheduler's default; ``mesh``: the mesh the pools are sharded over, with ``tp_size`` in
    ``cache_config``; ``cache_config``: the other ``CacheConfig`` fields)."""
    cache = build_kv_cache(model.spec, parity_cache_config(**cache_config), mesh=mesh)
    return Scheduler(
        model.config,
        cache,
        model.params,
        max_batch_size=max_batch_size,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        overlap=overlap,
    )


def serve_two_rounds(sched: Scheduler, max_new: int, *, seed: int = PROMPT_SEED) -> dict[str, ServingReq]:
    """Run the two rounds of the module docstring (``max_new`` tokens each, the prompts of
    ``seed``) on ``sched``, assert the cache is leak free after them, and return the requests by
    name."""
    p = prompts(seed)
    done: dict[str, ServingReq] = {}
    first = [ServingReq(n, p[n], max_new_tokens=max_new) for n in ("a", "b", "c", "chat1")]
    sched.run(first)
    done.update((str(r.rid), r) for r in first)
    chat2 = p["chat1"] + done["chat1"].output_ids + p["chat2_new"]
    second = [ServingReq("chat2", chat2, max_new_tokens=max_new), ServingReq("d", p["d"], max_new_tokens=max_new)]
    sched.run(second)
    done.update((str(r.rid), r) for r in second)
    assert sched.leak_free()
    return done


def serve_with_eagle_draft(
    model: LoadedModel,
    draft_params: Any,
    algorithm: str,
    *,
    num_steps: int,
    page_size: int,
    max_total_tokens: int,
    max_new: int,
    scheduler_extra: dict[str, Any] | None = None,
    **config: Any,
) -> tuple[Scheduler, dict[str, ServingReq]]:
    """Serve ``serve_two_rounds`` (``max_new`` tokens each) with an EAGLE-style draft of one layer
    (``algorithm``: ``"EAGLE"`` for an MTP layer or an EAGLE head, ``"EAGLE3"``) proposing
    ``num_steps`` tokens a round, on a cache of ``page_size`` and ``max_total_tokens`` (``config``:
    more `CacheConfig` fields); ``scheduler_extra``: more ``eagle_scheduler`` arguments (EAGLE3's
    ``eagle3``). Checks the draft pool holds the draft's one layer, the cache is leak free and the
    tree sane after; returns the scheduler and the requests by name."""
    from kvjax.serve.speculative.eagle import eagle_scheduler

    cache = build_kv_cache(
        model.spec,
        CacheConfig(
            context_length=CONTEXT_LENGTH,
            chunked_prefill_size=CHUNK,
            page_size=page_size,
            max_total_tokens=max_total_tokens,
            max_running_requests=8,
            speculative_algorithm=algorithm,
            speculative_num_steps=num_steps,
            speculative_num_draft_tokens=num_steps + 1,
            **config,
        ),
    )
    assert cache.plan.draft is not None and cache.plan.draft.layer_ids == (0,)
    sched = eagle_scheduler(
        model.config,
        cache,
        model.params,
        draft_params=draft_params,
        num_steps=num_steps,
        max_batch_size=4,
        chunked_prefill_size=CHUNK,
        record_logits=True,
        **(scheduler_extra or {}),
    )
    done = serve_two_rounds(sched, max_new)  # asserts the cache is leak free
    sched.cache.tree_cache.sanity_check()
    return sched, done


def host_tier_scheduler(model: LoadedModel, **extra: Any) -> Scheduler:
    """``build_scheduler`` with the host tier (8x the device pool) over a device pool small enough
    (page size 1, 64 tokens, 8 running requests) that ``serve_batches_through_the_host`` evicts
    prefixes to the host; ``extra``: more ``build_scheduler`` arguments (a mesh and its sizes,
    ``max_batch_size``, a retraction backup)."""
    return build_scheduler(
        model,
        page_size=1,
        max_total_tokens=64,
        max_running_requests=8,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        **extra,
    )


def serve_batches_through_the_host(sched: Scheduler, max_new: int) -> dict[str, ServingReq]:
    """Serve the parity prompts in three batches (``a`` and ``chat1``, ``b`` and ``c``, ``d``; on a
    ``host_tier_scheduler`` each evicts the one before to the host), then the chat's second turn
    (its first turn's prefix then comes back from the host), ``max_new`` tokens each; return the
    requests by name."""
    p = prompts()
    done: dict[str, ServingReq] = {}
    for names in (("a", "chat1"), ("b", "c"), ("d",)):
        batch = [ServingReq(n, p[n], max_new_tokens=max_new) for n in names]
        sched.run(batch)
        done.update((str(r.rid), r) for r in batch)
    chat2 = ServingReq("chat2", p["chat1"] + done["chat1"].output_ids + p["chat2_new"], max_new_tokens=max_new)
    sched.run([chat2])
    done["chat2"] = chat2
    return done


def serve_recurrent(
    model: LoadedModel, max_new: int, *, overlap: bool = True, **cache_config: Any
) -> tuple[Scheduler, dict[str, ServingReq]]:
    """The two rounds on a recurrent-state cache, at page size 1 unless ``cache_config`` says, two
    sequences a batch (``overlap``: the scheduler's overlap scheduling); asserts no state slot
    leaked (the request table's and the tree's checkpoints) and, with a ``MambaRadixCache``, the
    tree's sanity."""
    cache_config.setdefault("page_size", 1)
    sched = build_scheduler(model, max_batch_size=2, overlap=overlap, **cache_config)
    done = serve_two_rounds(sched, max_new)
    table = sched.cache.req_to_token_pool
    tree = sched.cache.tree_cache
    held = tree.mamba_evictable_size() + tree.mamba_protected_size() if isinstance(tree, MambaRadixCache) else 0
    assert table.mamba_allocator.available_size() + held == table.mamba_pool_size, "a state slot leaked"
    if isinstance(tree, MambaRadixCache):
        tree.sanity_check()
    return sched, done


_GREEDY: weakref.WeakKeyDictionary[Any, dict[tuple[tuple[int, ...], int], tuple[list[int], np.ndarray]]] = (
    weakref.WeakKeyDictionary()
)


def hf_greedy(hf: Any, prompt: list[int], max_new: int) -> tuple[list[int], np.ndarray]:
    """Transformers' greedy tokens and the logits they were picked from (``[max_new, vocab]``).

    Memoised per model, prompt and length: a test module's scenarios serve the same prompts to one
    model, and Transformers' greedy decode of a fixed model is a pure function of the prompt, so
    each reference is computed once per module (a copy is returned)."""
    memo = _GREEDY.setdefault(hf, {})
    key = (tuple(prompt), max_new)
    if key not in memo:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        memo[key] = (tokens, np.stack([step[0].numpy() for step in out.logits]))
    tokens, logits = memo[key]
    return list(tokens), logits.copy()


def assert_no_near_tie(name: str, logits: np.ndarray, min_margin: float) -> None:
    """The near-tie guard: Transformers' top-2 margin is at least ``min_margin`` at every step."""
    top2 = np.sort(logits, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    assert margin >= min_margin, f"{name}: Transformers' top-2 margin {margin:.2e} is a near-tie; pick other seeds"


def assert_matches_transformers(hf: Any, done: dict[str, ServingReq], *, max_new: int, atol: float) -> None:
    """Every request's greedy tokens equal Transformers' ``generate`` on its full prompt and its
    logits agree within ``atol`` (the near-tie guard at ``MARGIN_FACTOR * atol`` first)."""
    for name, req in done.items():
        tokens, logits = hf_greedy(hf, list(req.origin_input_ids), max_new)
        assert_no_near_tie(name, logits, MARGIN_FACTOR * atol)
        assert req.output_ids == tokens, f"{name}: kvjax {req.output_ids} != transformers {tokens}"
        ours = np.stack(req.logits)
        assert ours.shape == logits.shape
        np.testing.assert_allclose(ours, logits, atol=atol, rtol=0, err_msg=f"{name}: logits")
