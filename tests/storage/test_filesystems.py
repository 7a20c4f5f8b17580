"""Which local paths lie on shared file systems (:mod:`reshard.storage.filesystems`), and the overrides of
:class:`~reshard.storage.LocalStorage`.

The mountinfo texts are written by hand in the format of proc(5), as the named hosts show them (NFS v3 and
v4, Lustre, GPFS, CephFS, BeeGFS, FUSE mounts of object stores and local FUSE, CIFS, 9p, WekaFS); statfs is
asked about this machine's real file systems.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from reshard.errors import CheckpointError
from reshard.io.sources import ReshardCheckpoint
from reshard.storage import LocalStorage
from reshard.storage.filesystems import (
    MAGIC_TYPES,
    SHARED_ENV,
    detect_sharing,
    is_shared_type,
    mount_of,
    parse_mountinfo,
    sharing_from_env,
    statfs_type,
)

pytestmark = pytest.mark.unit

CLUSTER_NODE = r"""22 1 253:0 / / rw,relatime shared:1 - xfs /dev/mapper/rhel-root rw,seclabel,attr2,inode64,noquota
23 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:5 - proc proc rw
25 22 0:23 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,seclabel
45 22 0:43 / /home rw,relatime shared:30 - nfs4 nas01:/export/home rw,vers=4.2,hard,proto=tcp,sec=sys
46 22 0:44 / /mnt/ckpt rw,relatime shared:31 - nfs 10.0.0.3:/ckpt rw,vers=3,hard,proto=tcp,addr=10.0.0.3
120 22 0:52 / /lustre/scratch rw,relatime shared:60 - lustre 10.1.0.1@o2ib:10.1.0.2@o2ib:/scratch rw,flock,lazystatfs
130 22 0:60 / /gpfs/fs1 rw,relatime shared:70 - gpfs fs1 rw
140 22 0:61 / /mnt/cephfs rw,relatime shared:80 - ceph 10.2.0.1:6789,10.2.0.2:6789:/ rw,name=admin,secret=<hidden>,acl
150 22 0:62 / /mnt/beegfs rw,relatime shared:90 - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf
160 22 0:63 / /mnt/s3 rw,nosuid,nodev,relatime shared:100 - fuse.s3fs s3fs rw,user_id=0,group_id=0,allow_other
161 22 0:64 / /mnt/gcs rw,nosuid,nodev,relatime shared:101 master:7 - fuse.gcsfuse my-bucket rw,user_id=1000
170 22 0:65 / /var/lib/lxcfs rw,nosuid,nodev,relatime shared:110 - fuse.lxcfs lxcfs rw,user_id=0,group_id=0,allow_other
171 22 8:17 / /media/usb rw,nosuid,nodev,relatime shared:111 - fuseblk /dev/sdb1 rw,user_id=0,blksize=4096
180 22 0:66 / /mnt/share rw,relatime shared:120 - cifs //fileserver/share rw,vers=3.1.1,cache=strict,username=u,soft
190 22 0:67 / /mnt/host rw,relatime - 9p hostshare rw,sync,dirsync,access=client,trans=virtio
200 22 0:68 / /mnt/weka rw,relatime shared:130 - wekafs default rw,writecache,inode_bits=auto
210 22 0:70 / /mnt/my\040ckpts rw,relatime shared:140 - nfs4 nas:/x rw,vers=4.1
220 46 253:1 / /mnt/ckpt/local rw,relatime shared:150 - ext4 /dev/vdb rw
"""
"""A cluster node: an xfs root, NFS home and checkpoints (with an ext4 disk mounted inside the NFS tree),
Lustre, GPFS, CephFS, BeeGFS, s3fs and gcsfuse, lxcfs and an NTFS stick (local FUSE), CIFS, 9p, WekaFS, and
a mount point with a space (escaped as ``\\040``)."""

STACKED = """27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 27 0:44 / /ckpt rw,relatime - nfs4 nas:/ckpt rw,vers=4.2
41 40 0:45 / /ckpt rw,relatime - tmpfs tmpfs rw,size=1024k
"""
"""Two mounts on one point: the later one hides the first."""


@pytest.mark.parametrize(
    ("path", "shared", "said"),
    [
        ("/mnt/ckpt/run-1/step_000001000", True, "is nfs (a shared file system, mounted at /mnt/ckpt)"),
        ("/home/alice/ckpt", True, "is nfs4 (a shared file system, mounted at /home)"),
        ("/lustre/scratch/run", True, "is lustre (a shared file system"),
        ("/gpfs/fs1/ckpt", True, "is gpfs (a shared file system"),
        ("/mnt/cephfs/ckpt", True, "is ceph (a shared file system"),
        ("/mnt/beegfs/ckpt", True, "is beegfs (a shared file system"),
        ("/mnt/s3/run", True, "is fuse.s3fs (a FUSE mount, taken as a shared file system"),
        ("/mnt/gcs/run", True, "is fuse.gcsfuse (a FUSE mount"),
        ("/mnt/share/ckpt", True, "is cifs (a shared file system"),
        ("/mnt/host/ckpt", True, "is 9p (a shared file system"),
        ("/mnt/weka/ckpt", True, "is wekafs (a shared file system"),
        ("/mnt/my ckpts/step", True, "is nfs4 (a shared file system, mounted at /mnt/my ckpts)"),
        ("/mnt/ckpt/local/step", False, "is ext4 (local, mounted at /mnt/ckpt/local)"),
        ("/mnt/ckpt2/step", False, "is xfs (local, mounted at /)"),  # not inside /mnt/ckpt
        ("/var/lib/lxcfs/proc", False, "is fuse.lxcfs (local"),
        ("/media/usb/ckpt", False, "is fuseblk (local"),
        ("/dev/shm/ckpt", False, "is tmpfs (local, mounted at /dev/shm)"),
        ("/scratch/ckpt", False, "is xfs (local, mounted at /)"),
    ],
)
def test_the_longest_mount_point_decides(path: str, shared: bool, said: str) -> None:
    sharing = detect_sharing(path, mountinfo=CLUSTER_NODE)
    assert sharing.shared is shared
    assert sharing.reason == f"{path} {said}" or sharing.reason.startswith(f"{path} {said}")


def test_mountinfo_fields_per_proc5() -> None:
    mounts = parse_mountinfo(CLUSTER_NODE + "garbage line\n\n")
    assert len(mounts) == 18
    assert mounts[3].mount_point == "/home" and mounts[3].fstype == "nfs4" and mounts[3].source == "nas01:/export/home"
    gcs = mount_of("/mnt/gcs/a", mounts)
    assert gcs is not None and gcs.fstype == "fuse.gcsfuse" and gcs.source == "my-bucket"  # two optional fields


def test_of_two_mounts_on_one_point_the_last_hides_the_first() -> None:
    assert detect_sharing("/ckpt/step", mountinfo=STACKED).reason == "/ckpt/step is tmpfs (local, mounted at /ckpt)"
    mounts = parse_mountinfo(STACKED)
    assert mount_of("/ckpt", mounts[:2]) == mounts[1]


@pytest.mark.parametrize(
    ("fstype", "shared"),
    [("nfs4", True), ("NFS", True), ("fuse.rclone", True), ("fuse", True), ("fuse.fuse-overlayfs", False),
     ("overlay", False), ("virtiofs", False), ("zfs", False), ("orangefs", True), ("pvfs2", True)],
)  # fmt: skip
def test_type_strings(fstype: str, shared: bool) -> None:
    assert is_shared_type(fstype) is shared


def test_statfs_of_this_machines_file_systems() -> None:
    """What the kernel says: /proc is procfs everywhere on Linux, /dev/shm is tmpfs where it is mounted as
    such, and statfs names the same type as mountinfo for the test's own directory."""
    if os.uname().sysname != "Linux":
        pytest.skip("statfs is asked on Linux only")
    assert statfs_type("/proc") == 0x9FA0
    sharing = detect_sharing("/proc", mountinfo="")  # through statfs alone
    assert sharing.shared is False and sharing.reason == "/proc is proc (local)"
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    shm = mount_of("/dev/shm", mounts)
    if shm is not None and shm.fstype == "tmpfs":
        assert statfs_type("/dev/shm") == 0x01021994
        assert detect_sharing("/dev/shm").reason == "/dev/shm is tmpfs (local, mounted at /dev/shm)"
    assert statfs_type("/no/such/path/at/all") is None


