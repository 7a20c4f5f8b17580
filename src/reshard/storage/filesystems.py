"""Whether a local path lies on a file system that many nodes share (NFS, Lustre, GPFS, CephFS, BeeGFS, FUSE
mounts of object stores, ...): there storage bandwidth limits a cold load, so the replicas of a load read each
byte once between them (``LoadOptions(read_once=None)``, the default); on a local disk they do not.

The type of the file system comes from ``/proc/self/mountinfo`` (proc(5): the longest mount point that holds
the resolved path; of several mounts on one point, the last, which hides the others), whose type string names
FUSE subtypes (``fuse.s3fs``); where that file cannot be read or names no mount, from ``statfs(2)``'s
``f_type`` (Linux, through ctypes). Elsewhere, or when neither answers, the path is taken as local and the
reason says so. A user overrides the decision with ``LocalStorage(path, shared=True|False)`` or the
environment variable :data:`SHARED_ENV` (``1`` or ``0``); :class:`~reshard.storage.LocalStorage` decides
once per storage object.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from reshard.errors import CheckpointError

__all__ = [
    "MOUNTINFO",
    "SHARED_ENV",
    "Mount",
    "Sharing",
    "detect_sharing",
    "is_shared_type",
    "mount_of",
    "mount_of_device",
    "parse_mountinfo",
    "sharing_from_env",
    "statfs_type",
]

SHARED_ENV = "RESHARD_SHARED_FILESYSTEM"
"""The environment variable that overrides the detection for every local path: ``1`` (shared), ``0`` (local)."""

MOUNTINFO = "/proc/self/mountinfo"

SHARED_TYPES = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "ceph", "beegfs", "fhgfs", "cifs", "smb3", "smbfs", "9p", "wekafs",
        "pvfs2", "orangefs", "afs", "openafs", "coda", "glusterfs", "panfs", "gfs2", "ocfs2", "ncpfs", "cvfs",
    }
)  # fmt: skip
"""Type strings of mountinfo that name a file system shared by many nodes (network or cluster file systems)."""

LOCAL_FUSE = frozenset(
    {
        "lxcfs", "fuse-overlayfs", "squashfuse", "squashfuse_ll", "portal", "xdg-document-portal", "gvfsd-fuse",
        "bindfs", "ntfs-3g", "exfat", "erofsfuse", "archivemount", "fuse-zip",
    }
)  # fmt: skip
"""FUSE subtypes (``fuse.<subtype>``) that serve local data; every other FUSE mount (s3fs, gcsfuse, goofys,
rclone, mountpoint-s3, blobfuse2, juicefs, glusterfs, sshfs, ...) is taken as shared."""

MAGIC_TYPES: Mapping[int, str] = {
    # shared: include/uapi/linux/magic.h and the projects' own sources (Lustre's LL_SUPER_MAGIC, BeeGFS's
    # FhgfsOpsSuper.h, GPFS and PanFS as ROMIO and coreutils' stat name them)
    0x6969: "nfs",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x00C36400: "ceph",
    0x19830326: "beegfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb3",
    0x517B: "smbfs",
    0x01021997: "9p",
    0x20030528: "orangefs",
    0x5346414F: "afs",
    0x6B414653: "afs",
    0x73757245: "coda",
    0xAAD7AAEA: "panfs",
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
    0x564C: "ncpfs",
    0x65735546: "fuse",
    # local, to name them
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlay",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0x73717368: "squashfs",
    0x9FA0: "proc",
}
"""``statfs(2)`` ``f_type`` values and the type string mountinfo would give (``ext4`` stands for ext2/3/4)."""


@dataclass(frozen=True)
class Sharing:
    """Whether a storage is shared by many nodes (an object store, a shared file system), so that a load's
    replicas should read each byte once between them, and why, in words (``/mnt/ckpt is nfs4 (a shared file
    system, mounted at /mnt/ckpt)``)."""

    shared: bool
    reason: str


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo: where it is mounted, its type string and its source."""

    mount_point: str
    fstype: str
    source: str
    device: str = ""
    """``major:minor`` of the mounted file system (what ``stat`` gives as ``st_dev`` for every file in it)."""


def _unescape(field: str) -> str:
    """A mountinfo path with its octal escapes (``\\040`` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text (proc(5): id, parent, major:minor, root, mount point, options, optional
    fields, ``-``, type, source, super options), in file order; malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if len(fields) < separator + 3:
            continue
        mounts.append(
            Mount(_unescape(fields[4]), fields[separator + 1], _unescape(fields[separator + 2]), device=fields[2])
        )
    return mounts


def _contains(mount_point: str, path: str) -> bool:
    return mount_point in ("/", path) or path.startswith(mount_point.rstrip("/") + "/")


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount that holds the absolute, resolved ``path``: the longest mount point that contains it; of
    several on the same point, the last (mounted over the others)."""
    best: Mount | None = None
    for mount in mounts:
        if _contains(mount.mount_point, path) and (best is None or len(mount.mount_point) >= len(best.mount_point)):
            best = mount
    return best


