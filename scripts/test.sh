#!/usr/bin/env bash
# The whole test suite (unit, service, mesh tiers), with its own set-up. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/browser.sh  # Debian's chromium + chromedriver for the dashboard's browser test (apt once, as root)
exec .venv/bin/python -m pytest -q "$@"
