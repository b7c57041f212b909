"""On PYTHONPATH only for `python -m bench.gpu_tp --trace` (or with LOGICPIPE_STEP_LOG set): installs
bench.step_trace's hooks (and bench.step_log's) into every Python process that starts (a stage, its
tensor-parallel followers) while LOGICPIPE_STEP_TRACE (LOGICPIPE_STEP_LOG) is set."""
import os
import sys

if os.environ.get("LOGICPIPE_STEP_TRACE") or os.environ.get("LOGICPIPE_STEP_LOG"):
    try:
        from bench import step_trace

        step_trace.install()
        from bench import step_log

        step_log.install()
    except Exception as exc:  # noqa: BLE001 — the run goes on untraced
        print(f"step trace not installed: {exc}", file=sys.stderr)
