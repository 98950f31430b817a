"""The container tier needs a Docker engine and the CPU images (`make test-containers` makes both);
without them it fails at once, saying what to run, rather than skipping unseen."""

from __future__ import annotations

import subprocess

import pytest

from tests.containers.project import PROMETHEUS_IMAGE, ROLEFLEET_IMAGE


@pytest.fixture(scope="session", autouse=True)
def engine_and_images():
    try:
        answered = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        answered = False
    if not answered:
        pytest.fail("no Docker engine answers: `make test-containers` installs and starts one where it is root "
                    "(scripts/container_images.sh engine)", pytrace=False)
    for image in (ROLEFLEET_IMAGE, PROMETHEUS_IMAGE):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode != 0:
            pytest.fail(f"image {image} is missing: `make image-cpu image-prometheus` builds it", pytrace=False)
