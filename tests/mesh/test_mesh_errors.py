"""Bad meshes and parallel sizes: one ``ConfigError`` naming the option (the flag on the command
line), the value and the fix, raised before anything is allocated (``jax.live_arrays()`` is
unchanged).

The build cases run in one subprocess with 8 CPU devices (the host platform is split before jax
starts); the command-line cases run ``python -m kvjax plan`` in this process (it is jax-free).
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

import numpy as np
import pytest

from kvjax.cli import main
from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.mesh_check import MeshFacts, check_local_devices, check_mesh, serving_mesh_shape
from tests.mesh.subprocess_run import run_with_devices

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from jax.sharding import Mesh
    from kvjax import CacheConfig, build_kv_cache
    from kvjax.errors import ConfigError
    from kvjax.mesh_check import make_serving_mesh
    from kvjax.spec import ModelSpec

    devices = jax.devices()
    tiny = ModelSpec.preset("tiny")  # 4 attention heads, 2 KV heads


    class Device:
        def __init__(self, platform):
            self.platform = platform


    class TwoPlatformMesh:  # what a mesh over a CPU and a TPU device looks like to the check
        axis_names = ("tp",)
        shape = {"tp": 2}
        devices = np.array([Device("cpu"), Device("tpu")], dtype=object)


    def config(tp, dp=1):
        return CacheConfig(max_total_tokens=256, max_running_requests=4, tp_size=tp, dp_size=dp,
                           enable_dp_attention=dp > 1)


    cases = {
        "mesh_shape_mismatch": lambda: build_kv_cache(tiny, config(4), mesh=Mesh(np.array(devices[:2]), ("tp",))),
        "data_axis_without_dp": lambda: build_kv_cache(
            tiny, config(4), mesh=Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "tp"))),
        "data_axis_size_mismatch": lambda: build_kv_cache(
            tiny, config(4, dp=2), mesh=Mesh(np.array(devices[:4]).reshape(1, 4), ("data", "tp"))),
        "dp_mesh_tp_axis_mismatch": lambda: build_kv_cache(
            tiny, config(8, dp=2), mesh=Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "tp"))),
        "too_few_devices": lambda: make_serving_mesh(16),
        "heads_do_not_divide": lambda: build_kv_cache(tiny, config(3), mesh=Mesh(np.array(devices[:3]), ("tp",))),
        "unknown_axis": lambda: build_kv_cache(tiny, config(2), mesh=Mesh(np.array(devices[:2]), ("model",))),
        "two_platforms": lambda: build_kv_cache(tiny, config(2), mesh=TwoPlatformMesh()),
        "dp_does_not_divide_tp": lambda: make_serving_mesh(8, 3, True),
    }
    results = {}
    for name, call in cases.items():
        before = len(jax.live_arrays())
        try:
            call()
        except ConfigError as e:
            results[name] = {"option": e.option, "value": repr(e.value), "message": str(e),
                             "new_arrays": len(jax.live_arrays()) - before}
        else:
            results[name] = {"option": None, "message": "no error", "new_arrays": len(jax.live_arrays()) - before}
    print(json.dumps(results))
    """
)

# case -> (option named, words the message must hold)
EXPECTED = {
    "mesh_shape_mismatch": ("tp_size", ("'tp' axis has 2 devices", "attention TP is 4")),
    "data_axis_without_dp": ("dp_size", ("'data' axis has 2 device(s)", "set dp_size 2 with enable_dp_attention")),
    "data_axis_size_mismatch": ("dp_size", ("'data' axis has 1 device(s)", "2 DP-attention rank(s)")),
    "dp_mesh_tp_axis_mismatch": ("tp_size", ("'tp' axis has 2 devices", "attention TP is 4", "tp_size 8 / dp_size 2")),
    "too_few_devices": ("tp_size", ("only 8 cpu device(s)", "tp_size 8 or fewer", "xla_force_host_platform")),
    "heads_do_not_divide": ("tp_size", ("4 attention heads cannot be split evenly over 3", "use tp_size 1, 2")),
    "unknown_axis": ("mesh", ("does not know the mesh axis 'model'", "jax.make_mesh((2,), ('tp',))")),
    "two_platforms": ("mesh", ("2 platforms (cpu, tpu)", "one platform's devices")),
    "dp_does_not_divide_tp": ("dp_size", ("3 does not divide tp_size 8", "use dp_size 1, 2, 4 or 8")),
}


