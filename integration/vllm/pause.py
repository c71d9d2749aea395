"""Stop a prefill engine in the middle of a push's WRITE, for the e2e tests of aborts and kills mid-stream.

Installed in every process of an engine started with `Engine(..., pause_dir=...)` (through
pause_site/sitecustomize.py), as soon as that process imports kvconnect's vLLM worker. Nothing
happens until a test creates the file `arm` in that directory. The next WRITE that kvconnect posts
then stops the whole engine process (SIGSTOP) right after the post, once it has written `paused`
(JSON: pid, whether the push was still streaming layers, how many (group, region) pairs it had
posted). The test resumes the engine (SIGCONT) or kills it.

Layer-wise, the forward pass is held at its first computed layer until the stop, so the stop always
comes mid-stream: the WRITE of that layer posted, the other layers not computed yet.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
from pathlib import Path

_WORKER = "kvconnect.integrations.vllm.pd_worker"


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
    from kvconnect.integrations.vllm.pd_worker import PDWorker
    from kvconnect.pd.peer import PeerWorker

    where = Path(directory)
    arm, paused = where / "arm", where / "paused"
    post, layer_saved = PeerWorker._post, PDWorker.layer_saved

    def paused_post(self, load) -> None:
        post(self, load)
        if load.op != "WRITE" or not load.posted or load.failure is not None:
            return
        try:
            os.remove(arm)  # only the first WRITE after arming stops
        except FileNotFoundError:
            return
        info = {"pid": os.getpid(), "streaming": load.open, "posted": len(load.posted)}
        tmp = where / "paused.tmp"
        tmp.write_text(json.dumps(info))
        os.replace(tmp, paused)
        os.kill(os.getpid(), signal.SIGSTOP)

    def held_layer_saved(self, layer_name: str, meta) -> None:
        layer_saved(self, layer_name, meta)
        if self._streamed and arm.exists():
            deadline = time.monotonic() + 30.0
            while arm.exists() and time.monotonic() < deadline:  # until the WRITE of this layer stopped us
                time.sleep(0.005)

    PeerWorker._post = paused_post
    PDWorker.layer_saved = held_layer_saved
