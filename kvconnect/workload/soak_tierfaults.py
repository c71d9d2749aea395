"""The tier faults of the soak, made real: a small filesystem that fills, flipped bytes, a master that dies.

`Ground` owns what the tier phase stands on: a temporary directory, a 4 MiB tmpfs under the disk
tier (mounted when this process may mount; a plain directory otherwise, and the full-disk fault is
then reported as not made), a Mooncake Store on this host (`mooncake_master` and one storage node)
and a raw Mooncake client that rewrites stored objects the way a failing storage node would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

TMPFS_BYTES = 4 << 20


class Ground:
    """Disk, store and the hostile hands that damage them; `close()` undoes all of it."""

    def __init__(self, want_tmpfs: bool = True):
        self.root = Path(tempfile.mkdtemp(prefix="kvconnect-soak-"))
        self.disk_root = self.root / "disk"
        self.disk_root.mkdir()
        self.mounted = False
        self.not_made: dict[str, str] = {}
        if want_tmpfs:
            self._mount()
        self.tier_dir = self.disk_root / "tier"
        self.tier_dir.mkdir()
        self.fill_dir = self.disk_root / "fill"
        self.fill_dir.mkdir()
        self.store = None
        self.raw = None

    def _mount(self) -> None:
        try:
            out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(self.disk_root)],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.not_made["full_disk"] = f"cannot mount a small tmpfs: {exc}"
            return
        if out.returncode != 0:
            self.not_made["full_disk"] = f"cannot mount a small tmpfs: {out.stderr.strip() or out.returncode}"
            return
        self.mounted = True

    def start_store(self, segment: str = "64MB") -> str:
        """Start a master and a storage node; returns the master's address ("" and a reason when impossible)."""
        from kvconnect.offload.tiers.local_store import LocalStore

        logs = self.root / "store-logs"
        logs.mkdir(exist_ok=True)
        try:
            self.store = LocalStore(logs, segment=segment).start()
        except Exception as exc:  # no Mooncake binaries here: the store faults are reported as not made
            for kind in ("master_restart", "master_stall", "flip_store"):
                self.not_made[kind] = f"no Mooncake Store: {exc}"
            self.store = None
            return ""
        self._raw_client()
        return self.store.address

    def _raw_client(self) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore

            raw = MooncakeDistributedStore()
            if raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.store.address) == 0:
                self.raw = raw
                return
        except Exception as exc:
            self.not_made["flip_store"] = f"no raw Mooncake client: {exc}"
            return
        self.not_made["flip_store"] = "the raw Mooncake client could not reach the master"

    # ---- faults ----

    def flip_disk(self, rng: np.random.Generator) -> str:
        """Flip one byte of one of the disk tier's files (a header, index or page byte); "" if none exists."""
        files = sorted(p for p in self.tier_dir.iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            return ""
        path = files[int(rng.integers(0, len(files)))]
        try:
            size = path.stat().st_size
            if size == 0:
                return ""
            pos = int(rng.integers(0, min(size, 64))) if rng.random() < 0.3 else int(rng.integers(0, size))
            with open(path, "r+b") as f:
                f.seek(pos)
                byte = f.read(1)
                f.seek(pos)
                f.write(bytes([byte[0] ^ (1 << int(rng.integers(0, 8)))]))
        except (OSError, IndexError):
            return ""  # the tier removed it meanwhile
        return f"{path.name} byte {pos} of {size}"

    def flip_store(self, name: str, rng: np.random.Generator) -> str:
        """Rewrite store object `name` with one bit flipped (same length); "" when it is not there."""
        if self.raw is None:
            return ""
        blob = self.raw.get(name)
        if not blob:
            return ""
        data = bytearray(blob)
        pos = int(rng.integers(0, len(data)))
        data[pos] ^= 1 << int(rng.integers(0, 8))
        if self.raw.upsert(name, bytes(data)) != 0:
            return ""
        return f"{name[-12:]} byte {pos} of {len(data)}"

    def fill(self) -> int:
        """Fill the disk tier's filesystem to the last block; the bytes written (0 where no tmpfs was mounted)."""
        if not self.mounted:
            return 0
        st = os.statvfs(self.disk_root)
        free = st.f_bavail * st.f_frsize
        written = 0
        try:
            with open(self.fill_dir / "filler", "ab") as f:
                while written < free:
                    written += f.write(b"\0" * min(1 << 20, free - written))
        except OSError:
            pass  # full: that was the point
        return written

    def unfill(self) -> None:
        """Give the filesystem its space back."""
        (self.fill_dir / "filler").unlink(missing_ok=True)

    def kill_master(self) -> None:
        """SIGKILL the master, as a crash would."""
        self.store.kill_master()

    def start_master(self) -> None:
        """Start the master again on its port (it knows no objects: its metadata was in memory)."""
        self.store.start_master()

    def close(self) -> None:
        """Stop the store, unmount the tmpfs and remove the directory."""
        if self.raw is not None:
            try:
                self.raw.close()
            except Exception:
                pass
        if self.store is not None:
            self.store.stop()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.disk_root)], capture_output=True, timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)