@pytest.fixture(scope="module")
def build_errors() -> dict[str, Any]:
    return run_with_devices(["-c", SCRIPT], timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_mesh_is_one_clear_error_before_anything_is_allocated(build_errors: dict[str, Any], case: str) -> None:
    got = build_errors[case]
    option, words = EXPECTED[case]
    assert got["option"] == option, got
    for word in words:
        assert word in got["message"], f"{case}: {word!r} not in {got['message']!r}"
    assert got["new_arrays"] == 0, f"{case}: {got['new_arrays']} arrays were allocated before the error"


# --- the command line ---------------------------------------------------------------------------


def test_plan_dp_not_dividing_tp_names_both_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3-8b", "--memory", "1GiB", "--tp", "8", "--dp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, "one line"
    assert "--dp 3:" in err and "does not divide --tp 8" in err and "use --dp 1, 2, 4 or 8" in err


def test_plan_with_dp_prints_per_device_sizes_of_the_attention_tp_group(capsys: pytest.CaptureFixture[str]) -> None:
    """``--tp 8 --dp 2`` plans attention TP 4: llama-3-8b's 8 KV heads, 2 per device."""
    assert main(["plan", "--model", "llama-3-8b", "--memory", "1GiB", "--tp", "8", "--dp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_kv_heads_per_rank"] == 2
    assert main(["plan", "--model", "llama-3-8b", "--memory", "1GiB", "--tp", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_total_tokens"] == plan["max_total_tokens"]
    assert main(["plan", "--model", "llama-3-8b", "--memory", "1GiB", "--tp", "8", "--dp", "2"]) == 0
    assert "parallel: tp 8 (dp 2 x attention tp 4)" in capsys.readouterr().out


def test_tp_beyond_the_local_devices_renders_as_the_tp_flag() -> None:
    from kvjax.cli.messages import config_error_line
    from kvjax.cli.plan_command import FLAG_FOR_OPTION

    with pytest.raises(ConfigError) as raised:
        check_local_devices(16, 8, "tpu")
    line = config_error_line(raised.value, FLAG_FOR_OPTION, _Args(tp=16))
    assert line.startswith("--tp 16: only 8 tpu device(s)") and "use --tp 8 or fewer" in line


class _Args:
    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


# --- the checks themselves (no devices) ---------------------------------------------------------


def test_serving_mesh_shape_is_data_by_attention_tp() -> None:
    assert serving_mesh_shape(8) == {"tp": 8}
    assert serving_mesh_shape(8, 2, True) == {"data": 2, "tp": 4}
    assert serving_mesh_shape(8, 2, False) == {"tp": 8}, "without DP attention dp is separate replicas"


def test_a_fitting_mesh_passes() -> None:
    check_mesh(MeshFacts(("tp",), (4,), ("tpu",) * 4), CacheConfig(max_total_tokens=256, tp_size=4))
    dp = CacheConfig(max_total_tokens=256, tp_size=8, dp_size=2, enable_dp_attention=True)
    check_mesh(MeshFacts(("data", "tp"), (2, 4), ("tpu",) * 8), dp)
    check_mesh(MeshFacts(("data", "tp"), (1, 2), ("cpu",) * 2), CacheConfig(max_total_tokens=256, tp_size=2))


def test_mesh_facts_read_a_jax_mesh() -> None:
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tp"))
    facts = MeshFacts.of(mesh)
    assert facts.axis_names == ("data", "tp") and facts.axis_sizes == (1, 1) and facts.num_devices == 1
    assert facts.size("tp") == 1 and facts.size("absent") == 1