def test_statfs_and_mountinfo_agree_on_the_tests_directory(tmp_path: Path) -> None:
    mount = mount_of(os.path.realpath(tmp_path), parse_mountinfo(Path("/proc/self/mountinfo").read_text()))
    assert mount is not None
    magic = statfs_type(str(tmp_path))
    assert magic is not None
    if magic in MAGIC_TYPES and MAGIC_TYPES[magic] != "ext4":  # ext2/3/4 share one magic number
        assert MAGIC_TYPES[magic] == mount.fstype.split(".")[0]
    both = detect_sharing(str(tmp_path))
    alone = detect_sharing(str(tmp_path), mountinfo="")  # statfs, as where mountinfo cannot be read
    assert both.shared is alone.shared is is_shared_type(mount.fstype)
    assert both.reason.startswith(f"{tmp_path} is {mount.fstype} (")


def test_a_path_not_yet_created_is_judged_by_its_nearest_existing_ancestor(tmp_path: Path) -> None:
    assert detect_sharing(str(tmp_path / "a" / "b"), mountinfo="").reason.startswith(f"{tmp_path / 'a' / 'b'} is ")


def test_elsewhere_than_linux_a_path_is_local_and_the_reason_says_so() -> None:
    sharing = detect_sharing("/Volumes/ckpt", mountinfo=CLUSTER_NODE, platform="darwin")
    assert sharing.shared is False
    assert sharing.reason == "/Volumes/ckpt: the file system type is not detected on darwin (taken as local)"


