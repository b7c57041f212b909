#!/usr/bin/env bash
# The whole test suite (unit, service, mesh tiers), with its own set-up. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
