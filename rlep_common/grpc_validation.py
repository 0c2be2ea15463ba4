"""Checks a servicer runs on a parsed request: fields this schema does not know (INVALID_ARGUMENT). A request's
size is checked before parsing, by `rlep.common.grpc_server.add_validated_servicer`."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.unknown_fields import UnknownFieldSet


def unknown_field_paths(message: Any, path: str = "") -> list[str]:
    """Where a parsed message carries fields this schema does not know (e.g. a newer client's).

    Protobuf keeps unknown fields silently; services that would misread such a request (a sampling
    option they would ignore, say) refuse it instead.
    """
    here = path or message.DESCRIPTOR.name
    found = [here] if len(UnknownFieldSet(message)) else []
    for field, value in message.ListFields():
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if field.message_type.GetOptions().map_entry:
            children = [(f"{here}.{field.name}[{k}]", v) for k, v in value.items() if hasattr(v, "DESCRIPTOR")]
        elif field.is_repeated:
            children = [(f"{here}.{field.name}[{i}]", v) for i, v in enumerate(value)]
        else:
            children = [(f"{here}.{field.name}", value)]
        for child_path, child in children:
            found.extend(unknown_field_paths(child, child_path))
    return found


def reject_unknown_fields(message: Any, context: grpc.ServicerContext) -> None:
    """Aborts with INVALID_ARGUMENT naming where unknown fields were sent."""
    paths = unknown_field_paths(message)
    if paths:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown fields in {', '.join(paths[:5])}")
