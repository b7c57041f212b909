"""On PYTHONPATH only for `python -m bench.gpu_tp --trace`: installs bench.step_trace's hooks into every
Python process that starts (a stage, its tensor-parallel followers) while LOGICPIPE_STEP_TRACE is set."""
import os
import sys

if os.environ.get("LOGICPIPE_STEP_TRACE"):
    try:
        from bench import step_trace

        step_trace.install()
    except Exception as exc:  # noqa: BLE001 — the run goes on untraced
        print(f"step trace not installed: {exc}", file=sys.stderr)
