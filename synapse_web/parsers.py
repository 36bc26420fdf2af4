"""The API's request parsers: DRF's, with a JSON body nested too deeply for Python's parser
answered as a 400 naming it instead of a RecursionError (a 500)."""

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class BoundedJSONParser(JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body nests too deeply") from None
