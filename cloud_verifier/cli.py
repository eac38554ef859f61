"""`cloud-verifier`: the verifier service's command line.

Every flag reads its value by its ServerConfig field's rule (`server_config.field_type`: numbers
finite and in range, names not empty), so a value no client could use is a usage error naming the
flag, before anything loads. Exit status: 0 after serving (a drain included), 1 when the model
cannot be loaded, 2 for a usage error (a flag, a CLOUD_VERIFIER_<FIELD> variable or a file a flag
names), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from collections.abc import Sequence

from cloud_verifier.server_config import ServerConfig, field_type, openmp_waiting
from shared.config_cli import add_config_flags, config_values


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`serve`: one flag per ServerConfig field with `cli` metadata (shared.config_cli), its default
    the field's as CLOUD_VERIFIER_<FIELD> variables leave it, parsed by the field's rule."""
    p = sub.add_parser(
        "serve",
        help="run the verifier service (WebSocket /v1/session, the OpenAI API, /healthz, /readyz, "
        "/health, /metrics)",
        description="Load the target model, measure its verify cost curve and serve edge clients. "
        "Defaults come from ServerConfig and CLOUD_VERIFIER_<FLAG> environment variables.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_flags(p, ServerConfig, defaults=ServerConfig.from_env(), parse=field_type)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cloud-verifier",
        description="Cloud verifier of edge-drafted token trees: exact tree-speculative decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from cloud_verifier.fleet.cli import add_parser as fleet_parser

    fleet_parser(sub)
    return parser


def file_error(config: ServerConfig) -> str | None:
    """What is wrong with a file the config names (the flag, the path, why), or None. Checked
    before anything loads, so a missing key file or certificate ends the start in one line."""
    from cloud_verifier.auth import KeyStore

    if config.model == "tiny" and config.weights == "quantized":
        return (
            "--weights quantized runs a GGUF's blocks; the tiny model has none (use --weights fp32 or auto)"
        )
    if config.api_key_file is not None:
        try:
            KeyStore.from_file(config.api_key_file)
        except OSError as exc:
            return f"--api-key-file {config.api_key_file}: {exc.strerror or exc}"
        except ValueError as exc:
            return f"--api-key-file: {exc}"
    if config.ssl_certfile and config.ssl_keyfile:
        for flag, path in (("--ssl-certfile", config.ssl_certfile), ("--ssl-keyfile", config.ssl_keyfile)):
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                return f"{flag} {path}: {exc.strerror or exc}"
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
        except (OSError, ValueError) as exc:
            return (
                f"--ssl-certfile {config.ssl_certfile} / --ssl-keyfile {config.ssl_keyfile}: not a PEM "
                f"certificate chain and its private key ({exc})"
            )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signals (e.g. while importing)
        print("cloud-verifier: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    try:
        parser = build_parser()  # its defaults read CLOUD_VERIFIER_* variables
    except ValueError as exc:
        print(f"cloud-verifier: {exc}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed the usage and what was wrong (or the help)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "fleet":
        from cloud_verifier.fleet.cli import run as fleet

        return fleet(args, file_error)
    if args.command != "serve":
        return 2
    config = _serve_config(args)
    if isinstance(config, str):
        print(f"cloud-verifier: {config}", file=sys.stderr)
        return 2

    from cloud_verifier.server import serve

    if _parallel(config):
        from cloud_verifier.parallel import serve_parallel

        return serve_parallel(config)
    return serve(config)


def _serve_config(args: argparse.Namespace) -> ServerConfig | str:
    """The configuration `serve` runs with, or what is wrong with it (a usage error)."""
    from dataclasses import replace

    updates = config_values(ServerConfig, args)
    if bool(updates.get("ssl_certfile")) != bool(updates.get("ssl_keyfile")):
        return "--ssl-certfile and --ssl-keyfile go together"
    try:
        config = replace(ServerConfig.from_env(), **updates)
    except ValueError as exc:
        return str(exc)
    os.environ.update(openmp_waiting(config.threads or os.cpu_count() or 1, os.environ))  # before torch loads
    if _parallel(config) and config.offload != "none":
        return (
            "--offload does not combine with --tensor-parallel yet (each rank holds its shard "
            "resident); use one or the other"
        )
    return file_error(config) or config


def _parallel(config: ServerConfig) -> bool:
    """Whether the target is split over ranks: --tensor-parallel N > 1, or started by torchrun."""
    return config.tensor_parallel > 1 or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


if __name__ == "__main__":
    sys.exit(main())
