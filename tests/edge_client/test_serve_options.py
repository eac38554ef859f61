"""`edge-client serve`'s flags (ServeOptions) default to what the local endpoint's ServeConfig does
for the settings they share, and are read back by field name."""

from __future__ import annotations

import dataclasses

from edge_client.cli_parser import ServeOptions, build_parser
from edge_client.serve import ServeConfig


def test_the_shared_settings_default_alike() -> None:
    opts, config = ServeOptions(), ServeConfig()
    for name in ("host", "allow_origins", "mode", "objective"):
        assert getattr(opts, name) == getattr(config, name), name


def test_the_parsed_flags_are_the_options() -> None:
    args = build_parser().parse_args(
        ["serve", "--allow-origin", "http://localhost:3000", "--no-prespec", "--port", "9000"]
    )
    opts = ServeOptions.from_args(args)
    assert opts == dataclasses.replace(
        ServeOptions(api_key=opts.api_key),
        allow_origins=("http://localhost:3000",),
        prespec=False,
        port=9000,
    )
