"""The mesh tier runs over mutual TLS: every LocalMesh of these tests gives its controller and
stages certificates of one throw-away CA, and this test process talks to them as a client."""
from __future__ import annotations

import os

os.environ["LOGICPIPE_LOCALMESH_TLS"] = "1"
