"""The wire schema: round trips, strict validation at the edge, size limits, compatibility checks."""

from __future__ import annotations

import ast
import math
import os
import pathlib
import pickle

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import msgpack_values
import kvconnect
from kvconnect import wire
from kvconnect.compat import IncompatiblePeerError, check_compat, layers_digest
from kvconnect.sidechannel.auth import MAC_BYTES, new_nonce, reply_mac, request_mac
from kvconnect.wire import (
    Abort,
    Compat,
    Done,
    EngineMetadata,
    GroupCompat,
    Heartbeat,
    RegionMeta,
    TransferParams,
    WireError,
)

PACKAGE = pathlib.Path(kvconnect.__file__).parent


def region(**overrides: object) -> RegionMeta:
    fields = dict(
        names=("model.layers.0.attn",),
        base_addr=0x7F00_0000_0000,
        num_blocks=8,
        block_bytes=4096,
        block_stride=4096,
        device_id=0,
        memory_kind="VRAM",
    )
    fields.update(overrides)
    return RegionMeta(**fields)


def metadata(**overrides: object) -> EngineMetadata:
    fields = dict(
        engine_id="prefill-0",
        incarnation=wire.process_incarnation(),
        rank=0,
        world_size=2,
        transport="nixl",
        transport_metadata=b"\x00agent-blob\xff",
        regions=(region(), region(names=("model.layers.1.attn",), base_addr=0x7F10_0000_0000)),
        group_regions=((0, 1),),
        block_size=16,
        layout="LBHNC",
        dtype="bfloat16",
    )
    fields.update(overrides)
    fields.setdefault("compat", compat(fields))
    return EngineMetadata(**fields)


def compat(fields: dict, **overrides: object) -> Compat:
    """The compatibility fingerprint of metadata with these fields (one attention group)."""
    group = GroupCompat(label="attention", block_size=fields["block_size"],
                       page_bytes=tuple(r.block_bytes for r in fields["regions"]),
                       layers=layers_digest([r.names for r in fields["regions"]]))
    values = dict(transport=fields["transport"], layout=fields["layout"], dtype=fields["dtype"],
                  block_size=fields["block_size"], groups=(group,))
    values.update(overrides)
    return Compat(**values)


def params(**overrides: object) -> TransferParams:
    fields = dict(
        engine_id="prefill-0",
        host="10.0.0.7",
        port=5600,
        request_id="req-1",
        block_ids=[[3, 4, 5], [9]],
        num_tokens=40,
        lease_expiry=1_900_000_000.5,
        incarnation="0" * 32,
    )
    fields.update(overrides)
    return TransferParams(**fields)


