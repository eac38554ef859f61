"""The verifier's container image, built and smoke-tested (`make image-test`): slow, and only where
a container engine (podman or docker) is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("podman") is None and shutil.which("docker") is None, reason="no podman or docker"
)
def test_verifier_image_serves_exact_tokens() -> None:
    r = subprocess.run(
        ["bash", "scripts/image.sh", "test"], cwd=REPO, capture_output=True, text=True, timeout=3600,
        env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "greedy through the edge client == target-only ar" in r.stdout and ": True" in r.stdout
    assert "must not be 0" in r.stdout
