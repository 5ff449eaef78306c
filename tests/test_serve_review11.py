"""Text generation and task=serve, review 11: a checkpoint's generation_config (suppress_tokens, min_new_tokens...)
changed resident generation and not streamed or served; a temperature under float32's range crashed infer's draw;
an assistant's tool calls were dropped from the chat template's prompt; a browser's CORS preflight was refused; a
list of prompts to /v1/completions was a 400."""

from __future__ import annotations

import json

import pytest
import test_serve_fixes
from test_serve import MODEL, client, served_model
from test_text_review10 import llama3_base_tokenizer, tiny_llama

from onn.modalities.text import generate

lm = test_serve_fixes.lm  # the served tiny Llama fixture (random init, byte tokenizer, a key), one per module

# a chat template that writes an assistant's tool calls (arguments with tojson, as Qwen's and Llama 3.1's do) and the
# tool's answer with the call's id
TOOLS = (
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% for call in m.get('tool_calls') or [] %}[call {{ call['function']['name'] }} "
    "{{ call['function']['arguments'] | tojson }}]{% endfor %}"
    "{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}]{% endif %}{{ m['content'] }}{% endfor %}<assistant>"
)
CONVERSATION = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


@pytest.fixture
def model_and_tokenizer():
    tok = llama3_base_tokenizer()
    return tiny_llama(tok).eval(), tok


def test_a_generation_configs_other_fields_leave_resident_generation_as_streamed_and_served(model_and_tokenizer):
    """generate() fills what a call leaves unset from the model's generation_config: a checkpoint's suppress_tokens
    (or bad_words_ids, min_new_tokens, stop_strings) changed infer's resident text, while the layer-streamed engine and
    task=serve pick by temperature and top-p alone. Only its end ids count now, in every path."""
    model, tok = model_and_tokenizer
    plain = generate.complete(model, tok, ["hello there"], max_new_tokens=8)[0]
    first_tokens = tok(plain, add_special_tokens=False)["input_ids"][:3]
    model.generation_config.suppress_tokens = first_tokens
    model.generation_config.min_new_tokens = 4
    assert generate.complete(model, tok, ["hello there"], max_new_tokens=8) == [plain]
    assert model.generation_config.suppress_tokens == first_tokens  # the checkpoint's own config is left as it was


def test_a_lora_models_generation_leaves_its_base_models_generation_config_whole(model_and_tokenizer):
    """peft's generate copies the wrapper's generation_config onto the base model: only the wrapper's was put back,
    so a LoRA run's export, written after exact_match generated, lost the checkpoint's sampling settings."""
    from peft import LoraConfig, get_peft_model

    model, tok = model_and_tokenizer
    model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9)
    lora = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj"])).eval()
    generate.complete(lora, tok, ["hello there"], max_new_tokens=2)
    for config in (lora.generation_config, lora.get_base_model().generation_config):
        assert (config.do_sample, config.temperature, config.top_p) == (True, 0.6, 0.9)


def test_a_temperature_under_float32s_range_is_greedy_not_a_crash(model_and_tokenizer):
    """task.temperature=1e-40 (valid: 0 or more) divided the scores into inf, and the draw failed on NaN
    probabilities; under 1e-4 generation is greedy, as serve's is."""
    model, tok = model_and_tokenizer
    greedy = generate.complete(model, tok, ["hello there"], max_new_tokens=8)
    assert generate.complete(model, tok, ["hello there"], max_new_tokens=8, temperature=1e-40) == greedy


def test_an_assistants_tool_calls_and_the_tools_answer_go_through_the_chat_template(lm, monkeypatch):
    """The assistant's tool call was dropped (an empty assistant turn before the tool's answer). The call is the
    template's now, its arguments an object (tojson of the string quoted it twice); a prompt format that would drop
    it is a 400 naming the message."""
    served = served_model(lm)
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 1, "temperature": 0}
    with client(lm) as http:
        refused = http.post("/v1/chat/completions", json=body)  # role: content lines: no place for the call
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[1].tool_calls"
        monkeypatch.setattr(served.prompter, "chat", True)
        monkeypatch.setattr(served.tokenizer, "chat_template", TOOLS)
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    written = '<user>Weather?<assistant>[call weather {"city": "Paris"}]<tool>[c1]sunny<assistant>'
    expected = generate.prompt_ids(served.tokenizer, written, served.prompter.add_special_tokens)
    assert response.json()["usage"]["prompt_tokens"] == len(expected)


def test_a_browsers_cors_preflight_is_answered_without_the_key(lm):
    """A web page on another origin asks with OPTIONS (no key: a browser sends none) before its POST; it got 401 (and
    405 with the key), so no browser client could call the server."""
    origin = {"Origin": "http://localhost:3000"}
    preflight = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with client(lm, key=None) as http:
        answer = http.options("/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == "*"
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    with client(lm) as http:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
        reply = http.post("/v1/completions", json=body, headers=origin)
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"


def test_a_list_of_prompts_gets_one_choice_each_whole_and_streamed(lm):
    """OpenAI's /v1/completions takes a list of prompts and answers a choice for each, in order; it was a 400. Each
    is what the prompt gets alone; usage counts them together."""
    prompts = ["hello", "ab", "the cat"]
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    with client(lm) as http:
        alone = [http.post("/v1/completions", json={**base, "prompt": p}).json() for p in prompts]
        together = http.post("/v1/completions", json={**base, "prompt": prompts})
        assert together.status_code == 200, together.text
        body = {**base, "prompt": prompts, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        empty = http.post("/v1/completions", json={**base, "prompt": []})
        token_ids = http.post("/v1/completions", json={**base, "prompt": [1, 2]})  # still refused: text only
    choices = together.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["text"] for c in choices] == [a["choices"][0]["text"] for a in alone]
    assert [c["finish_reason"] for c in choices] == [a["choices"][0]["finish_reason"] for a in alone]
    tokens = sum(a["usage"]["completion_tokens"] for a in alone)
    assert together.json()["usage"]["completion_tokens"] == tokens
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    streamed = ["", "", ""]
    for chunk in chunks[:-1]:
        streamed[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
    assert streamed == [c["text"] for c in choices]
    assert chunks[-1]["usage"] == together.json()["usage"]
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"
    assert token_ids.status_code == 400 and "list of strings" in token_ids.json()["error"]["message"]
