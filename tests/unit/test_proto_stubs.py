"""The committed gRPC stubs are exactly what the .proto files generate (they cannot drift)."""

from rlep_common.protogen import PROTO_ROOT, proto_files, stale_stubs


def test_committed_stubs_match_the_protos():
    assert stale_stubs() == [], "run `rlep proto gen` and commit the result"


def test_every_service_has_a_versioned_proto():
    names = {str(p) for p in proto_files()}
    assert "rlep/verifier/v1/verifier.proto" in names
    assert all(p.parts[0] == "rlep" and p.parts[2] == "v1" for p in proto_files(PROTO_ROOT))


def test_a_changed_proto_is_detected(tmp_path):
    import shutil

    copy = tmp_path / "proto"
    shutil.copytree(PROTO_ROOT, copy)
    path = copy / "rlep/verifier/v1/verifier.proto"
    path.write_text(path.read_text().replace("double seconds = 4;", "double seconds = 4;\n  int32 extra = 5;"))
    assert "rlep/verifier/v1/verifier_pb2.py" in stale_stubs(copy)
