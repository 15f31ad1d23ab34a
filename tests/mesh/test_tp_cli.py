"""``generate --tp N`` and ``demo --tp N`` serve over a mesh of the local devices; ``--tp`` larger
than the local devices is one clear error naming the flag and the fix."""

from __future__ import annotations

import json

import jax

from kvjax.cli import main

GENERATE = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3,4,5,6", "--max-new-tokens", "4", "--json"]


def test_generate_at_tp_2_gives_the_single_device_tokens(capsys):
    assert main(GENERATE) == 0
    single = json.loads(capsys.readouterr().out)["outputs"]
    assert main([*GENERATE, "--tp", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"] == single


def test_demo_at_tp_4_is_leak_free_and_cold_equals_warm(capsys):
    argv = ["demo", "--tp", "4", "--groups", "1", "--prompts-per-group", "2", "--chats", "1", "--turns", "2"]
    assert main([*argv, "--system-tokens", "32", "--output-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["leak_free"] and report["cold_equals_warm"] and report["cached_tokens"] > 0


def test_tp_beyond_the_local_devices_names_the_flag_and_the_fix(capsys):
    too_many = len(jax.local_devices()) * 2
    assert main([*GENERATE, "--tp", str(too_many)]) == 2
    err = capsys.readouterr().err
    assert f"--tp {too_many}" in err and f"use --tp {len(jax.local_devices())} or fewer" in err
    assert "xla_force_host_platform_device_count" in err
