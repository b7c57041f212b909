#!/usr/bin/env bash
# The whole test suite (unit, service, mesh tiers), with its own set-up. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's chromium + chromedriver for the dashboard's browser test (apt once, as root), installed while
# setup.sh installs the Python side (both mostly wait on downloads); where they cannot be installed the
# rest of the suite still runs and that test fails saying why
browser_log=$(mktemp)
bash scripts/browser.sh >"$browser_log" 2>&1 &
browser=$!
bash scripts/setup.sh || { wait "$browser" || true; cat "$browser_log" >&2; exit 1; }
browser_rc=0
wait "$browser" || browser_rc=$?
cat "$browser_log" >&2 && rm -f "$browser_log"
[ "$browser_rc" = 0 ] || echo "test: chromium could not be installed (above): tests/mesh/test_dashboard.py will fail" >&2
# Three workers (pytest-xdist), each test file on one of them so a file's shared mesh is started once:
# the mesh tests wait on their processes (paced stages, leases, re-plans) more than they compute, so
# three files at a time keep 2 cores busy; the longest files go first (tests/conftest.py LONGEST_FIRST).
# LOGICPIPE_TEST_WORKERS sets how many (0: no workers, all in
# this process).
exec .venv/bin/python -m pytest -q -n "${LOGICPIPE_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
