#!/usr/bin/env bash
# Idempotent: Debian's headless Chromium and its WebDriver for the dashboard's browser test
# (tests/mesh/test_dashboard.py) and its screenshot (bench/dashboard_shot.py). Nothing to do when
# /usr/bin/chromium and /usr/bin/chromedriver exist; else `apt-get update` once, then the two
# packages (as root, or through sudo). Exits 1 when they cannot be installed; scripts/test.sh then
# runs the suite anyway and the browser test fails saying so (it never skips).
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null; then
        echo "browser: chromium and chromedriver are missing and this is not root (no sudo): as root run" \
             "apt-get update && apt-get install -y chromium chromium-driver" >&2
        exit 1
    fi
    sudo="sudo -n"
fi
echo "browser: installing Debian's chromium and chromium-driver (the dashboard's browser test)" >&2
$sudo apt-get update -q
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver
for f in /usr/bin/chromium /usr/bin/chromedriver; do
    [ -x "$f" ] || { echo "browser: $f is still missing after apt-get install" >&2; exit 1; }
done
