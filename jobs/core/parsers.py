"""The API's JSON parser: DRF's, bounded (issue 15): a body over settings.TRAINYARD_JSON_MAX_BYTES
is a 413 read no further than the limit (DRF's own parser reads any size into memory: Django's
DATA_UPLOAD_MAX_MEMORY_SIZE does not apply to request.stream), and a body nested deeper than
trainyard.textdoc.MAX_DEPTH, or with an integer past Python's 4,300-digit limit, is a 400
(ParseError) instead of a RecursionError or a ValueError deep in a view (a 500). A JobSpec's
free-form `config` invites nesting; trainyard/usercode.py caps it below where this parser gives up.

Every parser here also refuses text no database can hold (jobs/core/dbtext.py: a NUL, a lone
surrogate) anywhere in the body, keys included, with a 400 naming each field: PostgreSQL's text and
jsonb refuse U+0000, so one such value reaching a query or an INSERT was a 500 there (the API fuzz
found them one endpoint at a time: a login, a webhook's team, an experiment's name)."""
from __future__ import annotations

import json


from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import FormParser as DRFFormParser
from rest_framework.parsers import JSONParser as DRFJSONParser
from rest_framework.parsers import MultiPartParser as DRFMultiPartParser
from rest_framework.utils.json import strict_constant

from trainyard.textdoc import DocError, check_depth

from jobs.core.dbtext import text_problems
from jobs.core.errors import InvalidInput, PayloadTooLarge


def refuse_unstorable_text(data):
    """`data` (a parsed body), or InvalidInput naming each string in it no database can hold."""
    if problems := text_problems(data):
        raise InvalidInput(problems)
    return data


def _form_fields(data) -> dict:
    return {k: values if len(values) > 1 else values[0] for k, values in data.lists()}


class JSONParser(DRFJSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.TRAINYARD_JSON_MAX_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise PayloadTooLarge({"detail": [f"the JSON body is larger than {limit} bytes "
                                              f"(TRAINYARD_JSON_MAX_BYTES)"]})
        encoding = (parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET
        try:
            data = json.loads(raw.decode(encoding), parse_constant=strict_constant if self.strict else None)
            check_depth(data)
        except DocError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        except RecursionError:
            raise ParseError("JSON parse error - the body nests too deeply") from None
        except ValueError as exc:  # also UnicodeDecodeError, and ints past the int/str digit limit
            raise ParseError(f"JSON parse error - {str(exc)[:200]}") from None
        return refuse_unstorable_text(data)


class FormParser(DRFFormParser):
    def parse(self, stream, media_type=None, parser_context=None):
        data = super().parse(stream, media_type, parser_context)
        refuse_unstorable_text(_form_fields(data))
        return data


class MultiPartParser(DRFMultiPartParser):
    """DRF's: the form's fields are checked (its files are bytes, stored as files)."""

    def parse(self, stream, media_type=None, parser_context=None):
        parsed = super().parse(stream, media_type, parser_context)
        refuse_unstorable_text(_form_fields(parsed.data))
        return parsed
