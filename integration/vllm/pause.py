"""Hold a prefill engine in the middle of a push's WRITE, for the e2e tests of aborts and kills mid-stream.

Installed in every process of an engine started with `Engine(..., pause_dir=...)` (through
pause_site/sitecustomize.py), as soon as that process imports kvconnect's vLLM worker. Nothing
happens until a test creates the file `arm` in that directory. The next WRITE that kvconnect posts
then holds the thread that posted it right after the post, once it has written `paused` (JSON: pid,
whether the push was still streaming layers, how many (group, region) pairs it had posted). That
thread is the one that would see the WRITE end and send decode the done or abort notice, so decode
hears nothing until the test creates `resume` (or kills the engine).

The thread is held, not the process stopped: a SIGSTOP the process sends itself does not stop the
sending thread then and there. In these engines that thread ran on past its own kill(), through a file
write 0.2 ms later, and now and then far enough to send decode the done notice the test must not see.

Layer-wise, the forward pass is held at its first computed layer until the hold, so it always comes
mid-stream: the WRITE of that layer posted, the other layers not computed yet.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from pathlib import Path

_WORKER = "kvconnect.integrations.vllm.push_worker"
_HOLD_S = 300.0  # a test that never resumes does not hold the engine's WRITEs for good


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds kvconnect's vLLM worker module as usual, and installs the hook once it has run."""

    def __init__(self, directory: str):
        self.directory = directory

    def find_spec(self, name, path, target=None):
        if name != _WORKER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            install(self.directory)

        spec.loader.exec_module = exec_module
        return spec


def install_on_import(directory: str) -> None:
    """Install the hook in this process when it imports kvconnect's vLLM worker (now, if it has)."""
    if _WORKER in sys.modules:
        install(directory)
    else:
        sys.meta_path.insert(0, _PatchOnImport(directory))


def install(directory: str) -> None:
    """Patch kvconnect's WRITE post and layer-wise hand-off in this process (and the processes it forks)."""
    from kvconnect.integrations.vllm.push_worker import LayerwisePushWorker
    from kvconnect.pd.peer import PeerWorker

    where = Path(directory)
    arm, paused, resume = where / "arm", where / "paused", where / "resume"
    post, layer_saved = PeerWorker._post, LayerwisePushWorker.layer_saved

    def held_post(self, load) -> None:
        post(self, load)
        if load.op != "WRITE" or not load.posted or load.failure is not None:
            return
        try:
            os.remove(arm)  # only the first WRITE after arming is held
        except FileNotFoundError:
            return
        info = {"pid": os.getpid(), "streaming": load.open, "posted": len(load.posted)}
        tmp = where / "paused.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, paused)
        until = time.monotonic() + _HOLD_S
        while not resume.exists() and time.monotonic() < until:
            time.sleep(0.01)

    def held_layer_saved(self, layer_name: str, meta) -> None:
        layer_saved(self, layer_name, meta)
        if self._streamed and arm.exists():
            deadline = time.monotonic() + 30.0
            while arm.exists() and time.monotonic() < deadline:  # until the WRITE of this layer is held
                time.sleep(0.005)

    PeerWorker._post = held_post
    LayerwisePushWorker.layer_saved = held_layer_saved
