"""The OpenAI API's pure parts, no torch and no server: request schema (every error a 400), the
response mappings, chat templates, the error map, and the rules for 429, Retry-After and the
API key. Runs on Python 3.8 too."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from mdiedge.base.request import Asked, SamplingParams
from mdiedge.base.errors import (ApiError, CheckpointError, ConfigError, Conflict, ContextExceeded,
                                 FrameError, GenerationError, QueueFull, RingError)
from mdiedge.serving.api.chat import DEFAULT_TEMPLATE, ChatTemplate, load_model_template
from mdiedge.serving.api.errors import api_error
from mdiedge.serving.api.responses import (ChatChunk, ChatCompletion, Choice, Completion,
                                           CompletionChunk, Usage, finish_reason, sse)
from mdiedge.serving.api.rules import (KvModel, authorized, retry_after_s, slot_context,
                                       slot_shape)
from mdiedge.serving.api.server import model_name
from mdiedge.serving.api.schema import ChatMessage, ChatRequest, CompletionRequest, Options


def status_of(body: Dict[str, Any], chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as caught:
        (ChatRequest if chat else CompletionRequest).from_json(body)
    return caught.value


@pytest.mark.parametrize("body, status, param, quoted", [
    ({}, 400, "prompt", "missing"),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "'5'"),
    ({"prompt": "x", "temperature": True}, 400, "temperature", "True"),
    ({"prompt": "x", "stop": [1]}, 400, "stop", "[1]"),
    ({"prompt": "x", "bogus": 1}, 400, "bogus", "unknown"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream", "'yes'"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "0"),
    ({"prompt": "x", "n": 0}, 400, "n", "0"),
    ({"prompt": "x", "temperature": 2.5}, 400, "temperature", "2.5"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", "0"),
    ({"prompt": "x", "seed": -1}, 400, "seed", "-1"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", "2.5"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "21"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs", "True"),
    ({"prompt": "x", "min_p": 1.5}, 400, "min_p", "1.5"),
    ({"prompt": "x", "repeat_penalty": 0}, 400, "repeat_penalty", "0"),
    ({"prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias", "'x'"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", "101"),
    ({"prompt": "x", "logit_bias": [1]}, 400, "logit_bias", "[1]"),
    ({"prompt": "x", "echo": 1}, 400, "echo", "1"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix", "'y'"),
    ({"prompt": "x", "best_of": 1, "n": 2}, 400, "best_of", "got 1"),
    ({"prompt": "x", "best_of": 3, "stream": True}, 400, "best_of", "cannot be streamed"),
    ({"prompt": ["a", 1]}, 400, "prompt", "['a', 1]"),
    ({"prompt": [[1], []]}, 400, "prompt", "[[1], []]"),
    ({"prompt": []}, 400, "prompt", "[]"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, 400, "stream_options", "1"),
])
def test_a_completion_body_that_does_not_fit_names_field_and_value(
        body: Dict[str, Any], status: int, param: str, quoted: str) -> None:
    error = status_of(body)
    assert (error.status, error.param) == (status, param)
    assert quoted in error.message and error.message.startswith(param)
    assert error.to_json()["error"]["type"] == "invalid_request_error"


def test_a_completion_body_is_read_with_defaults_and_neutral_fields() -> None:
    request = CompletionRequest.from_json({
        "prompt": ["Once"], "model": "m", "max_tokens": 7, "temperature": 0, "top_p": 0.5,
        "seed": 3, "stop": "\n", "n": 2, "stream": True, "presence_penalty": 0,
        "frequency_penalty": 0.0, "logit_bias": {}, "user": "u", "echo": False,
        "stream_options": {"include_usage": True}, "top_k": None})
    assert request.prompts == ["Once"] and (request.echo, request.best_of) == (False, 2)
    assert CompletionRequest.from_json({"prompt": [[1, 2], [3]]}).prompts == [(1, 2), (3,)]
    assert CompletionRequest.from_json({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert request.options == Options("m", Asked(7, 2, SamplingParams(0.0, top_p=0.5, seed=3),
                                                 ("\n",)), True, True, seeded=True)
    plain = CompletionRequest.from_json({"prompt": "x"}).options
    assert plain == Options(asked=Asked(params=SamplingParams(seed=plain.asked.params.seed)))


@pytest.mark.parametrize("messages, status, quoted", [
    ([], 400, "got 0"),
    ("hi", 400, "'hi'"),
    ([{"role": "robot", "content": "x"}], 400, "'robot'"),
    (["hi"], 400, "'hi'"),
    ([{"role": "user", "content": 5}], 400, "5"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], 400, "image_url"),
    ([{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     400, "tool_calls"),
    ([{"role": "tool", "content": "x"}], 400, "tool_call_id"),
])
def test_a_chat_body_that_does_not_fit_is_refused(messages: Any, status: int, quoted: str) -> None:
    error = status_of({"messages": messages}, chat=True)
    assert error.status == status and quoted in error.message and error.param == "messages"


def test_chat_takes_completions_neutral_values_and_refuses_others() -> None:
    messages = [{"role": "user", "content": "x"}]
    ChatRequest.from_json({"messages": messages, "echo": False, "best_of": 1})
    with pytest.raises(ApiError, match="best_of: not supported by this server, got 2"):
        ChatRequest.from_json({"messages": messages, "best_of": 2})


def test_chat_messages_take_text_parts_and_max_completion_tokens() -> None:
    request = ChatRequest.from_json({
        "messages": [{"role": "system", "content": None},
                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 9, "max_tokens": 3})
    assert request.messages == [ChatMessage("system", ""), ChatMessage("user", "ab")]
    assert request.options.asked.max_new_tokens == 9


def test_responses_map_to_openai_json() -> None:
    usage = Usage(3, 4)
    assert usage.to_json() == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    assert Usage(9, 1, 8).to_json()["prompt_tokens_details"] == {"cached_tokens": 8}
    done = [Choice(0, "hi", "eos"), Choice(1, "ho", "length")]
    body = Completion("cmpl-1", 5, "m", done, usage).to_json()
    assert body["object"] == "text_completion"
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [("hi", "stop"),
                                                                        ("ho", "length")]
    chat = ChatCompletion("c-1", 5, "m", done, usage).to_json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    first = ChatChunk("c-1", 5, "m", [Choice(0, "")], role=True).to_json()
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = ChatChunk("c-1", 5, "m", [Choice(0, "", "stop")]).to_json()
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    tail = CompletionChunk("cmpl-1", 5, "m", [], usage=usage).to_json()
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 7


@pytest.mark.parametrize("ours, theirs", [("eos", "stop"), ("stop", "stop"),
                                          ("length", "length"), (None, None)])
def test_finish_reasons_map_to_openai(ours: Any, theirs: Any) -> None:
    assert finish_reason(ours) == theirs


def test_an_event_is_one_data_line_and_a_blank_line() -> None:
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"a": "é\n"}) == 'data: {"a": "é\\n"}\n\n'.encode()


def test_the_default_template_is_a_plain_dialogue() -> None:
    text = ChatTemplate().render([ChatMessage("system", "Be terse."), ChatMessage("user", "Hi")])
    assert text == "SYSTEM:\nBe terse.\n\nUSER:\nHi\n\nASSISTANT:\n"


LLAMA2_LIKE = ("{{ bos_token }}{% for m in messages %}"
               "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
               "{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]"
               "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def write_config(folder: Path, **config: Any) -> Path:
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_model_template_renders_as_transformers_does(tmp_path: Path) -> None:
    folder = write_config(tmp_path, chat_template=LLAMA2_LIKE, eos_token="</s>",
                          bos_token={"content": "<s>", "lstrip": False})
    template = ChatTemplate.for_model(folder)
    assert not template.is_default
    text = template.render([ChatMessage("user", " hi "), ChatMessage("assistant", "yo"),
                            ChatMessage("user", "more")])
    assert text == "<s>[INST] hi [/INST] yo</s>[INST] more [/INST]"  # its ids get nothing added


def test_a_template_refusal_is_a_400_with_its_message(tmp_path: Path) -> None:
    template = ChatTemplate.for_model(write_config(tmp_path, chat_template=LLAMA2_LIKE))
    with pytest.raises(ApiError, match="roles must alternate") as caught:
        template.render([ChatMessage("assistant", "x")])
    assert caught.value.status == 400


def test_named_templates_a_jinja_file_and_none(tmp_path: Path) -> None:
    named = write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "T"},
                                                  {"name": "default", "template": "D"}])
    assert load_model_template(named)["template"] == "D"
    (tmp_path / "tokenizer_config.json").unlink()
    assert load_model_template(tmp_path) == {"template": None}
    assert ChatTemplate.for_model(tmp_path).source == DEFAULT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert ChatTemplate.for_model(tmp_path).render([ChatMessage("user", "x")]) == "1"


def test_a_broken_template_is_a_config_error_naming_its_line() -> None:
    with pytest.raises(ConfigError, match="line 2"):
        ChatTemplate("ok\n{% for %}")


def test_a_template_cannot_reach_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ApiError):
        template.render([ChatMessage("user", "x")])


@pytest.mark.parametrize("error, status", [
    (GenerationError("prompt too long"), 400),
    (RingError("w2 is down"), 503),
    (Conflict("busy"), 503),
    (ConfigError("bad"), 400),
    (QueueFull("64 requests are waiting already"), 429),
    (FrameError("bad magic"), 503),
    (CheckpointError("truncated"), 500),
    (RuntimeError("boom"), 500),
    (ApiError(429, "full", retry_after=3), 429),
])
def test_errors_map_to_status_codes(error: Exception, status: int) -> None:
    mapped = api_error(error)
    assert mapped.status == status and str(error) in mapped.message
    assert set(mapped.to_json()["error"]) == {"message", "type", "param", "code"}


def test_a_prompt_beyond_the_context_is_a_400_that_says_so() -> None:
    mapped = api_error(ContextExceeded("prompt of 9 tokens plus 8 new tokens exceeds the 16 "
                                       "set up on this pipeline"))
    assert (mapped.status, mapped.code) == (400, "context_length_exceeded")


def test_a_429_and_a_503_say_when_to_retry() -> None:
    assert ApiError(429, "full", retry_after=3).headers() == {"Retry-After": "3"}
    assert api_error(RingError("down")).headers()["Retry-After"].isdigit()
    assert ApiError(400, "bad").headers() == {}


@pytest.mark.parametrize("mean, waiting, slots, seconds", [
    (0.0, 0, 8, 1), (2.0, 0, 8, 2), (2.0, 8, 8, 4), (2.5, 4, 8, 4), (100.0, 64, 1, 60),
])
def test_retry_after_is_the_queue_drain_time(mean: float, waiting: int, slots: int,
                                             seconds: int) -> None:
    assert retry_after_s(mean, waiting, slots) == seconds


@pytest.mark.parametrize("header, key, ok", [
    (None, None, True), ("Bearer x", None, True), (None, "k", False), ("Bearer k", "k", True),
    ("Bearer k2", "k", False), ("k", "k", False), ("bearer k", "k", True),
    ("BEARER k", "k", True), ("Bearer  k", "k", True), ("Basic k", "k", False),
    ("Bearerk", "k", False), ("Bearer", "k", False), ("Bearer ", "k", False),
])
def test_the_api_key_is_checked(header: Any, key: Any, ok: bool) -> None:
    assert authorized(header, key) is ok


@pytest.mark.parametrize("path, name", [
    ("/x/models/nanollama", "nanollama"),
    ("/x/stories260K.bin", "stories260K"),
    ("/c/hub/models--TinyLlama--TinyLlama-1.1B-Chat-v1.0/snapshots/ab12",
     "TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
    ("/x/snapshots/ab12", "ab12"),
    ("/x/Llama-3.2-1B", "Llama-3.2-1B"),
])
def test_the_served_model_id(path: str, name: str) -> None:
    assert model_name(Path(path)) == name


@pytest.mark.parametrize("asked, model, context", [
    (0, 1024, 1024), (0, 131072, 4096), (512, 131072, 512), (300, 1024, 300),
])
def test_the_context_of_a_slot(asked: int, model: int, context: int) -> None:
    assert slot_context(asked, model) == context


MiB, GiB = 1 << 20, 1 << 30
# SmolLM2-135M in float32: 30 blocks of 3 KV heads of 64; 45 KiB a token for all 30 blocks
SMOLLM2 = KvModel(blocks=30, kv_heads=3, head_dim=64, itemsize=4, max_context=8192)
PER_TOKEN = 2 * 30 * 3 * 64 * 4
NANO = KvModel(blocks=12, kv_heads=2, head_dim=32, itemsize=4, max_context=1024)  # 6 KiB/token


@pytest.mark.parametrize("model, available, blocks, slots, context, want, chosen", [
    # plenty: the most, 8 slots of the model's context up to 4096
    (SMOLLM2, 24 * GiB, 30, None, None, (8, 4096), "memory"),
    (NANO, 24 * GiB, 12, None, None, (8, 1024), "memory"),
    # a 4 GB board with 2.9 GiB available: a quarter holds 4 slots of 4096 (720 MiB)
    (SMOLLM2, int(2.9 * GiB), 30, None, None, (4, 4096), "memory"),
    # 1 GiB: 256 MiB for 5825 tokens, one slot of 4096
    (SMOLLM2, GiB, 30, None, None, (1, 4096), "memory"),
    # 256 MiB: 1456 tokens, one slot of the context halved to 1024
    (SMOLLM2, 256 * MiB, 30, None, None, (1, 1024), "memory"),
    # too little for even one slot of 512: the floor anyway
    (SMOLLM2, 16 * MiB, 30, None, None, (1, 512), "memory"),
    (NANO, 16 * MiB, 12, None, None, (1, 512), "memory"),
    # a model whose own context is under the floor keeps its own
    (KvModel(30, 3, 64, 4, 256), 1 * MiB, 30, None, None, (1, 256), "memory"),
    # one node of a ring of three holds 10 blocks: three times the tokens of 30
    (SMOLLM2, GiB, 10, None, None, (4, 4096), "memory"),
    # half-size values (bfloat16) hold twice the tokens
    (KvModel(30, 3, 64, 2, 8192), GiB, 30, None, None, (2, 4096), "memory"),
    # --slots given: the context is sized for that many slots
    (SMOLLM2, GiB, 30, 4, None, (4, 1024), "memory"),
    (SMOLLM2, 24 * GiB, 30, 2, None, (2, 4096), "memory"),
    # --context given: as many slots of it as fit, up to 8
    (SMOLLM2, GiB, 30, None, 1024, (5, 1024), "memory"),
    (SMOLLM2, GiB, 30, None, 0, (1, 4096), "memory"),  # 0: the model's, at most 4096
    (SMOLLM2, 16 * MiB, 30, None, 8192, (1, 8192), "memory"),
    # both given: used as they are, whatever the memory
    (SMOLLM2, 16 * MiB, 30, 8, 4096, (8, 4096), "given"),
    (SMOLLM2, 24 * GiB, 30, 2, 0, (2, 4096), "given"),
    # memory unknown: the most, as before
    (SMOLLM2, None, 30, None, None, (8, 4096), "unknown"),
    (SMOLLM2, None, 30, 3, None, (3, 4096), "unknown"),
])
def test_serve_sizes_its_slots_and_context_from_memory(model: KvModel, available: Any,
                                                        blocks: int, slots: Any, context: Any,
                                                        want: Any, chosen: str) -> None:
    shape = slot_shape(model, available, blocks, slots, context)
    assert (shape.slots, shape.context) == want and shape.chosen == chosen
    assert shape.kv_bytes == want[0] * want[1] * model.position_bytes(blocks)
    assert shape.most == (slots or 8, context or min(model.max_context, 4096))  # memory enough
    above_floor = want[1] > 512 if context is None else want[0] > 1
    if chosen == "memory" and above_floor:
        assert shape.kv_bytes <= available // 4  # within the share, unless at the floor


def test_a_token_of_smollm2_takes_45_kib_of_kv_cache() -> None:
    assert SMOLLM2.position_bytes(30) == PER_TOKEN == 45 * 1024


def test_the_api_key_is_the_files_first_line(tmp_path, monkeypatch) -> None:
    from mdiedge.serving.api.server import API_KEY_ENV, read_api_key

    key = tmp_path / "key"
    key.write_text("  s3cret-key  \n# rotated 2026-11-01\n")
    key.chmod(0o600)
    assert read_api_key(str(key)) == "s3cret-key"
    key.write_text("")
    with pytest.raises(ConfigError, match="the file is empty"):
        read_api_key(str(key))
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert read_api_key(None) == "from-env"


def test_fields_openais_clients_send_are_ignored_and_sampling_fields_read() -> None:
    from mdiedge.serving.api.schema import IGNORED
    body = {"messages": [{"role": "assistant", "content": "a", "refusal": None,
                          "annotations": []}, {"role": "user", "content": "b"}],
            "store": True, "metadata": {"k": "v"}, "service_tier": "auto", "user": 5,
            "reasoning_effort": "low", "modalities": ["text"], "prediction": {"x": 1},
            "audio": None, "stream_options": {"include_usage": True, "other": 1},
            "presence_penalty": 0.5, "frequency_penalty": -1, "repeat_penalty": 1.2,
            "min_p": 0.1, "logit_bias": {"7": -100, " 9": 2.5}, "logprobs": True,
            "top_logprobs": 3}
    assert {"store", "metadata", "service_tier", "user", "reasoning_effort"} <= set(IGNORED)
    params = ChatRequest.from_json(body).options.asked.params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.min_p, params.logit_bias, params.top_logprobs) == \
        (0.5, -1.0, 1.2, 0.1, ((7, -100.0), (9, 2.5)), 3)
    assert ChatRequest.from_json({"messages": [{"role": "user", "content": "x"}],
                                  "logprobs": True}).options.top_logprobs == 0
    assert CompletionRequest.from_json({"prompt": "x", "logprobs": 0}).options.top_logprobs == 0
    assert CompletionRequest.from_json({"prompt": "x"}).options.top_logprobs is None


@pytest.mark.parametrize("extra, param, quoted", [
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "21"),
    ({"logprobs": 2}, "logprobs", "2"),
])
def test_chat_logprobs_out_of_shape_are_400s(extra: Dict[str, Any], param: str,
                                            quoted: str) -> None:
    error = status_of(dict({"messages": [{"role": "user", "content": "x"}]}, **extra), chat=True)
    assert (error.status, error.param) == (400, param) and quoted in error.message


def test_the_key_may_come_as_x_api_key() -> None:
    assert authorized(None, "k", "k") and authorized("Bearer k", "k", "wrong")
    assert not authorized(None, "k", "wrong") and not authorized("Bearer x", "k", None)


@pytest.mark.parametrize("given, mode, itemsize", [
    (dict(), "q8", 2),                      # a torch-free CPU node in the q8 mode: float16
    (dict(), "f32", 4),                     # the exact mode keeps float32
    (dict(torch_cpu=True), "q8", 4),        # the torch model's cache: its compute dtype
    (dict(device="cuda"), "q8", 4),
])
def test_serve_sizes_the_cache_that_its_nodes_hold(monkeypatch: pytest.MonkeyPatch,
                                                   given: Dict[str, Any], mode: str,
                                                   itemsize: int) -> None:
    from mdiedge.base import cpudot
    from mdiedge.base.engineoptions import EngineOptions
    from mdiedge.cli import serve

    monkeypatch.setenv(cpudot.ENV, mode)
    cpudot.set_cpu_dot(None)
    try:
        assert serve.kv_itemsize(EngineOptions(**given)) == itemsize
    finally:
        monkeypatch.undo()
        cpudot.set_cpu_dot(None)