def as_dict(struct: msgspec.Struct) -> dict:
    """The message as plain msgpack objects (bytes stay bytes), ready to be tampered with."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(struct))


# --------------------------------------------------------------------------------------------------
# Round trips


def test_metadata_round_trips_through_msgpack() -> None:
    meta = metadata()
    assert wire.METADATA.decode(wire.METADATA.encode(meta)) == meta


def test_metadata_must_agree_with_their_groups() -> None:
    fields = as_dict(metadata())
    for bad in ([[0, 5]], [[0], [1]]):  # a region past the list; more groups than the fingerprint has
        with pytest.raises(WireError):
            wire.METADATA.decode(msgspec.msgpack.encode({**fields, "group_regions": bad}))


def test_transfer_params_round_trip_msgpack_and_json_builtins() -> None:
    p = params()
    assert wire.TRANSFER_PARAMS.decode(wire.TRANSFER_PARAMS.encode(p)) == p
    via_json = msgspec.json.decode(msgspec.json.encode(wire.transfer_params_to_builtins(p)))
    assert wire.transfer_params_from_builtins(via_json) == p


@pytest.mark.parametrize(
    "note",
    [
        Done(engine_id="decode-0", rank=1, request_ids=("req-1",)),
        Abort(engine_id="decode-0", rank=0, request_ids=("req-2", "req-3"), reason="client went away"),
        Heartbeat(engine_id="decode-0", rank=0, request_ids=("req-1", "req-2")),
        Heartbeat(engine_id="decode-0", rank=0, request_ids=()),
    ],
)
def test_control_messages_round_trip_as_one_tagged_union(note: msgspec.Struct) -> None:
    decoded = wire.REQUEST.decode(wire.REQUEST.encode(note))
    assert type(decoded) is type(note)
    assert decoded == note


def test_handshake_envelopes_round_trip() -> None:
    env = wire.RequestEnvelope(
        protocol_version=wire.PROTOCOL_VERSION,
        body=wire.REQUEST.encode(wire.HandshakeRequest(rank=3)),
        nonce=new_nonce(),
        timestamp=1_700_000_000.25,
        mac=b"m" * 32,
    )
    assert wire.REQUEST_ENVELOPE.decode(wire.REQUEST_ENVELOPE.encode(env)) == env
    assert wire.REQUEST.decode(env.body) == wire.HandshakeRequest(rank=3)
    replies = [
        wire.HandshakeReply(compat=metadata().compat, payload=wire.METADATA.encode(metadata())),
        wire.HandshakeRejection(reason="replay", detail="nonce reused"),
        wire.ClaimReply(granted_s={"req-1": 30.0}, refused={"req-2": "lease expired"}, incarnation="inc-1"),
        wire.Ack(live=("req-1",)),
    ]
    for reply in replies:
        decoded = wire.REPLY.decode(wire.REPLY.encode(reply))
        assert type(decoded) is type(reply) and decoded == reply


@pytest.mark.parametrize(
    "msg",
    [
        wire.HandshakeRequest(rank=1),
        wire.Claim(engine_id="decode-0", rank=0, request_ids=("req-1", "req-2"), need_s=12.5, incarnation="inc-1"),
        Done(engine_id="decode-0", rank=0, request_ids=("req-1",)),
        Abort(engine_id="decode-0", rank=0, request_ids=("req-1",)),
        Heartbeat(engine_id="decode-0", rank=0, request_ids=("req-1",)),
    ],
)
def test_request_bodies_round_trip_as_one_tagged_union(msg: msgspec.Struct) -> None:
    decoded = wire.REQUEST.decode(wire.REQUEST.encode(msg))
    assert type(decoded) is type(msg) and decoded == msg


@pytest.mark.parametrize("need_s", [-1.0, math.nan, math.inf, 1e9])
def test_claim_refuses_unbounded_or_negative_need(need_s: float) -> None:
    fields = as_dict(wire.Claim(engine_id="d", rank=0, request_ids=("r",), need_s=1.0, incarnation="inc-1"))
    with pytest.raises(WireError, match="need_s"):
        wire.REQUEST.decode(msgspec.msgpack.encode({**fields, "need_s": need_s}))


# --------------------------------------------------------------------------------------------------
# Strictness


def test_unknown_fields_are_rejected_everywhere() -> None:
    cases = [
        (wire.METADATA.decode, as_dict(metadata())),
        (wire.TRANSFER_PARAMS.decode, as_dict(params())),
        (wire.REQUEST.decode, as_dict(Done(engine_id="e", rank=0, request_ids=("r",)))),
        (wire.REQUEST.decode, {"kind": "metadata", "rank": 0}),
        (wire.REQUEST.decode, as_dict(wire.Claim(engine_id="e", rank=0, request_ids=("r",), need_s=1.0, incarnation="inc-1"))),
        (wire.REPLY.decode, as_dict(wire.Ack(live=("r",)))),
        (wire.REQUEST_ENVELOPE.decode, {"protocol_version": wire.PROTOCOL_VERSION, "body": b""}),
        (wire.REPLY_ENVELOPE.decode, {"protocol_version": wire.PROTOCOL_VERSION, "body": b""}),
    ]
    for decode, fields in cases:
        decode(msgspec.msgpack.encode(fields))  # the untouched message is fine
        with pytest.raises(WireError, match="unknown field"):
            decode(msgspec.msgpack.encode({**fields, "extra": 1}))


def test_unknown_fields_inside_nested_structs_are_rejected() -> None:
    fields = as_dict(metadata())
    fields["regions"][0]["pinned"] = True
    with pytest.raises(WireError, match="unknown field"):
        wire.METADATA.decode(msgspec.msgpack.encode(fields))


def test_wrong_types_are_rejected_not_coerced() -> None:
    fields = as_dict(metadata())
    fields["rank"] = "0"
    with pytest.raises(WireError, match="rank"):
        wire.METADATA.decode(msgspec.msgpack.encode(fields))
    fields = wire.transfer_params_to_builtins(params())
    fields["port"] = "5600"
    with pytest.raises(WireError, match="port"):
        wire.transfer_params_from_builtins(fields)


def test_rank_must_be_below_world_size() -> None:
    fields = as_dict(metadata())
    fields["rank"] = fields["world_size"]
    with pytest.raises(WireError, match="world_size"):
        wire.METADATA.decode(msgspec.msgpack.encode(fields))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"base_addr": -1}, "base_addr"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_bytes": 0}, "block_bytes"),
        ({"block_stride": -4096}, "block_stride"),
        ({"device_id": -1}, "device_id"),
        ({"memory_kind": "HBM"}, "memory_kind"),
        ({"names": []}, "names"),
        ({"names": [""]}, "names"),
        ({"block_stride": 1024}, "block_stride"),  # blocks would overlap
        ({"base_addr": (1 << 63) - 4096}, "address"),  # runs off the end of the address range
    ],
)
def test_region_values_are_validated_on_decode(overrides: dict, match: str) -> None:
    fields = as_dict(region())
    fields.update(overrides)
    with pytest.raises(WireError, match=match):
        wire.METADATA.decode(msgspec.msgpack.encode({**as_dict(metadata()), "regions": [fields]}))


def test_single_block_region_may_have_any_stride() -> None:
    fields = {**as_dict(region()), "num_blocks": 1, "block_stride": 0}
    meta = wire.METADATA.decode(msgspec.msgpack.encode({**as_dict(metadata()), "regions": [fields, fields]}))
    assert meta.regions[0].block_stride == 0


@pytest.mark.parametrize("lease", [math.nan, math.inf, -math.inf, -1.0])
def test_transfer_params_refuse_non_finite_or_negative_lease(lease: float) -> None:
    fields = {**as_dict(params()), "lease_expiry": lease}
    with pytest.raises(WireError, match="lease_expiry"):
        wire.TRANSFER_PARAMS.decode(msgspec.msgpack.encode(fields))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"port": 0}, "port"),
        ({"port": 65536}, "port"),
        ({"block_ids": []}, "block_ids"),
        ({"block_ids": [[1, -2]]}, "block_ids"),
        ({"block_ids": [[1.5]]}, "block_ids"),
        ({"num_tokens": -1}, "num_tokens"),
        ({"request_id": ""}, "request_id"),
    ],
)
def test_transfer_params_values_are_validated(overrides: dict, match: str) -> None:
    fields = {**as_dict(params()), **overrides}
    with pytest.raises(WireError, match=match):
        wire.TRANSFER_PARAMS.decode(msgspec.msgpack.encode(fields))
    with pytest.raises(WireError, match=match):
        wire.transfer_params_from_builtins(fields)


@pytest.mark.parametrize(("value", "limit", "want"), [(20, 60.0, 20.0), (0.25, 60.0, 0.25), (60.0, 60.0, 60.0),
                                                      (600, 60.0, 60.0), (1e300, 60.0, 60.0), (10**400, 60.0, 60.0)])
def test_a_routers_load_deadline_shortens_the_configured_one_and_a_longer_one_is_capped(value, limit, want) -> None:
    got = wire.load_timeout_from_builtins(value, limit)
    assert got == want and type(got) is float


@pytest.mark.parametrize("value", ["20", None, True, False, [20], {"s": 20}, math.nan, math.inf, -math.inf, 0, 0.0,
                                   -1, -0.5])
def test_a_routers_load_deadline_that_is_not_a_positive_finite_number_is_refused_by_name(value) -> None:
    with pytest.raises(WireError, match=f"{wire.LOAD_TIMEOUT_KEY} must be a positive, finite number of seconds"):
        wire.load_timeout_from_builtins(value, 60.0)


def test_notification_with_unknown_or_missing_kind_is_rejected() -> None:
    fields = as_dict(Done(engine_id="e", rank=0, request_ids=("r",)))
    with pytest.raises(WireError):
        wire.REQUEST.decode(msgspec.msgpack.encode({**fields, "kind": "shutdown"}))
    del fields["kind"]
    with pytest.raises(WireError):
        wire.REQUEST.decode(msgspec.msgpack.encode(fields))


def test_list_length_caps_are_enforced() -> None:
    ids = [f"r{i}" for i in range(wire.MAX_IDS_PER_MESSAGE + 1)]
    for kind in ("heartbeat", "done", "abort"):
        note = {"kind": kind, "engine_id": "e", "rank": 0, "request_ids": ids}
        with pytest.raises(WireError, match="length"):
            wire.REQUEST.decode(msgspec.msgpack.encode(note))
    fields = {**as_dict(params()), "block_ids": [[1]] * (wire.MAX_KV_GROUPS + 1)}
    with pytest.raises(WireError, match="length"):
        wire.TRANSFER_PARAMS.decode(msgspec.msgpack.encode(fields))


# --------------------------------------------------------------------------------------------------
# Size limits


@pytest.mark.parametrize(
    ("decode", "limit"),
    [
        (wire.REQUEST_ENVELOPE.decode, wire.MAX_REQUEST_BYTES),
        (wire.REQUEST.decode, wire.MAX_REQUEST_BODY_BYTES),
        (wire.TRANSFER_PARAMS.decode, wire.MAX_TRANSFER_PARAMS_BYTES),
        (wire.METADATA.decode, wire.MAX_METADATA_BYTES),
        (wire.REPLY_ENVELOPE.decode, wire.MAX_REPLY_BYTES),
    ],
)
def test_oversized_input_is_refused_before_decoding(decode, limit: int) -> None:
    # Garbage over the limit must be reported as too large: the schema never got to see it.
    with pytest.raises(WireError, match="limit"):
        decode(memoryview(b"\xc1" * (limit + 1)))
    with pytest.raises(WireError, match="malformed"):
        decode(b"\xc1")


def test_oversized_message_is_refused_at_encode_time() -> None:
    note = Heartbeat(engine_id="e", rank=0, request_ids=tuple("x" * 100 + str(i) for i in range(2000)))
    with pytest.raises(WireError, match="limit"):
        wire.REQUEST.encode(note)


# --------------------------------------------------------------------------------------------------
# Compatibility


def test_check_compat_accepts_equal_fingerprints() -> None:
    check_compat(metadata().compat, metadata().compat)


def test_check_compat_names_every_differing_field_with_both_values() -> None:
    ours = metadata().compat
    theirs = msgspec.structs.replace(ours, block_size=32, dtype="float16", layout="BLHNC")
    with pytest.raises(kvconnect.HandshakeError) as info:
        check_compat(ours, theirs)
    message = str(info.value)
    for field, mine, peer in (("block_size", 16, 32), ("dtype", "bfloat16", "float16"), ("layout", "LBHNC", "BLHNC")):
        assert field in message
        assert repr(mine) in message and repr(peer) in message
    assert "transport" not in message
    assert {name for name, _, _ in info.value.differences} == {"block_size", "dtype", "layout"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("protocol_version", wire.PROTOCOL_VERSION + 1),
        ("transport", "mooncake"),
    ],
)
def test_check_compat_names_a_single_differing_field(field: str, value: object) -> None:
    ours = metadata().compat
    theirs = msgspec.structs.replace(ours, **{field: value})
    with pytest.raises(IncompatiblePeerError, match=field):
        check_compat(ours, theirs)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(label="MambaSpec"), "group 0 kind"),
        (dict(block_size=256), r"group 0 \(attention\) block size"),
        (dict(page_bytes=(4096, 8192)), "page bytes of its layer 1"),
        (dict(page_bytes=(4096,)), "layer count"),
        (dict(layers="other"), "layer-to-group map"),
    ],
)
def test_check_compat_names_the_group_that_differs(change: dict, named: str) -> None:
    ours = metadata().compat
    theirs = msgspec.structs.replace(ours, groups=(msgspec.structs.replace(ours.groups[0], **change),))
    with pytest.raises(IncompatiblePeerError, match=named):
        check_compat(ours, theirs)
    with pytest.raises(IncompatiblePeerError, match="group count"):
        check_compat(ours, msgspec.structs.replace(ours, groups=ours.groups * 2))


def test_checked_params_refuse_a_struct_built_with_values_off_the_schema() -> None:
    assert wire.checked_params(params()) == params()
    assert wire.checked_params(wire.transfer_params_to_builtins(params())) == params()
    for bad in (params(block_ids=[[2**63 + 5]]), params(port=0), params(request_id=""), params(block_ids=[[-1]])):
        with pytest.raises(WireError):
            wire.checked_params(bad)
    with pytest.raises(WireError):
        wire.checked_params("not params")


def test_version_probe_reads_messages_of_another_schema() -> None:
    future = msgspec.msgpack.encode({"protocol_version": 9, "shiny_new_field": [1, 2]})
    assert wire.probe_protocol_version(future) == 9
    assert wire.probe_protocol_version(b"\x01\x02") is None
    assert wire.probe_protocol_version(msgspec.msgpack.encode({"protocol_version": "9"})) is None


# --------------------------------------------------------------------------------------------------
# MACs and identity


def test_request_mac_covers_version_nonce_timestamp_and_body() -> None:
    key = b"k" * 32
    base = request_mac(key, 1, b"n" * 16, 100.0, b"body")
    assert len(base) == MAC_BYTES
    assert base == request_mac(key, 1, b"n" * 16, 100.0, b"body")
    variants = [
        request_mac(b"K" * 32, 1, b"n" * 16, 100.0, b"body"),
        request_mac(key, 2, b"n" * 16, 100.0, b"body"),
        request_mac(key, 1, b"m" * 16, 100.0, b"body"),
        request_mac(key, 1, b"n" * 16, 100.5, b"body"),
        request_mac(key, 1, b"n" * 16, 100.0, b"bodY"),
        # Moving bytes between nonce and body must change the MAC.
        request_mac(key, 1, b"n" * 16 + b"b", 100.0, b"ody"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_reply_mac_is_bound_to_the_request_nonce() -> None:
    key = b"k" * 32
    assert reply_mac(key, 1, b"a" * 16, b"body") != reply_mac(key, 1, b"b" * 16, b"body")
    assert reply_mac(key, 1, b"a" * 16, b"body") != request_mac(key, 1, b"a" * 16, 0.0, b"body")


def test_bytes_on_the_wire_are_those_of_this_protocol_version() -> None:
    # A peer of the same PROTOCOL_VERSION must read these bytes: changing them means bumping the version.
    assert wire.PROTOCOL_VERSION == 6
    assert wire.REQUEST.encode(wire.HandshakeRequest(rank=3)) == b"\x82\xa4kind\xa8metadata\xa4rank\x03"
    assert wire.REQUEST.encode(Done(engine_id="e", rank=1, request_ids=("r",))) == \
        b"\x85\xa4kind\xa4done\xabrequest_ids\x91\xa1r\xa7readers\x01\xa9engine_id\xa1e\xa4rank\x01"
    params = TransferParams(engine_id="e", host="h", port=1, request_id="r", block_ids=[[1, 2]], num_tokens=3,
                            lease_expiry=5.0, incarnation="i", ranks=(wire.RankAddr(host="h", port=1, incarnation="i"),))
    assert wire.TRANSFER_PARAMS.encode(params) == (
        b"\x89\xa9engine_id\xa1e\xa4host\xa1h\xa4port\x01\xaarequest_id\xa1r\xa9block_ids\x91\x92\x01\x02"
        b"\xaanum_tokens\x03\xaclease_expiry\xcb@\x14\x00\x00\x00\x00\x00\x00\xabincarnation\xa1i"
        b"\xa5ranks\x91\x93\xa1h\x01\xa1i")
    # Version 5: an offer says how many ranks the decode runs.
    offer = wire.Offer(engine_id="e", rank=1, key="k", params=params, tp_size=2)
    assert b"\xa7tp_size\x02" in wire.REQUEST.encode(offer)
    # Version 6: a region its groups split differently carries a split per group (an empty list otherwise).
    seg = wire.SegmentMeta(offset=0, repeat=1, stride=0, unit=8, total=2)
    plain = wire.RegionMeta(names=("a",), base_addr=0, num_blocks=1, block_bytes=8, block_stride=8, device_id=0,
                            memory_kind="DRAM", shards=(seg,))
    assert msgspec.msgpack.encode(plain).endswith(b"\xacgroup_shards\x90")
    shared = msgspec.structs.replace(plain, shards=None, group_shards=(wire.GroupSplitMeta(group=1, shards=(seg,)),
                                                                      wire.GroupSplitMeta(group=0, shards=None)))
    assert b"\xacgroup_shards\x92\x92\x01\x91\x95\x00\x01\x00\x08\x02\x92\x00\xc0" in msgspec.msgpack.encode(shared)


def test_every_public_name_of_the_wire_modules_is_reachable_as_wire_name() -> None:
    import importlib

    for name in wire.__all__:
        assert hasattr(wire, name), name
    for path in sorted((PACKAGE / "wire").glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"kvconnect.wire.{path.stem}")
        own = [n for n, v in vars(module).items() if not n.startswith("_") and getattr(v, "__module__", None) ==
               module.__name__ and callable(v)]
        assert set(own) <= set(wire.__all__), (path.name, sorted(set(own) - set(wire.__all__)))


def test_process_incarnation_is_stable_and_fresh_after_fork() -> None:
    first = wire.process_incarnation()
    assert first == wire.process_incarnation()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.write(write_fd, wire.process_incarnation().encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    child = os.read(read_fd, 128).decode()
    os.close(read_fd)
    os.waitpid(pid, 0)
    assert child and child != first


def test_regions_round_trip_through_the_wire() -> None:
    import torch

    from kvconnect.regions import RegionSet

    caches = {f"model.layers.{i}.attn": torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16) for i in range(3)}
    regions = RegionSet.from_kv_caches(caches)
    sent = regions.to_wire()
    decoded = wire.METADATA.decode(wire.METADATA.encode(metadata(regions=sent))).regions
    rebuilt = RegionSet.from_wire(decoded)
    assert rebuilt.regions == regions.regions


def test_regions_from_wire_refuses_overlapping_regions() -> None:
    from kvconnect.regions import RegionSet

    with pytest.raises(WireError, match="regions"):
        RegionSet.from_wire([region(), region(names=("other",))])


# --------------------------------------------------------------------------------------------------
# Fuzzing the decoders


_DECODERS = [
    wire.REQUEST_ENVELOPE.decode,
    wire.REQUEST.decode,
    wire.REPLY_ENVELOPE.decode,
    wire.REPLY.decode,
    wire.METADATA.decode,
    wire.TRANSFER_PARAMS.decode,
]


class _Explodes:
    def __reduce__(self):
        return (os.getpid, ())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.one_of(
        st.binary(max_size=512),
        msgpack_values.map(msgspec.msgpack.encode),
        st.just(pickle.dumps(_Explodes())),
    )
)
def test_decoders_raise_only_wire_error_on_arbitrary_input(data: bytes) -> None:
    for decode in _DECODERS:
        try:
            decode(data)
        except WireError:
            pass


@settings(max_examples=300, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(sorted(as_dict(params()))), msgpack_values, max_size=10))
def test_transfer_params_validation_raises_only_wire_error(fields: dict) -> None:
    try:
        wire.transfer_params_from_builtins(fields)
    except WireError:
        pass


# --------------------------------------------------------------------------------------------------
# Source-level guarantees


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_kvconnect_module_uses_an_object_serializer_that_executes_code() -> None:
    banned_modules = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}
    banned_calls = {"recv_pyobj", "send_pyobj", "recv_serialized"}
    offenders = []
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            if banned_modules.intersection(names):
                offenders.append(f"{path.name}:{node.lineno} imports {names}")
            if isinstance(node, ast.Attribute) and node.attr in banned_calls:
                offenders.append(f"{path.name}:{node.lineno} calls {node.attr}")
    assert not offenders, offenders


@pytest.mark.parametrize("name", [*(f"wire/{p.name}" for p in sorted((PACKAGE / "wire").glob("*.py"))),
                                  "sidechannel/server.py", "sidechannel/client.py", "sidechannel/auth.py"])
def test_network_facing_modules_guard_nothing_with_assert(name: str) -> None:
    tree = ast.parse((PACKAGE / name).read_text())
    lines = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not lines, f"{name} uses assert at lines {lines}; it vanishes under python -O"
