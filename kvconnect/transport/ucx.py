"""UCX environment defaults kvconnect sets before a backend loads UCX (NIXL's UCX plugin, raw UCX workloads)."""

from __future__ import annotations

import os


def skip_ucx_ib_without_devices() -> None:
    """Keep UCX from loading its InfiniBand module on a host that has no RDMA device.

    Some hosts ship rdma-core's userspace libraries without any RDMA device; there UCX's ib module
    pulls a second copy of libnl into the process and its destructor was seen to crash the process at
    exit. Without a device the module has nothing to do. An explicit UCX_MODULES is left alone.
    """
    if "UCX_MODULES" in os.environ:
        return
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if not devices:
        os.environ["UCX_MODULES"] = "^ib"
