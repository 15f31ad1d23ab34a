"""The command-line flags of prefill/decode disaggregation (``demo``, ``generate``; SGLang's names).

``--disaggregation-mode prefill`` serves prompts' prefill for decode servers: the model and cache
built as the command builds them, a bootstrap endpoint on ``--disaggregation-bootstrap-port``
(SGLang's default 8998; 0: a free one), one line ``prefill server listening on HOST:PORT`` on
standard output, then served until SIGINT or SIGTERM. ``--disaggregation-mode decode`` serves the
command's requests with each prompt computed on a prefill server (``--disaggregation-prefill-addr
HOST:PORT``, repeated for several) and its KV pulled here; ``--disaggregation-timeout`` bounds
each wait on a prefill server. Both sides hold the cluster secret ``KVJAX_CLUSTER_SECRET`` (hex,
never a flag; ``kvjax.multihost.cluster_secret``). The mode also sets
``CacheConfig.disaggregation_mode``.

Everything here is checked without jax (`check_disaggregation`): an address without decode mode,
decode mode without one, a malformed ``HOST:PORT``, a missing or malformed secret, and what is not
served disaggregated yet (several processes, ``--dp``, ``--pp``, ``--dcp``, speculative decoding,
images) are one ``error:`` line each.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvjax.cli.arg_types import positive_float
from kvjax.cli.messages import UsageError

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "DEFAULT_HOST",
    "DEFAULT_TIMEOUT_S",
    "add_disaggregation_arguments",
    "bind_host",
    "bootstrap_port",
    "check_disaggregation",
    "disaggregated",
    "failed_requests",
    "parse_address",
    "timeout_s",
]

#: SGLang's default ``--disaggregation-bootstrap-port``.
DEFAULT_BOOTSTRAP_PORT = 8998
#: The interface a disaggregated server binds to unless ``--host`` says otherwise (loopback only).
DEFAULT_HOST = "127.0.0.1"
#: The default ``--disaggregation-timeout``, seconds.
DEFAULT_TIMEOUT_S = 30.0
MODES = ("null", "prefill", "decode")


def _port(text: str) -> int:
    """``--disaggregation-bootstrap-port``: 0 (a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: give a port in [0, 65535] (0: a free one)")
    return value


def add_disaggregation_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of prefill/decode disaggregation to ``parser``."""
    group = parser.add_argument_group("prefill/decode disaggregation (KVJAX_CLUSTER_SECRET authenticates the link)")
    group.add_argument(
        "--disaggregation-mode",
        choices=MODES,
        default="null",
        help="prefill: serve prompts' prefill for decode servers; decode: decode with prompts prefilled on "
        "--disaggregation-prefill-addr; null (default): both here",
    )
    group.add_argument(
        "--disaggregation-bootstrap-port",
        type=_port,
        default=None,
        metavar="PORT",
        help=f"prefill: the port decode servers connect to (default {DEFAULT_BOOTSTRAP_PORT}; 0: a free one, printed)",
    )
    group.add_argument(
        "--disaggregation-prefill-addr",
        action="append",
        metavar="HOST:PORT",
        help="decode: a prefill server's bootstrap address; repeat for several",
    )
    group.add_argument(
        "--disaggregation-decode-enable-radix-cache",
        action="store_true",
        help="decode: keep a radix tree here and pull only what it lacks (SGLang's flag; off: the decode "
        "server's radix cache is disabled, as in SGLang)",
    )
    group.add_argument(
        "--host",
        default=None,
        metavar="HOST",
        help=f"prefill or decode: the address of this host its bootstrap endpoint and KV transfer servers bind "
        f"to and advertise, one the other side reaches (default {DEFAULT_HOST}, loopback only; SGLang's --host)",
    )
    group.add_argument(
        "--disaggregation-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help=f"decode: the bound on each wait on a prefill server (default {DEFAULT_TIMEOUT_S:g})",
    )


def disaggregated(args: argparse.Namespace) -> bool:
    """Whether the command runs as a prefill or a decode server."""
    return getattr(args, "disaggregation_mode", "null") in ("prefill", "decode")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` -> ``(host, port)``; a `UsageError` naming the flag for anything else."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(
            f"--disaggregation-prefill-addr {text}: give a prefill server's bootstrap address as HOST:PORT "
            "(a port in [1, 65535]), e.g. 127.0.0.1:8998"
        )
    return host, int(port)


def bind_host(args: argparse.Namespace) -> str:
    """The interface the server binds to (``--host`` or loopback)."""
    return DEFAULT_HOST if args.host is None else str(args.host)


def bootstrap_port(args: argparse.Namespace) -> int:
    """The prefill server's port (``--disaggregation-bootstrap-port`` or SGLang's default)."""
    port = args.disaggregation_bootstrap_port
    return DEFAULT_BOOTSTRAP_PORT if port is None else int(port)


def timeout_s(args: argparse.Namespace) -> float:
    """The decode server's bound on each wait (``--disaggregation-timeout`` or the default)."""
    given = args.disaggregation_timeout
    return DEFAULT_TIMEOUT_S if given is None else float(given)


