"""Serving over pipeline stages from the entry points, and their bad input.

``generate --pp 2`` gives the single-device tokens; ``demo --pp 2`` is leak free with cold == warm;
``--pp`` larger than the model's layers, or than the devices with ``--tp``, is one error naming the
flag before anything is built.
"""

from __future__ import annotations

import json

import pytest

from kvjax.cli import main

GENERATE = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3,4,5,6,7,8,9", "--max-new-tokens", "4", "--json"]
PROMPTS = ["--prompt-ids", "9,8,7,6,5,4,3,2,1,11,12"]


def test_generate_over_stages_gives_the_single_device_tokens(capsys):
    assert main([*GENERATE, *PROMPTS, "--page-size", "2"]) == 0
    single = json.loads(capsys.readouterr().out)["outputs"]
    assert main([*GENERATE, *PROMPTS, "--page-size", "2", "--pp", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"] == single


def test_demo_at_pp_2_is_leak_free_and_cold_equals_warm(capsys):
    argv = ["demo", "--pp", "2", "--groups", "1", "--prompts-per-group", "2", "--chats", "1"]
    assert main([*argv, "--turns", "2", "--system-tokens", "32", "--output-tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["leak_free"] and report["cold_equals_warm"] and report["cached_tokens"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--pp", "3"], "--pp 3: the model has 2 layers, so at most 2 pipeline stages"),
        (["--pp", "2", "--tp", "8"], "--pp 2: 2 pipeline stages of tp_size=8 devices need 16 devices"),
    ],
)
def test_pp_beyond_the_layers_or_the_devices_is_one_clear_error(flags, message, capsys):
    assert main([*GENERATE, *flags]) == 2
    assert message in capsys.readouterr().err
