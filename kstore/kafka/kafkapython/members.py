"""A consumer group's live members, as Kafka's describe group gives them, in one plain shape.

kafka-python's :class:`KafkaAdminClient` answers here; confluent-kafka's ``AdminClient`` answers in
:mod:`kstore.kafka.confluent.admin`. The worker's one-database guard (:mod:`kstore.engine.onedatabase`)
and ``kstore offsets show`` compare these members with the group's registry in the database.
"""

from __future__ import annotations

import re
from typing import Any

from kafka import errors as kafka_errors
from kafka.errors import KafkaError

from kstore.kafka.seam import GroupMember, GroupView
from kstore.types import TopicPartition as TP

_DB_TAG = b"kstore-db:"


def member_database(user_data: bytes | str | None) -> str | None:
    """The database id a kstore worker of an older release told its group in its subscription's user
    data (None: anything else). (A group's description gives the user data as text.)"""
    if isinstance(user_data, str):
        user_data = user_data.encode("latin-1", errors="replace")
    if not user_data or not user_data.startswith(_DB_TAG):
        return None
    try:
        return user_data[len(_DB_TAG):].decode().split(";since:")[0]
    except ValueError:
        return None


def described_members(admin: Any, group: str) -> GroupView:
    """The members of ``group`` through kafka-python's admin client. Raises a KafkaError:
    the group's own error as a retriable one when it is (its coordinator loading, say)."""
    described: dict[str, Any] = admin.describe_groups([group]).get(group, {})
    error = group_error(described.get("error"))
    if error is not None:
        raise error(described["error"])
    return view_of(described)


def view_of(described: dict[str, Any]) -> GroupView:
    """A group's members and state from kafka-python's description of it."""
    members = []
    for member in described.get("members", []):
        metadata = member.get("member_metadata")
        told = member_database(metadata.get("user_data") if isinstance(metadata, dict) else None)
        members.append(GroupMember(str(member.get("member_id")), str(member.get("client_id") or ""), told,
                                   _assigned(member.get("member_assignment"))))
    return GroupView(tuple(members), described.get("group_state") == "Stable")


def _assigned(assignment: Any) -> tuple[TP, ...]:
    """The partitions in a member's assignment, as kafka-python's description gives it."""
    entries = assignment.get("assigned_partitions", []) if isinstance(assignment, dict) else []
    return tuple((entry["topic"], partition) for entry in entries for partition in entry.get("partitions", []))


def group_error(text: Any) -> type[KafkaError] | None:
    """The error class of a group's error as kafka-python's description gives it (``[Error 14] ...``)."""
    found = re.match(r"\[Error (-?\d+)\]", text) if isinstance(text, str) else None
    return None if found is None else kafka_errors.for_code(int(found.group(1)))