def check_disaggregation(args: argparse.Namespace, *, command: str, speculative: bool, processes: bool) -> None:
    """A `UsageError` for a combination of the disaggregation flags the command does not serve
    (see the module docstring); nothing when ``--disaggregation-mode`` is null and no other
    disaggregation flag is given. ``speculative``: the speculative flags are set; ``processes``:
    the multi-process flags are."""
    mode = args.disaggregation_mode
    addresses: list[str] = args.disaggregation_prefill_addr or []
    if addresses and mode != "decode":
        raise UsageError(
            f"--disaggregation-prefill-addr {addresses[0]} is for a decode server; add --disaggregation-mode decode "
            "or drop it"
        )
    if args.disaggregation_bootstrap_port is not None and mode != "prefill":
        raise UsageError(
            f"--disaggregation-bootstrap-port {args.disaggregation_bootstrap_port} is a prefill server's; add "
            "--disaggregation-mode prefill or drop it"
        )
    if args.disaggregation_decode_enable_radix_cache and mode != "decode":
        raise UsageError(
            "--disaggregation-decode-enable-radix-cache is a decode server's; add --disaggregation-mode decode "
            "or drop it"
        )
    if args.host is not None and mode == "null":
        raise UsageError(
            f"--host {args.host} is the interface a prefill or decode server binds to; add --disaggregation-mode "
            "prefill or decode, or drop it"
        )
    if args.disaggregation_timeout is not None and mode != "decode":
        raise UsageError(
            f"--disaggregation-timeout {args.disaggregation_timeout:g} bounds a decode server's waits; add "
            "--disaggregation-mode decode or drop it"
        )
    if mode == "null":
        return
    if mode == "decode" and not addresses:
        raise UsageError(
            "--disaggregation-mode decode needs a prefill server: add --disaggregation-prefill-addr HOST:PORT "
            "(what the prefill server printed)"
        )
    for address in addresses:
        parse_address(address)
    if args.host is not None:
        _check_host(args.host)
    refused = [
        *(["--num-processes/--process-id/--coordinator/--distributed"] if processes and command != "generate" else []),
        *([f"--dp {args.dp}"] if args.dp > 1 else []),
        *([f"--pp {args.pp}"] if args.pp > 1 else []),
        *([f"--dcp {args.dcp}"] if args.dcp > 1 else []),
        *(["--speculative-algorithm"] if speculative else []),
        *([f"--image {args.image[0]}"] if getattr(args, "image", None) else []),
        *([f"--hicache-storage {args.hicache_storage}"] if getattr(args, "hicache_storage", None) else []),
    ]
    if refused:
        raise UsageError(
            f"--disaggregation-mode {mode} with {refused[0]}: not served disaggregated yet (--tp only; several "
            f"processes with generate); drop {refused[0].split()[0]}, or serve it with --disaggregation-mode null"
        )
    if mode == "prefill" and command == "generate" and args.prompts:
        raise UsageError(
            "--disaggregation-mode prefill takes no prompts (decode servers send them); drop --prompt/--prompt-ids"
        )
    _check_secret()


def _check_host(host: str) -> None:
    """``--host`` names an interface of this host (a socket binds there; checked without jax)."""
    import socket

    try:
        socket.create_server((host, 0)).close()
    except OSError as e:
        raise UsageError(
            f"--host {host}: cannot listen there ({e.strerror or e}); give an address of this host that the "
            f"other side reaches (default {DEFAULT_HOST}, loopback)"
        ) from None


def _check_secret() -> None:
    """The cluster secret is in the environment and well formed (checked without jax)."""
    from kvjax.multihost.cluster_secret import CLUSTER_SECRET_ENV, ClusterSecret, MissingSecretError

    if not os.environ.get(CLUSTER_SECRET_ENV):
        raise UsageError(
            f"no cluster secret: prefill and decode servers authenticate each other with one; export the same "
            f"{CLUSTER_SECRET_ENV} (hex) to both, e.g. python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    try:
        ClusterSecret.resolve(None, os.environ)
    except MissingSecretError as e:
        raise UsageError(str(e)) from None


def cache_mode(args: argparse.Namespace) -> dict[str, Any]:
    """``CacheConfig``'s ``disaggregation_mode`` as the flag sets it (empty when null)."""
    if args.disaggregation_mode == "null":
        return {}
    radix = {"disaggregation_decode_enable_radix_cache": True} if args.disaggregation_decode_enable_radix_cache else {}
    return {"disaggregation_mode": args.disaggregation_mode, **radix}


def failed_requests(command: str, counters: dict[str, Any] | None) -> int:
    """One ``error:`` line on standard error per request a decode server failed (its prompt, or
    its name, and why); 1 when there was any, else 0."""
    failed = (counters or {}).get("failed") or []
    for entry in failed:
        what = f"prompt {entry['prompt']}" if "prompt" in entry else f"request {entry['request']}"
        print(f"python -m kvjax {command}: error: {what} failed: {entry['reason']}", file=sys.stderr)
    return 1 if failed else 0
