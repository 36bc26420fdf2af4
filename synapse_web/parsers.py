"""The API's request parsers: DRF's JSON parser, answering with a 400 that names the problem what
DRF reads without a word or fails on with a 500:

- a body nested too deeply for Python's parser (a RecursionError);
- a key twice in one object (Python keeps the last, other parsers the first: the body means what
  the reader picks), as a compendium's body already is refused;
- a lone surrogate ("\\ud800", half of an escaped character) anywhere, in a key or a value: no
  text, nothing the database can store, and a refusal that echoed it (an unknown field's name, a
  choice) could not even be encoded as the JSON answer (a UnicodeEncodeError, a 500)."""

from __future__ import annotations

import codecs
import json
import re

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser, get_encoding
from rest_framework.utils.json import strict_constant

from compendium.validation import no_duplicate_keys

SURROGATE = re.compile("[\ud800-\udfff]")


def _shown_key(key: str) -> str:
    return key[:40] if key.isidentifier() else json.dumps(key[:40])


def lone_surrogate(data) -> str | None:
    """Where `data` (parsed JSON) holds a lone surrogate, in words ("$.queries[1] holds a lone
    surrogate U+D800 ..."), the first in document order; None when it holds none."""
    stack = [("$", data)]
    while stack:  # not recursive: the JSON may nest as deeply as json reads
        path, item = stack.pop()
        if isinstance(item, str):
            bad = SURROGATE.search(item)
            if bad:
                return (f"{path} holds a lone surrogate U+{ord(bad.group()):04X} (half of an "
                        "escaped character), which is not text")
        elif isinstance(item, dict):
            for key in item:
                bad = SURROGATE.search(key)
                if bad:
                    return (f"{path} has a key holding a lone surrogate U+{ord(bad.group()):04X} "
                            "(half of an escaped character), which is not text")
            stack.extend(
                (f"{path}.{_shown_key(key)}", value) for key, value in reversed(item.items())
            )
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", value) for i, value in reversed(list(enumerate(item))))
    return None


class BoundedJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        encoding = get_encoding(parser_context or {})
        if codecs.lookup(encoding).name == "utf-8":
            # a byte order mark first (a file Notepad or PowerShell 5 saved, sent with curl
            # --data-binary @file) is ignored, as RFC 8259 allows and the submissions endpoint does
            encoding = "utf-8-sig"
        try:
            decoded_stream = codecs.getreader(encoding)(stream)
            data = json.load(
                decoded_stream,
                parse_constant=strict_constant if self.strict else None,
                object_pairs_hook=no_duplicate_keys,
            )
        except RecursionError:
            raise ParseError("JSON parse error - the body nests too deeply") from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        problem = lone_surrogate(data)
        if problem:
            raise ParseError(f"JSON parse error - {problem}")
        return data
