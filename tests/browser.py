"""Headless Chromium for the dashboard's browser test and its screenshot (bench.dashboard_shot):
Debian's `chromium` and `chromium-driver` (scripts/browser.sh installs them), driven by Selenium
through the driver at CHROMEDRIVER, named explicitly so that Selenium Manager never looks for (or
downloads) a driver or a browser of its own.

    with chromium() as driver:
        driver.get(url)

or `open_chromium()` (started beside other work, e.g. in a thread while a mesh starts), then quit().
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--hide-scrollbars", "--force-device-scale-factor=1")


class _Chrome(webdriver.Chrome):
    """A Chrome driver whose quit() also removes the browser's temporary directory (its TMPDIR and
    profile: Chromium left an org.chromium.Chromium.* directory in /tmp each run before)."""

    scratch: str = ""

    def quit(self) -> None:
        try:
            super().quit()
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)


def open_chromium(width: int = 1400, height: int = 1000, log: Path | None = None) -> webdriver.Chrome:
    """A headless Chromium of `width` x `height` pixels (the caller quits it); RuntimeError, saying
    how to install them, when the browser or its driver is missing. `log`: the driver's log file."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} missing: the dashboard's browser test needs Debian's chromium and "
                           "chromium-driver (bash scripts/browser.sh, as root, installs them)")
    scratch = tempfile.mkdtemp(prefix="logicpipe-chromium-")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--window-size={width},{height}", f"--user-data-dir={scratch}/profile"):
        options.add_argument(flag)
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(log) if log else os.devnull,
                      env=dict(os.environ, TMPDIR=scratch))
    try:
        driver = _Chrome(service=service, options=options)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    driver.scratch = scratch
    return driver


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000, log: Path | None = None):
    """open_chromium's browser, quit when the `with` ends (also on failure)."""
    driver = open_chromium(width, height, log)
    try:
        yield driver
    finally:
        driver.quit()
