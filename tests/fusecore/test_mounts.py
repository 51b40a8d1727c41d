from fusecore.process.mounts import mount_entries


def test_mountinfo_parsing_unescapes_paths(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "40 22 0:40 / /mnt/with\\040space rw,nosuid shared:2 - fuse.stoker stoker:b ro,user_id=0\n"
        "41 22 0:41 / /a\\134b rw - tmpfs tmpfs rw\n")
    assert mount_entries(str(info)) == [("/", "ext4"), ("/mnt/with space", "fuse.stoker"), ("/a\\b", "tmpfs")]
