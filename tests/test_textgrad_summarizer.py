"""TextGrad and single-shot summarizers end to end against a real OpenAI-compatible HTTP server
started on 127.0.0.1 (the LLM endpoint is the one boundary we do not own)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from compendium.schema import Schema, ToolSpec
from federation.merge import MergeInput, ProbeSet, edge_merge
from federation.merge.llm import OpenAICompatibleLLM
from federation.round_config import RoundConfig
from routing.embeddings import get_engine

IMPROVED = "Will it snow in Oslo tomorrow?"


class ChatServer(ThreadingHTTPServer):
    def __init__(self, mode: str):
        super().__init__(("127.0.0.1", 0), ChatHandler)
        self.mode = mode
        self.requests: list[dict] = []


class ChatHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        if self.path.rstrip("/") != "/v1/chat/completions":
            self.send_error(404)
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        prompt = "\n".join(m["content"] for m in body["messages"])
        if self.server.mode == "garbage":
            content = "Sorry, I would rather talk about something else."
        elif "<IMPROVED_VARIABLE>" in prompt:
            content = f"Here it is: <IMPROVED_VARIABLE>{IMPROVED}</IMPROVED_VARIABLE>"
        elif '{"summary"' in prompt:
            content = json.dumps({"summary": IMPROVED})
        else:
            content = "The scenario is too generic; name snow forecasts for a city tomorrow."
        payload = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def chat_server(request):
    server = ChatServer(request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def embed():
    return get_engine().embed


SCHEMA = Schema(tools=[
    ToolSpec(tool_id="weather", name="WeatherNow", description="Weather forecasts for a city"),
    ToolSpec(tool_id="flights", name="FlightFinder", description="Search and book flights"),
])


def _merge(server, embed, summarizer="textgrad", with_probe=True):
    probe_texts = ["Will it snow in Oslo tomorrow?"]
    probe = ProbeSet(probe_texts, ["weather"], embed(probe_texts)) if with_probe else None
    subs = [
        MergeInput("a", {"scenarios": [{"tool_id": "weather", "text": "Check the weather"}]}),
        MergeInput("b", {"scenarios": [{"tool_id": "weather", "text": "Check the weather."}]}),
        MergeInput("c", {"scenarios": [
            {"tool_id": "flights", "text": "Will it snow in Oslo tomorrow for my flight?"}]}),
    ]
    llm = OpenAICompatibleLLM(base_url=f"http://127.0.0.1:{server.server_port}/v1", model="fake")
    return edge_merge(
        subs, SCHEMA, RoundConfig(summarizer=summarizer, textgrad_steps=2), embed=embed,
        probe_set=probe, llm=llm, confusion_margin=2.0,
    )


@pytest.mark.parametrize("chat_server", ["good"], indirect=True)
def test_textgrad_improves_the_scenario_against_routing_failure(chat_server, embed):
    result = _merge(chat_server, embed)
    weather = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
    assert [s.text for s in weather] == [IMPROVED]
    assert weather[0].support == 2
    assert result.stats.summarizer_fallbacks == []
    assert result.stats.summaries == {"textgrad": 1}  # the one two-text cluster, written by textgrad
    assert chat_server.requests and all(r["model"] == "fake" for r in chat_server.requests)
    # each step: loss evaluation, gradient, update (at least three calls per step)
    assert len(chat_server.requests) >= 6


@pytest.mark.parametrize("chat_server", ["good"], indirect=True)
def test_llm_single_shot_summary(chat_server, embed):
    result = _merge(chat_server, embed, summarizer="llm-single-shot")
    assert IMPROVED in [s.text for s in result.compendium.scenarios if s.tool_id == "weather"]
    assert result.stats.summaries == {"llm-single-shot": 1}


@pytest.mark.parametrize("chat_server", ["garbage"], indirect=True)
def test_unparseable_answer_falls_back_and_records_why(chat_server, embed):
    result = _merge(chat_server, embed)
    fallbacks = result.stats.summarizer_fallbacks
    assert [f["summarizer"] for f in fallbacks] == ["textgrad", "llm-single-shot"]
    assert "could not be parsed" in fallbacks[0]["reason"]
    assert "not JSON" in fallbacks[1]["reason"]
    assert result.stats.summaries == {"probe-extractive": 1}  # no LLM text was kept
    weather = [s for s in result.compendium.scenarios if s.tool_id == "weather"]
    assert weather[0].text in ("Check the weather", "Check the weather.",
                               "Check the weather; check the weather.")


@pytest.mark.parametrize("chat_server", ["good"], indirect=True)
def test_textgrad_without_a_probe_set_falls_back_and_says_why(chat_server, embed):
    """TextGrad scores its texts on the public probe set: without one the merge failed with an
    AttributeError (the round with it); now the single-shot summary is written instead."""
    result = _merge(chat_server, embed, with_probe=False)
    fallbacks = result.stats.summarizer_fallbacks
    assert [(f["summarizer"], f["kind"]) for f in fallbacks] == [("textgrad", "no probe set")]
    assert result.stats.summaries == {"llm-single-shot": 1}
