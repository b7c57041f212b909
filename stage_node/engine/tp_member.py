"""This node as a member (rank r > 0) of another node's tensor-parallel stage (the controller's --tp-group,
issue 36): the follower loop of engine.tp_group in a subprocess, at its rank, with this node's own copy of
the model (each rank loads only its share of its layers). While it runs the node serves nothing else (its
Status says "member" and names rank 0); when it ends (rank 0 stopped the group, or died: its next
broadcast fails) the node is idle again, to be assigned anew.
"""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

from logicpipe.errors import FailedPrecondition, InvalidArgument
from logicpipe.stage_node.config import Assignment
from logicpipe.stage_node.engine.tp_group import STOP_WAIT_S, WATCH_S, Remote

log = logging.getLogger(__name__)


def remote_for(a: Assignment, node_id: str, device: str, *, own_group: bool) -> Remote | None:
    """The group over several nodes `a` makes this node a rank of (None: a stage of this node alone), or
    the error that names why it cannot be (`own_group`: it spans several devices itself, --tp/--tp-max)."""
    if a.tp_world <= 1:
        return None
    if own_group or device != "cpu":
        raise FailedPrecondition(f"tp_world {a.tp_world}: node {node_id} cannot join a stage over several nodes (it "
                                 "spans several devices itself with --tp/--tp-max, or computes on a GPU: a group over "
                                 "several nodes is CPU and gloo only)")
    if a.tp_members[a.tp_rank] != node_id:
        raise InvalidArgument(f"tp_members names {a.tp_members[a.tp_rank][:80]} at rank {a.tp_rank}, not node {node_id}")
    return Remote(a.tp_init, str(a.generation), a.tp_members)


class Member:
    """The follower process of one group's rank on this node."""

    def __init__(self, rank: int, remote: Remote, model_dir: str, threads: int):
        self.rank, self.remote, self.model_dir = rank, remote, model_dir
        cmd = [sys.executable, "-m", "logicpipe.stage_node.engine.tp_group", "--rank", str(rank), "--world",
               str(remote.world), "--init", remote.init, "--device", "cpu", "--threads", str(threads),
               "--parent", str(os.getpid()), "--members", ",".join(remote.members), "--key", remote.key,
               "--model-dir", model_dir]
        self.proc = subprocess.Popen(cmd)
        log.info("member %d of the tensor-parallel stage of %s (%s at %s): follower pid %d", rank, remote.members[0],
                 ", ".join(remote.members), remote.init, self.proc.pid)

    @property
    def leader(self) -> str:
        return self.remote.members[0]

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def ended(self) -> None:
        """Returns once the follower has ended."""
        while self.alive():
            await asyncio.sleep(WATCH_S)

    def same(self, rank: int, remote: Remote, model_dir: str) -> bool:
        """Already this rank of that group (and still in it)."""
        return self.alive() and (self.rank, self.remote, self.model_dir) == (rank, remote, model_dir)

    def stop(self) -> None:
        """End the follower (the group is over for this node): killed, waited for."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("tensor-parallel follower %d did not exit", self.proc.pid)
