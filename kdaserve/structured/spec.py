"""What a request asks the output to match: plain data that crosses the process boundary.

`GuidedDecoding` travels inside `SamplingParams` (msgpack); the engine process compiles it
(see `compiler.py`). Limits are checked here so that the API edge and the engine refuse the
same things with the same messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

KINDS = ("json", "json_object", "regex", "choice", "lark")
MAX_SPEC_CHARS = 65_536          # a schema, regex or grammar, as text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 16_384        # all choices together


class GuidedDecodingError(ValueError):
    """A spec the engine refuses or cannot compile; the message says why (HTTP 400)."""


@dataclass
class GuidedDecoding:
    """kind "json": `spec` is a JSON schema (JSON text); "json_object": any JSON object;
    "regex": `spec` is a regular expression; "choice": one of `choices` exactly; "lark": `spec`
    is a Lark grammar (llguidance's dialect). `whitespace`: let JSON carry free whitespace
    (off: the compact `{"a": 1, "b": [2, 3]}` layout, which keeps small models from looping
    on blanks). `strict`: a JSON schema's objects take only the properties they declare unless
    they say otherwise (strict.py; off: JSON Schema's open objects). `list_separator`: for a
    grammar that is a list of items, the text between two items; the engine then ends the list
    while max_tokens can still close it (list_end.py)."""

    kind: str
    spec: str = ""
    choices: list[str] = field(default_factory=list)
    whitespace: bool = False
    strict: bool = True
    list_separator: str = ""
    # the request field that carried the spec (for error messages; not part of the key)
    field: str = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if self.kind not in KINDS:
            raise GuidedDecodingError(f"guided decoding kind must be one of {KINDS}, "
                                      f"got {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise GuidedDecodingError(f"the {self.kind} spec must be a string of at most "
                                      f"{MAX_SPEC_CHARS} characters")
        if self.kind in ("json", "regex", "lark") and not self.spec:
            raise GuidedDecodingError(f"the {self.kind} spec must not be empty")
        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except (ValueError, RecursionError) as exc:   # "[" * 2000: nested past the limit
                raise GuidedDecodingError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise GuidedDecodingError("the JSON schema must be an object or a boolean")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise GuidedDecodingError(f"choice needs 1 to {MAX_CHOICES} strings")
            if any(not isinstance(c, str) or not c for c in self.choices):
                raise GuidedDecodingError("choices must be non-empty strings")
            if sum(len(c) for c in self.choices) > MAX_CHOICE_CHARS:
                raise GuidedDecodingError(f"choices total more than {MAX_CHOICE_CHARS} "
                                          "characters")
        if not isinstance(self.list_separator, str) or len(self.list_separator) > 128:
            raise GuidedDecodingError("list_separator must be a string of at most 128 "
                                      "characters")
        if not isinstance(self.whitespace, bool) or not isinstance(self.strict, bool):
            raise GuidedDecodingError("whitespace and strict must be booleans")

    @property
    def key(self) -> tuple:
        """Equal keys compile to the same grammar (the compile cache's key)."""
        return (self.kind, self.spec, tuple(self.choices), self.whitespace, self.strict)
