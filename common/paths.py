"""Where LogicPipe keeps what it makes once and reuses (converted models, node profiles, plans)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$LOGICPIPE_CACHE, else $XDG_CACHE_HOME/logicpipe, else ~/.cache/logicpipe."""
    if os.environ.get("LOGICPIPE_CACHE"):
        return Path(os.environ["LOGICPIPE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "logicpipe"
