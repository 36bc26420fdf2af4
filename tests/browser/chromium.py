"""Debian's Chromium for the browser tests, installed on demand.

Playwright's own browser download cannot work here (only package registries are reachable), so the
tests drive the distribution's Chromium. On a fresh machine it is installed with apt-get (the test
run is root); `apt-get update` runs only when the first install attempt fails on stale lists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CHROMIUM = Path(os.environ.get("SYNAPSE_CHROMIUM", "/usr/bin/chromium"))
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
]


def _apt_get(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Two test runs on one machine (two checkouts) may install at once: wait for the other's
    # dpkg lock instead of failing at once with exit 100.
    return subprocess.run(
        ["apt-get", "-o", "DPkg::Lock::Timeout=600", *args],
        env=env, capture_output=True, text=True, check=False,
    )


def ensure_chromium() -> Path:
    """Return the Chromium executable, installing the Debian package when it is missing."""
    if CHROMIUM.exists():
        return CHROMIUM
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"{CHROMIUM} is missing and apt-get is not available to install it")
    result = _apt_get("install", "-y", "--no-install-recommends", "chromium")
    if result.returncode != 0:
        update = _apt_get("update")
        if update.returncode != 0:
            raise RuntimeError(f"apt-get update failed:\n{update.stderr[-2000:]}")
        result = _apt_get("install", "-y", "--no-install-recommends", "chromium")
    if result.returncode != 0 or not CHROMIUM.exists():
        raise RuntimeError(
            f"could not install chromium with apt-get (exit {result.returncode}):\n"
            f"{result.stderr[-2000:]}"
        )
    return CHROMIUM
