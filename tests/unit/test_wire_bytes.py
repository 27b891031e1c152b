"""The wire's bytes, pinned: one message of every type, encoded as it was before requests declared
their reply types (`protocol.messages.Request`). A refactor of the message classes that changes a
single byte fails here, before an old peer would notice."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from rollart.protocol.messages import (
    APP,
    BLOB,
    HANDSHAKE,
    REMOTE_FAILURE,
    SESSION,
    Ack,
    BlobHeader,
    Bye,
    Challenge,
    Channel,
    Echo,
    Generate,
    Generated,
    GroupAck,
    GroupDone,
    GroupFailed,
    GroupTask,
    Hello,
    Kind,
    Msg,
    NodeStatus,
    NoTask,
    Notice,
    PolicyVersion,
    Proof,
    Refuse,
    RemoteFailure,
    Score,
    Scored,
    SimWeights,
    StatusRequest,
    TaskWanted,
    Trajectory,
    WeightsHere,
    WeightsWhere,
    Welcome,
)

PINNED: list[tuple[Channel[Any], Any, str]] = [
    (
        HANDSHAKE,
        Hello(1, "env-0", "env-host", b"n" * 4, "sid", "bulk", 7),
        "98a568656c6c6f01a5656e762d30a8656e762d686f7374c4046e6e6e6ea3736964a462756c6b07",
    ),
    (
        HANDSHAKE,
        Challenge(b"c" * 4, "gen-0", "generator"),
        "94a96368616c6c656e6765c40463636363a567656e2d30a967656e657261746f72",
    ),
    (HANDSHAKE, Proof(b"p" * 4), "92a570726f6f66c40470707070"),
    (HANDSHAKE, Welcome(b"w" * 4, "epoch", True, 3), "95a777656c636f6d65c40477777777a565706f6368c303"),
    (HANDSHAKE, Refuse("auth", "wrong secret"), "93a6726566757365a461757468ac77726f6e6720736563726574"),
    (SESSION, Msg(5, 4, Kind.REQUEST, 2, 1500, msgspec.Raw(b"\xc0")), "97a16d05040102cd05dcc0"),
    (SESSION, Ack(9), "92a16109"),
    (SESSION, Bye("draining"), "92a3627965a8647261696e696e67"),
    (REMOTE_FAILURE, RemoteFailure("timeout", "late"), "92a774696d656f7574a46c617465"),
    (BLOB, BlobHeader("w", 10, {"v": 1}), "94a4626c6f62a1770a81a17601"),
    (APP, StatusRequest(), "91a77374617475733f"),
    (
        APP,
        NodeStatus("gen-0", "generator", 1.5, False, True, {"busy_s": 0.25}),
        "97a6737461747573a567656e2d30a967656e657261746f72cb3ff8000000000000c2c381a6627573795f73cb3fd0000000000000",
    ),
    (APP, Echo(3, b"xy"), "93a46563686f03c4027879"),
    (APP, Notice("hello"), "92a66e6f74696365a568656c6c6f"),
    (
        APP,
        Generate("r", "t", [1, 2], 8, 0.5, 0.9, [3], 11, 2),
        # prefill_only (false) and kv_from (none) appended (disaggregated routing): old peers skip them
        "9ca367656ea172a17492010208cb3fe0000000000000cb3feccccccccccccd91030b02c2c0",
    ),
    # busy (none) appended (routing's spill by how busy each class is): old peers skip it
    (
        APP,
        Generated("r", [4, 5], [-0.5, -0.25], [1, 1], "stop", 2, "gen-0"),
        "9ca967656e657261746564a17292040592cbbfe0000000000000cbbfd0000000000000920101a473746f7002a567656e2d30cb00000000000000000000c0",
    ),
    (APP, TaskWanted("env-0", 2.0), "93a57461736b3fa5656e762d30cb4000000000000000"),
    # greedy 0 and evaluation false appended (held-out evaluation): old peers skip them
    (APP, GroupTask("g", "lake", 3, 4, 1, 2), "9aaa67726f75702d7461736ba167a46c616b650304010200c200"),
    (APP, NoTask("paused", True), "93a76e6f2d7461736ba6706175736564c3"),
    (
        APP,
        GroupDone(
            "g",
            [
                Trajectory(
                    "t",
                    "g",
                    "lake",
                    3,
                    [1],
                    [2, 3],
                    [1, 0],
                    [-0.5, 0.0],
                    [1, -1],
                    1.0,
                    0.5,
                    1,
                    "done",
                    1,
                    10.0,
                    11.0,
                    0.25,
                    0.5,
                    ["gen-0"],
                    True,
                    [("env", 10.0, 10.5)],
                    [1],
                )
            ],
            1,
            2,
        ),
        "96a567726f7570a16791dc0017aa7472616a6563746f7279a174a167a46c616b6503910192020392010092cbbfe0000000000000cb00000000000000009201ffcb3ff0000000000000cb3fe000000000000001a4646f6e6501cb4024000000000000cb4026000000000000cb3fd0000000000000cb3fe000000000000091a567656e2d30c39193a3656e76cb4024000000000000cb40250000000000009101010200",
    ),
    (APP, GroupFailed("g", "env failed"), "93ac67726f75702d6661696c6564a167aa656e76206661696c6564"),
    (APP, GroupAck(False, "stale"), "93a967726f75702d61636bc2a57374616c65"),
    (APP, PolicyVersion(4, 2, True), "94a776657273696f6e0402c3"),
    (
        APP,
        Score("exact", "lake", "p", "r", "a", 0.5, 9),
        # timeout_s 0.0 appended (a gateway shared by runs): old peers skip it, and decode to 0.0 without it
        "99a573636f7265a56578616374a46c616b65a170a172a161cb3fe000000000000009cb0000000000000000",
    ),
    (APP, Scored(1.0, {"box": "left"}), "93a673636f726564cb3ff000000000000081a3626f78a46c656674"),
    (APP, WeightsWhere(), "91a8776569676874733f"),
    (APP, WeightsHere(3, 4567), "94a77765696768747303cd11d7a0"),  # dtype "" appended (issue 17): old peers skip it
    (APP, SimWeights(5, 0.5, 0.25), "94ab73696d2d7765696768747305cb3fe0000000000000cb3fd0000000000000"),
]


@pytest.mark.parametrize(("channel", "msg", "hex_bytes"), PINNED, ids=[type(m).__name__ for _, m, _ in PINNED])
def test_every_message_encodes_to_the_pinned_bytes(channel: Channel[Any], msg: Any, hex_bytes: str) -> None:
    assert channel.encode(msg).hex() == hex_bytes
    assert channel.decode(bytes.fromhex(hex_bytes)) == msg


def test_every_message_type_is_pinned() -> None:
    pinned = {type(msg) for _, msg, _ in PINNED}
    for channel in (HANDSHAKE, SESSION, APP, REMOTE_FAILURE, BLOB):
        assert set(channel.types) <= pinned, set(channel.types) - pinned


def test_a_score_from_a_peer_without_its_timeout_field_decodes_with_the_default() -> None:
    old = bytes.fromhex("98a573636f7265a56578616374a46c616b65a170a172a161cb3fe000000000000009")
    assert APP.decode(old) == Score("exact", "lake", "p", "r", "a", 0.5, 9, timeout_s=0.0)
