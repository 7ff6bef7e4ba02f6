"""deep_ep.jit.nccl_headers: NCCL headers come from the loaded or wheel libnccl, versions are checked."""

from __future__ import annotations

import dataclasses
import re

import pytest
from deep_ep.jit import NCCLVersionMismatchError
from deep_ep.jit.nccl_headers import (
    check_versions,
    find_nccl,
    loaded_libraries,
    parse_version_code,
    runtime_version,
    tree_digest,
    version_string,
)


def test_headers_come_from_the_nccl_wheel_never_the_system():
    install = find_nccl()
    assert (install.include_dir / "nccl.h").is_file() and (install.include_dir / "nccl_device.h").is_file()
    assert install.include_dir.parts[-3:] == ("nvidia", "nccl", "include")
    assert not str(install.include_dir).startswith(("/usr/include", "/usr/local/include"))
    assert install.origin == "loaded" or install.origin.startswith("wheel nvidia-nccl-cu1")
    text = (install.include_dir / "nccl.h").read_text()
    major, minor, patch = (
        int(re.search(rf"#define NCCL_{p} (\d+)", text).group(1)) for p in ("MAJOR", "MINOR", "PATCH")
    )
    assert version_string(install.header_version) == f"{major}.{minor}.{patch}"
    assert parse_version_code(install.include_dir / "nccl.h") == install.header_version


def test_runtime_version_of_the_loaded_library_matches_the_headers():
    install = find_nccl()
    assert runtime_version(install) == install.header_version
    # Asking loaded the library: it is now found in /proc/self/maps, and it is the only libnccl.
    assert [p.resolve() for p in loaded_libraries()] == [install.lib_path.resolve()]
    assert find_nccl().origin == "loaded" and find_nccl().include_dir == install.include_dir
    assert check_versions() == find_nccl()


def test_a_version_mismatch_is_a_clear_error():
    install = find_nccl()
    other = dataclasses.replace(install, header_version=22809 if install.header_version != 22809 else 23203)
    with pytest.raises(NCCLVersionMismatchError) as caught:
        check_versions(other)
    message = str(caught.value)
    assert version_string(other.header_version) in message and version_string(install.header_version) in message
    assert str(install.lib_path) in message


def test_version_strings_and_tree_digest():
    assert version_string(22809) == "2.28.9" and version_string(23203) == "2.32.3" and version_string(2708) == "2.7.8"
    digest = tree_digest(find_nccl().include_dir)
    assert re.fullmatch(r"[0-9a-f]{64}", digest) and tree_digest(find_nccl().include_dir) == digest
