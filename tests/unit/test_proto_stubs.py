"""The committed gRPC stubs are exactly what the .proto files generate (they cannot drift)."""

import shutil

from rlep.services.cli.protogen import package_roots, proto_files, stale_stubs


def test_committed_stubs_match_the_protos():
    assert stale_stubs() == [], "run `rlep proto gen` and commit the result"


def test_every_service_has_a_versioned_proto():
    names = proto_files()
    assert {"rlep/common/v1/trajectory.proto", "rlep/verifier/v1/verifier.proto"} <= set(names)
    assert all(name.split("/")[0] == "rlep" and name.split("/")[-2] == "v1" for name in names)
    # The stubs of each proto import from the package named by its path.
    assert all(path.as_posix().endswith(name.removeprefix("rlep/common")) for name, path in names.items())


def test_a_changed_proto_is_detected(tmp_path):
    copies = {prefix: tmp_path / prefix.replace("/", "_") for prefix in package_roots()}
    for prefix, folder in package_roots().items():
        shutil.copytree(folder, copies[prefix], ignore=shutil.ignore_patterns("__pycache__"))
    path = proto_files(copies)["rlep/verifier/v1/verifier.proto"]
    path.write_text(path.read_text().replace("double seconds = 4;", "double seconds = 4;\n  int32 probe = 99;"))
    stale = stale_stubs(copies)
    assert "rlep/verifier/v1/verifier_pb2.py" in stale
    assert not any(name.startswith(("rlep/replay", "rlep/common")) for name in stale)