def mount_of_device(device: str, mounts: list[Mount]) -> Mount | None:
    """The mount of the file system ``device`` (``major:minor``): the last listed (of bind mounts of one file
    system, every one has its type), or None."""
    found = [mount for mount in mounts if mount.device == device]
    return found[-1] if found else None


def _device_of(path: str) -> str | None:
    """``major:minor`` of the file system that holds ``path`` (one ``stat`` of ``path`` itself: nothing above it is
    looked at), or None where it does not exist."""
    try:
        st_dev = os.stat(path).st_dev
    except OSError:
        return None
    return f"{os.major(st_dev)}:{os.minor(st_dev)}"


def is_shared_type(fstype: str) -> bool:
    """Whether a mountinfo type string names a shared file system: a network or cluster file system, or a
    FUSE mount other than the known local ones (``fuseblk`` is a local block device's)."""
    name = fstype.lower()
    if name.startswith("fuse."):
        return name[len("fuse.") :] not in LOCAL_FUSE
    return name == "fuse" or name in SHARED_TYPES


@functools.cache
def _statfs() -> Callable[[bytes, ctypes.Array[ctypes.c_char]], int] | None:
    """libc's ``statfs`` (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).statfs
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    function.restype = ctypes.c_int
    return function


def statfs_type(path: str) -> int | None:
    """``f_type`` of ``statfs(2)`` for ``path`` (the first field of ``struct statfs`` on every Linux ABI, a
    32-bit magic number), or None where there is no statfs or it fails."""
    function = _statfs()
    if function is None:
        return None
    buffer = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on x86_64, less elsewhere
    if function(os.fsencode(path), buffer) != 0:
        return None
    if sys.byteorder == "big" and ctypes.sizeof(ctypes.c_long) == 8:  # s390x's f_type is 32-bit: try both
        wide = ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF
        return wide if wide else ctypes.c_uint32.from_buffer(buffer).value
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def _existing(resolved: str) -> str:
    """The resolved path, or its nearest existing ancestor: what statfs can be asked."""
    while not os.path.exists(resolved) and os.path.dirname(resolved) != resolved:
        resolved = os.path.dirname(resolved)
    return resolved


def _decided(path: str, fstype: str, mount_point: str | None) -> Sharing:
    where = f", mounted at {mount_point}" if mount_point else ""
    if not is_shared_type(fstype):
        return Sharing(False, f"{path} is {fstype} (local{where})")
    if fstype.lower() == "fuse" or fstype.lower().startswith("fuse."):
        return Sharing(True, f"{path} is {fstype} (a FUSE mount, taken as a shared file system{where})")
    return Sharing(True, f"{path} is {fstype} (a shared file system{where})")


def detect_sharing(path: str, *, mountinfo: str | None = None, platform: str = sys.platform) -> Sharing:
    """Whether the local ``path`` lies on a shared file system, and why. ``mountinfo``: the text to use instead
    of :data:`MOUNTINFO` (tests); never raises (an unknown type is local, and the reason says so)."""
    if not platform.startswith("linux"):
        return Sharing(False, f"{path}: the file system type is not detected on {platform} (taken as local)")
    if mountinfo is None:
        try:
            with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as file:
                mountinfo = file.read()
        except OSError:
            mountinfo = ""
    mounts = parse_mountinfo(mountinfo)
    device = _device_of(path)
    if device is not None:  # by the file system's device: no directory above the checkpoint is looked at
        mount = mount_of_device(device, mounts) or mount_of(os.path.abspath(path), mounts)
        probe = path
    else:  # not created yet: by its name, links followed, and statfs of its nearest existing ancestor
        resolved = os.path.realpath(path)
        mount, probe = mount_of(resolved, mounts), _existing(resolved)
    if mount is not None:
        return _decided(path, mount.fstype, mount.mount_point)
    magic = statfs_type(probe)
    if magic is None:
        return Sharing(False, f"{path}: the file system type is unknown (no mountinfo, no statfs; taken as local)")
    if magic not in MAGIC_TYPES:
        return Sharing(False, f"{path}: file system type {magic:#x} (not a known shared one: taken as local)")
    return _decided(path, MAGIC_TYPES[magic], None)


def sharing_from_env(path: str, environ: Mapping[str, str] = os.environ) -> Sharing | None:
    """The user's override in :data:`SHARED_ENV` (``1``/``true``: shared, ``0``/``false``: local), or None
    where it is unset or empty.

    Raises:
        CheckpointError: any other value (an override reshard cannot read is not ignored).
    """
    raw = environ.get(SHARED_ENV, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value not in ("1", "0", "true", "false"):
        raise CheckpointError(
            f"{SHARED_ENV}={raw!r}: expected 1 (local paths are on a shared file system: loads read once by "
            "default) or 0 (they are local), or unset to detect it"
        )
    shared = value in ("1", "true")
    return Sharing(shared, f"{SHARED_ENV}={raw} ({path} taken as {'shared' if shared else 'local'})")
