"""What a compiled serving step's program text says: its collectives (by layer, with their bytes),
its parameters aliased to outputs (donated, updated in place), its Mosaic kernels; and Megatron's
minimum of collectives to hold them against.

Reads the text of ``jax.stages.Compiled.as_text()`` (the optimised, SPMD-partitioned HLO module of
one device), so it counts what XLA will run, whatever the program was lowered from:

* a collective is an instruction ``all-reduce``, ``all-gather``, ``reduce-scatter``,
  ``all-to-all`` or ``collective-permute`` (an async pair counted once, at its ``-start``); its
  bytes are those of its result on one device; its ``op_name`` is the jax operation it came from
  (``.../layers_3/mlp/down_proj/dot_general``), and its layer the ``layers_N`` in that name
  (None outside the decoder layers: the embedding, the final norm, the LM head, sampling); its
  group size the number of chips in each of its replica groups (``replica_groups`` listed,
  iota ``[groups, size]<=[...]``, or ``mesh[...] {axes}``: the product of the named axes' sizes);
  and whether it sits in a loop's body (``/while/body/`` in its name: it runs once per trip);
* an entry parameter's name is its ``op_name`` (``pools[0].kv[1]``, ``params['model']...``,
  ``meta.out_loc``), the path jax gives each leaf of the jitted function's arguments;
* ``input_output_alias`` lists the parameters whose buffer the program's output reuses.

Megatron's minimum (tensor parallelism over the heads and the MLP's intermediate dimension, the
hidden state replicated between layers): one all-reduce of the ``[tokens, hidden]`` activations
after attention (``o_proj``'s partial sums) and one after the MLP (``down_proj``'s), per layer.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import jax.numpy as jnp

__all__ = [
    "Collective",
    "aliased_parameters",
    "collectives",
    "count_by_layer",
    "entry_parameters",
    "megatron_all_reduce_bytes_per_layer",
    "mosaic_kernels",
    "replica_group_size",
]

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4}
_DTYPE_BYTES |= {"s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_COLLECTIVE = re.compile(
    r"=\s*(?P<result>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LAYER = re.compile(r"/layers_(\d+)/")
_PARAMETER = re.compile(r"\bparameter\((\d+)\).*?" + _OP_NAME.pattern)
_ALIAS = re.compile(r"\{[\d,\s]*\}:\s*\((\d+),")
_GROUPS_LISTED = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its opcode, the bytes of its result on one device,
    the jax operation it came from, and the decoder layer that operation is in (None outside)."""

    op: str
    nbytes: int
    op_name: str
    layer: int | None
    group_size: int = 0
    in_loop: bool = False


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of a compiled program's text, in program order (module
    docstring); for an async ``-start``, the bytes of its results (the tuple repeats operands)."""
    found = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        arrays = [(dt, dims) for dt, dims in _ARRAY.findall(match.group("result")) if dt in _DTYPE_BYTES]
        if match.group("start") and len(arrays) > 1:  # (operands..., results...)
            arrays = arrays[len(arrays) // 2 :]
        nbytes = sum(_DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in arrays)
        name = _OP_NAME.search(line)
        op_name = name.group(1) if name else ""
        layer = _LAYER.search(op_name)
        found.append(
            Collective(
                match.group("op"),
                nbytes,
                op_name,
                int(layer.group(1)) if layer else None,
                group_size=replica_group_size(line),
                in_loop="/while/body/" in op_name,
            )
        )
    return found


def replica_group_size(instruction: str) -> int:
    """Chips in each replica group of a collective instruction's text (module docstring); 0 when
    its ``replica_groups`` is in none of the forms read here."""
    listed = _GROUPS_LISTED.search(instruction)
    if listed is not None:
        return len([g for g in listed.group(1).split(",") if g])
    iota = _GROUPS_IOTA.search(instruction)
    if iota is not None:
        return int(iota.group(1).split(",")[-1])
    mesh = _GROUPS_MESH.search(instruction)
    if mesh is not None:
        sizes = {name: int(size) for name, size in _MESH_AXIS.findall(mesh.group(1))}
        named = re.findall(r"'([^']+)'", mesh.group(2))
        return math.prod(sizes[name] for name in named) if named and all(n in sizes for n in named) else 0
    return 0


def entry_parameters(hlo_text: str) -> dict[int, str]:
    """The entry computation's parameters: number -> name (the argument path jax recorded)."""
    entry = hlo_text[hlo_text.index("\nENTRY ") :]
    body = entry[: entry.find("\n}")]
    names: dict[int, str] = {}
    for line in body.splitlines():
        match = _PARAMETER.search(line)
        if match is not None:
            names[int(match.group(1))] = match.group(2)
    return names


def aliased_parameters(hlo_text: str) -> set[int]:
    """Numbers of the parameters whose buffers the output reuses (``input_output_alias``): the
    donated arguments updated in place."""
    start = hlo_text.find("input_output_alias={")
    if start < 0:
        return set()
    end = hlo_text.find("\n", start)
    return {int(n) for n in _ALIAS.findall(hlo_text[start:end])}


def mosaic_kernels(hlo_text: str) -> int:
    """How many Mosaic (Pallas TPU) kernel calls the program makes (``tpu_custom_call``)."""
    return hlo_text.count('custom_call_target="tpu_custom_call"')


def megatron_all_reduce_bytes_per_layer(tokens: int, hidden: int, dtype: str) -> int:
    """Megatron's minimum per decoder layer: two all-reduces of ``[tokens, hidden]`` in the
    activations' ``dtype`` (module docstring)."""
    return 2 * tokens * hidden * jnp.dtype(dtype).itemsize


def count_by_layer(found: list[Collective]) -> Counter[int | None]:
    """How many collectives each layer (None: outside the layers) has."""
    return Counter(c.layer for c in found)
