"""The API's JSON parser: DRF's, except that a body nested too deeply for Python's json module
is a 400 (ParseError) instead of a RecursionError (a 500). A JobSpec's free-form `config`
invites nesting; trainyard/usercode.py caps it far below where this parser gives up."""
from __future__ import annotations

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser as DRFJSONParser


class JSONParser(DRFJSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body nests too deeply") from None
