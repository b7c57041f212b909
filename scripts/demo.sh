#!/usr/bin/env bash
# The main job on one machine: two stage nodes and a controller on 127.0.0.1 (the controller finds
# the nodes by mDNS on the loopback interface, under a mesh name of this run's own), one prompt
# answered, tokens streaming to the terminal; everything started here is stopped on exit.
# Usage: scripts/demo.sh ["PROMPT"] [extra lpctl submit flags, e.g. --max-tokens 64 -v]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PROMPT=${1:-"Explain pipeline parallelism in two sentences."}
shift || true
BIN=.venv/bin
LOGS=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM
S0=127.0.0.1:${LP_PORT0:-50061}; S1=127.0.0.1:${LP_PORT1:-50062}; C=127.0.0.1:${LP_CONTROLLER_PORT:-50051}
MDNS=(--mdns-interface 127.0.0.1 --mesh "demo-$$")
"$BIN/logicpipe-stage" --listen "$S0" --node-id stage0 --state-dir "$LOGS/state0" "${MDNS[@]}" > "$LOGS/stage0.log" 2>&1 & pids+=($!)
"$BIN/logicpipe-stage" --listen "$S1" --node-id stage1 --state-dir "$LOGS/state1" "${MDNS[@]}" > "$LOGS/stage1.log" 2>&1 & pids+=($!)
"$BIN/logicpipe-controller" --listen "$C" --state-dir "$LOGS/controller-state" "${MDNS[@]}" > "$LOGS/controller.log" 2>&1 & pids+=($!)
echo "demo: starting 2 stage nodes and a controller that finds them by mDNS (logs in $LOGS)" >&2
for _ in $(seq 1 240); do
    if [ "$("$BIN/lpctl" --controller "$C" --timeout 2 status 2>/dev/null | grep -cE '^([0-9]+ +)+stage[01] ')" = 2 ]; then
        break
    fi
    if ! kill -0 "${pids[2]}" 2>/dev/null; then cat "$LOGS/controller.log" >&2; exit 1; fi
    sleep 0.5
done
"$BIN/lpctl" --controller "$C" status >&2
echo >&2
echo "> $PROMPT" >&2
"$BIN/lpctl" --controller "$C" submit "$PROMPT" "$@"
