"""Headless Chromium (Debian's `chromium`) rendering a page as a person would see it: the DOM
after the page's scripts ran for a stretch of virtual time. For the dashboard's tests.

`--virtual-time-budget` runs timers as fast as the page allows and pauses while a fetch is
pending, so a page that polls its server shows that server's answers, not a half-loaded page.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile

# What Chromium needs to run as root in a container, and nothing that reaches the network.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def find_chromium() -> str | None:
    return shutil.which("chromium")


def dump_dom(url: str, chromium: str = "chromium", virtual_time_ms: int = 3000, timeout_s: float = 60.0) -> str:
    """The page's DOM (HTML) after `virtual_time_ms` of virtual time, from a fresh profile.
    Raises subprocess.CalledProcessError / TimeoutExpired when Chromium fails or hangs."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        done = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}",
                               f"--virtual-time-budget={virtual_time_ms}", "--dump-dom", url],
                              capture_output=True, text=True, timeout=timeout_s, check=True)
    return done.stdout
