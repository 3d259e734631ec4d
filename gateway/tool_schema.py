"""Tool calls' schema, both ways: where a tool's parameters sit inside the schema of the calls
(`placed`), and an admission refusal of a constraint named back as the body has it (the body's
field, a tool's parameters) rather than as the gRPC request it became."""
from __future__ import annotations

import re

from gateway.constraints import ConstraintCompiler, ConstraintError
from protos import inference_pb2

# How admission names a constraint it refuses: the gRPC field, renamed to the body's own.
_GRPC_CONSTRAINT = re.compile(r"^structured_output(?:\.[a-z_]+)?\b")
# Where `placed` puts a tool's definitions, named back as the body has them:
# "/$defs/function0/$defs/Inner" is "tools[0].function.parameters#/$defs/Inner".
_PLACED_TOOL = re.compile(r"#?/\$defs/function(\d+)((?:/[^\s'\"]*)?)")


def named_as_in_body(message: str, constraint_field: str) -> str:
    """An admission refusal's message with the constraint named by the body field it came from,
    and a chat's tools_json (the gRPC field) as the body's `tools`."""
    message = message.replace("tools_json", "tools")
    if not constraint_field:
        return message
    message = _GRPC_CONSTRAINT.sub(constraint_field, message, count=1)
    if constraint_field == "tools":
        message = _PLACED_TOOL.sub(lambda m: f"tools[{m[1]}].function.parameters" + (f"#{m[2]}" if m[2] else ""),
                                   message)
    return message


def refused_tool(message: str, tool_parameters: tuple[tuple[int, str], ...], compiler: ConstraintCompiler) -> str:
    """A refusal of the tool calls' constraint named after the first tool whose parameters are
    refused on their own (llguidance's message may name no place in the schema); `message` where
    none is. Compiles each schema: run it off the event loop."""
    for index, schema in tool_parameters:
        try:
            compiler.grammar(inference_pb2.StructuredOutput(json_schema=schema))
        except ConstraintError as e:
            return named_as_in_body(str(e), f"tools[{index}].function.parameters")
    return message


def placed(parameters: dict, index: int, defs: dict[str, dict]) -> dict:
    """A function's parameters schema as it sits inside the tool-call schema. One that refers to
    itself (`$ref`s such as "#/$defs/Inner", which pydantic writes for nested models) is moved
    whole to the root's `$defs` under its own name, its local references rewritten to point
    there, so they still resolve, and two functions' definitions never meet."""
    name = f"function{index}"
    rebased = _rebased(parameters, f"#/$defs/{name}")
    if rebased == parameters:  # no local reference: it stays in place
        return parameters
    defs[name] = rebased
    return {"$ref": f"#/$defs/{name}"}


def _rebased(node, base: str):
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebased(x, base) for x in node]
    return node
