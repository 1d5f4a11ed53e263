"""Strict JSON schemas: objects take the properties they declare and no others.

JSON Schema leaves an object open unless it says `additionalProperties: false`, and a grammar
compiled from an open object lets the model write keys nobody asked for. A small model then
invents keys until `max_tokens`, and what comes back is neither a tool call nor valid output
(issue 31: what LangChain, instructor and litellm send, and what a tool without parameters
becomes). So schemas are closed before compiling, as the reference engines' default grammar
backends do, unless the request says `"strict": false` or the server runs with
`--open-json-objects` (docs/structured-outputs.md).

Closing is only done where it cannot change which documents the schema accepts beyond the
undeclared keys: an object that declares `type: "object"` or `properties` and says nothing
about additional or unevaluated properties. Members of an `allOf` (and the schema holding it)
stay as written, since closing each member would make their intersection refuse the keys the
others declare.
"""

from __future__ import annotations

from typing import Any

_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties")
# keywords whose value is one subschema, a list of them, or a name -> subschema map
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "additionalProperties", "unevaluatedItems", "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _is_object(schema: dict[str, Any]) -> bool:
    t = schema.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or "properties" in schema


def close_objects(schema: Any, _in_all_of: bool = False) -> Any:
    """A copy of `schema` with every open object closed (see the module's docstring)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: close_objects(s) for k, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, _in_all_of=True) for s in out["allOf"]]
    elif not _in_all_of and _is_object(out) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def tool_parameters(parameters: dict[str, Any] | None, strict: bool) -> dict[str, Any]:
    """The schema a function's arguments must match: always a JSON object (a function without
    parameters takes exactly `{}` when strict, any object otherwise)."""
    if not parameters:
        return dict(NO_ARGUMENTS) if strict else {"type": "object"}
    schema = parameters if "type" in parameters else {"type": "object", **parameters}
    return close_objects(schema) if strict else schema