def test_the_environment_overrides_the_detection() -> None:
    assert sharing_from_env("/x", {}) is None
    assert sharing_from_env("/x", {SHARED_ENV: ""}) is None
    on = sharing_from_env("/x", {SHARED_ENV: "1"})
    assert on is not None and on.shared and on.reason == f"{SHARED_ENV}=1 (/x taken as shared)"
    off = sharing_from_env("/x", {SHARED_ENV: "False"})
    assert off is not None and not off.shared
    with pytest.raises(CheckpointError, match=f"{SHARED_ENV}='maybe': expected 1"):
        sharing_from_env("/x", {SHARED_ENV: "maybe"})


def test_local_storage_decides_once_and_passes_its_override_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forced = LocalStorage(tmp_path, shared=True)
    assert forced.sharing().shared and forced.sharing().reason == f"LocalStorage(shared=True) for {tmp_path}"
    assert forced.child("step_1").sharing().shared and forced.sibling("other").sharing().shared
    assert not LocalStorage(tmp_path, shared=False).child("x").sharing().shared
    monkeypatch.setenv(SHARED_ENV, "1")
    assert LocalStorage(tmp_path).sharing().reason == f"{SHARED_ENV}=1 ({tmp_path} taken as shared)"
    assert not LocalStorage(tmp_path, shared=False).sharing().shared  # the constructor beats the environment
    storage = LocalStorage(tmp_path)
    first = storage.sharing()
    monkeypatch.setenv(SHARED_ENV, "0")
    assert storage.sharing() is first  # decided once per storage object
    monkeypatch.setenv(SHARED_ENV, "yes please")
    with pytest.raises(CheckpointError, match=SHARED_ENV):
        LocalStorage(tmp_path).sharing()


def test_a_checkpoints_reading_storage_keeps_the_override(tmp_path: Path) -> None:
    source = ReshardCheckpoint(LocalStorage(tmp_path, shared=True))
    try:
        assert source.storage.sharing() == LocalStorage(tmp_path, shared=True).sharing()
    finally:
        source.close()


def test_an_existing_path_is_judged_by_its_device_looking_at_nothing_above_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The detection once resolved the path with realpath, which looks at every directory above the checkpoint
    (the contract suite's audit caught a restore stat-ing the directories above its sandbox). An existing path is
    now judged by its file system's device, from one stat of the path itself, even where its name lies under no
    mount point of the table."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    device = os.stat(checkpoint).st_dev
    table = f"36 25 {os.major(device)}:{os.minor(device)} / /elsewhere rw,relatime - nfs4 server:/export rw\n"
    looked_at: list[str] = []
    for name in ("stat", "lstat"):
        original = getattr(os, name)

        def recorded(path: object, *args: object, _original: object = original, **kwargs: object) -> object:
            looked_at.append(os.path.abspath(os.fspath(path)))  # type: ignore[arg-type]
            return _original(path, *args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(os, name, recorded)
    sharing = detect_sharing(str(checkpoint), mountinfo=table)
    monkeypatch.undo()
    assert sharing.shared and sharing.reason == f"{checkpoint} is nfs4 (a shared file system, mounted at /elsewhere)"
    assert looked_at and all(path == str(checkpoint) for path in looked_at), looked_at
