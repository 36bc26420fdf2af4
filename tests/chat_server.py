"""A real HTTP server speaking the OpenAI chat-completions protocol with scripted answers, for the
router's, the simulation's and any other LLM test."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ChatServer:
    """Answers `POST /v1/chat/completions` with the next scripted answer of `answers`, or
    `default` when none is left (with `silent`, never); records every request. With
    `refuse_response_format`, a request carrying `response_format` is refused with HTTP 400, as a
    server without a JSON mode refuses the unknown parameter; with `refuse_all`, every request is."""

    def __init__(self, default: str = "", *, refuse_response_format: bool = False,
                 refuse_all: bool = False):
        self.answers: list[str] = []
        self.default = default
        self.refuse_response_format = refuse_response_format
        self.refuse_all = refuse_all  # every request refused with HTTP 400 (a prompt too long)
        self.requests: list[dict] = []
        self.status: int | None = None  # every request answered with this HTTP status (503)
        self.garbled = False  # answers say they are gzip and are not (a broken proxy)
        # Every request is read and never answered: held `silent` seconds (or until `close`),
        # then the connection is dropped without a response (an endpoint that hangs).
        self.silent: float | None = None
        self._closing = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                if self.path != "/v1/chat/completions":
                    self.send_response(404)
                    self.end_headers()
                    return
                if owner.silent is not None:
                    owner._closing.wait(owner.silent)
                    self.close_connection = True
                    return
                if owner.status is not None:
                    self.send_response(owner.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if owner.refuse_all or (owner.refuse_response_format and "response_format" in body):
                    error = (b'{"error": {"message": "the prompt exceeds the context"}}' if owner.refuse_all
                             else b'{"error": {"message": "Unrecognized request argument: response_format"}}')
                    self.send_response(400)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                answer = owner.answers.pop(0) if owner.answers else owner.default
                payload = json.dumps(
                    {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if owner.garbled:
                    self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self._closing.set()
        self.server.shutdown()
        self.server.server_close()
