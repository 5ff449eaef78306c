"""task=serve's OpenAI contract as an eighth review found it: a negative seed (OpenAI's seed is any 64-bit integer;
llama.cpp's clients send -1) was a 400, a message's text parts were glued together without a separator, and an
uptime monitor's HEAD /health got a 405 (read as down) that counted as a refused request."""

from __future__ import annotations

import pytest
import test_serve_fixes
from test_serve import KEY, MODEL, client

lm = test_serve_fixes.lm  # the served tiny Llama fixture (random init, byte tokenizer, a key), one per module


def ask(http, content, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_negative_seed_is_a_seed_as_openai_takes_it_and_minus_one_is_none(lm):
    """The official client passes a seed through as given; the same negative seed samples the same text twice. -1 is
    llama.cpp's and vLLM's "no seed" (UIs send it by default): each answer is drawn afresh, not pinned."""
    from openai import OpenAI

    api = OpenAI(base_url=f"{lm.url}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "Tell me something"}]

    def sampled(seed: int) -> str:
        reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=1, seed=seed)
        return reply.choices[0].message.content

    assert sampled(-2) == sampled(-2)
    assert len({sampled(-1) for _ in range(3)}) > 1  # a random tiny model's 12 tokens at temperature 1
    with client(lm) as http:
        assert ask(http, "hi", seed=-(2**63), temperature=1)["usage"]["completion_tokens"] >= 1
        past = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 4, "seed": -(2**63) - 1},
        )
    assert past.status_code == 400 and past.json()["error"]["param"] == "seed"


def test_text_parts_are_joined_by_newlines_not_glued_together(lm):
    """[{"text": "Summarize:"}, {"text": "The cat sat."}] is the model's "Summarize:\\nThe cat sat." (vLLM's join):
    the same prompt tokens and, greedy, the same answer as that string sent whole."""
    parts = [{"type": "text", "text": "Summarize:"}, {"type": "text", "text": "The cat sat."}]
    with client(lm) as http:
        from_parts = ask(http, parts, temperature=0)
        whole = ask(http, "Summarize:\nThe cat sat.", temperature=0)
    assert from_parts["usage"] == whole["usage"]
    assert from_parts["choices"][0]["message"] == whole["choices"][0]["message"]


@pytest.mark.parametrize("path", ["/health", "/"])
def test_head_requests_of_health_and_the_page_are_answered_without_a_key(lm, path):
    """HEAD is what uptime monitors probe with (a 405 reads as down): the GET's status and headers, no body, and no
    refused request counted in metrics.json."""
    stats = lm.app.state.stats
    refused = stats.refused
    with client(lm, key=None) as http:
        got, head = http.get(path), http.head(path)
    assert head.status_code == got.status_code == 200
    assert head.headers["content-type"] == got.headers["content-type"] and head.content == b""
    assert stats.refused == refused
