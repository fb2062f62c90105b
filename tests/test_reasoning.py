"""Reasoning models (runtime/api/reasoning.py): <think>...</think> split into message.reasoning_content / reasoning
and streamed as reasoning deltas, with the parsers vLLM names deepseek_r1 and qwen3; chat_template_kwargs reaching
the template; tool calls still parsed after the reasoning; a grammar waiting for the reasoning to end.

Replies are read back from Qwen3's published chat template (tests/templates/qwen3.jinja) rendering an assistant
turn, and from DeepSeek-R1's (tests/templates/deepseek_r1.jinja), which opens the reasoning in the prompt; through
the engine, random weights are made to write a reasoning block by a regex grammar."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import write_tokenizer

from mlcc import Engine
from mlcc.errors import EngineConfigError
from mlcc.options import EngineConfig
from mlcc.runtime.api.call import Call, CallSpec
from mlcc.runtime.api.reasoning import ReasoningGate, ReasoningParser
from mlcc.runtime.api.tool_calls import FORMATS, ToolCallParser
from mlcc.runtime.core.request import Event
from mlcc.runtime.core.sampler import SamplingParams
from mlcc.runtime.core.tokenizer import _compile_template

QWEN3 = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()
DEEPSEEK_R1 = (Path(__file__).parent / "templates" / "deepseek_r1.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _render(template: str, messages: list[dict], **kw) -> str:
    msgs = [{**m, "content": m.get("content") or ""} for m in messages]
    return _compile_template(template).render(messages=msgs, bos_token="", eos_token="", **kw)


def _assistant_reply(messages: list[dict], **kw) -> str:
    """What the model wrote in the last (assistant) turn, as Qwen3's template renders it."""
    text = _render(QWEN3, messages, **kw)
    head = _render(QWEN3, messages[:-1], add_generation_prompt=True, **kw)
    assert text.startswith(head) and text.endswith("<|im_end|>\n"), text
    return text[len(head):-len("<|im_end|>\n")]


class _Engine:
    """What a Call needs of an engine to shape events (runtime.engine.Engine for the rest)."""

    class tokenizer:
        @staticmethod
        def stream(skip_special_tokens: bool = True) -> None:
            return None


def _call(kind: str, tools: list[dict] | None) -> Call:
    return Call(_Engine(), CallSpec(
        True, [1], SamplingParams(), 100, make_reasoner=lambda: ReasoningParser(kind),
        make_parser=(lambda: ToolCallParser(FORMATS["hermes"], tools, id_factory=lambda: "call_x")) if tools else None))


def _stream(kind: str, reply: str, tools: list[dict] | None, seed: int) -> dict:
    """The reply streamed through a Call in random pieces, its chunks reassembled."""
    call, rng, i = _call(kind, tools), random.Random(seed), 0
    chunks = []
    while i < len(reply):
        n = rng.randint(1, 6)
        chunks += call.stream_event(0, Event("delta", reply[i:i + n]))
        i += n
    chunks += call.stream_event(0, Event("finish", finish_reason="stop"))
    out = {"reasoning_content": "", "reasoning": "", "content": "", "calls": {}, "finish": None}
    for c in chunks:
        d = c.model_dump()["choices"][0]["delta"]
        assert (d.get("reasoning_content") is None) == (d.get("reasoning") is None)
        out["reasoning_content"] += d.get("reasoning_content") or ""
        out["reasoning"] += d.get("reasoning") or ""
        out["content"] += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            slot = out["calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
            slot["name"] = slot["name"] or tc["function"]["name"]
            slot["arguments"] += tc["function"]["arguments"] or ""
        out["finish"] = c.choices[0].finish_reason or out["finish"]
    return out


def _whole(kind: str, reply: str, tools: list[dict] | None):
    call = _call(kind, tools)
    call.collect(0, Event("delta", reply))
    call.collect(0, Event("finish", finish_reason="stop"))
    return call.result().choices[0]


@pytest.mark.parametrize("calls", [False, True])
def test_qwen3_template_turn_reads_back(calls):
    """An assistant turn with reasoning_content (and tool calls) rendered by Qwen3's template and parsed back."""
    thought = "The user wants the weather.\nI should call the tool."
    msg = {"role": "assistant", "content": "Let me check." if calls else "It is sunny in Paris.",
           "reasoning_content": thought}
    if calls:
        msg["tool_calls"] = [{"id": "call_x", "type": "function",
                              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    reply = _assistant_reply([{"role": "user", "content": "Weather in Paris?"}, msg],
                             tools=[WEATHER] if calls else None)
    assert reply.startswith("<think>\n" + thought + "\n</think>\n\n")
    tools = [WEATHER] if calls else None
    c = _whole("qwen3", reply, tools)
    assert c.message.reasoning_content == c.message.reasoning == "\n" + thought + "\n"
    assert c.message.content == msg["content"]
    if calls:
        assert c.finish_reason == "tool_calls"
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
    else:
        assert c.finish_reason == "stop" and c.message.tool_calls is None
    for seed in range(15):
        s = _stream("qwen3", reply, tools, seed)
        assert s["reasoning_content"] == s["reasoning"] == c.message.reasoning_content
        assert s["content"].strip() == c.message.content
        assert s["finish"] == c.finish_reason
        assert [(v["name"], v["arguments"]) for _, v in sorted(s["calls"].items())] == [
            (t.function.name, t.function.arguments) for t in c.message.tool_calls or []]


def test_enable_thinking_false_reaches_the_template():
    """chat_template_kwargs {"enable_thinking": false}: Qwen3's template closes an empty <think> in the prompt, the
    reply has none, and qwen3 reads it all as content (deepseek_r1 would read it as unfinished reasoning)."""
    ask = [{"role": "user", "content": "Hi"}]
    assert _render(QWEN3, ask, add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    off = _render(QWEN3, ask, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    c = _whole("qwen3", "Hello! How can I help?", None)
    assert c.message.content == "Hello! How can I help?"
    assert not {"reasoning", "reasoning_content"} & set(c.message.model_dump(exclude_none=True))


def test_deepseek_r1_reads_up_to_the_close_tag():
    """deepseek_r1: the template opened <think> in the prompt, so the reply starts inside the reasoning."""
    c = _whole("deepseek_r1", "Okay, 2 + 2.\nThat is 4.\n</think>\n\nThe answer is 4.", None)
    assert (c.message.reasoning_content, c.message.content) == ("Okay, 2 + 2.\nThat is 4.\n", "The answer is 4.")
    c = _whole("deepseek_r1", "<think>\nshort\n</think>\nDone", None)
    assert (c.message.reasoning, c.message.content) == ("\nshort\n", "Done")
    c = _whole("deepseek_r1", "cut off while thinking", None)   # max_tokens inside the reasoning
    assert (c.message.reasoning, c.message.content) == ("cut off while thinking", "")
    # qwen3 reads <think> only where it opens the reply
    c = _whole("qwen3", "No <think> here", None)
    assert (getattr(c.message, "reasoning", None), c.message.content) == (None, "No <think> here")
    for text in ("Okay.\n</think>\n\n4", "<think>a</think>b", "<thi", "plain"):
        for kind in ("deepseek_r1", "qwen3"):
            want = _whole(kind, text, None).message
            for seed in range(10):
                s = _stream(kind, text, None, seed)
                assert s["reasoning_content"] == (getattr(want, "reasoning_content", None) or "")
                assert s["content"] == want.content


@pytest.mark.parametrize("opened", [True, False], ids=["prompt-opened", "reply-opened"])
def test_deepseek_r1_template_reply_reads_back(opened):
    """DeepSeek-R1's published template (tests/templates/deepseek_r1.jinja) ends the generation prompt with
    `<think>\\n`, so the reply holds only `...</think>answer`; a reply that opens its own `<think>` reads the same.
    What deepseek_r1 takes as the content is what the template keeps of the turn in the next prompt."""
    ask = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    prompt = _render(DEEPSEEK_R1, ask, add_generation_prompt=True)
    assert prompt == "Be brief.<｜User｜>What is 2 + 2?<｜Assistant｜><think>\n"
    thought, answer = "Two plus two.\nThat is 4.\n", "The answer is 4."
    reply = thought + "</think>\n\n" + answer if opened else "<think>" + thought + "</think>" + answer
    c = _whole("deepseek_r1", reply, None)
    assert (c.message.reasoning_content, c.message.reasoning, c.message.content) == (thought, thought, answer)
    assert c.finish_reason == "stop" and c.message.tool_calls is None
    for seed in range(15):
        s = _stream("deepseek_r1", reply, None, seed)
        assert (s["reasoning_content"], s["reasoning"], s["content"]) == (thought, thought, answer)
    # the template drops the reasoning from history, keeping what follows </think> (whitespace included, which the
    # parser drops)
    kept = reply.split("</think>")[-1]
    history = _render(DEEPSEEK_R1, [*ask, {"role": "assistant", "content": reply}])
    assert history == prompt.removesuffix("<think>\n") + kept + "<｜end▁of▁sentence｜>"
    assert kept.lstrip() == c.message.content


def test_reasoning_parser_setting():
    assert EngineConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(EngineConfigError, match="deepseek_r1"):
        EngineConfig(reasoning_parser="r1")


def test_a_grammar_waits_for_the_reasoning(tmp_path):
    """With <think>/</think> single tokens, a grammar (here: a JSON schema) applies after </think>: deepseek_r1
    thinks from the first token, qwen3 may open <think> as its first token or answer at once."""
    from tokenizers import AddedToken, Tokenizer

    from mlcc.runtime.api.structured import GrammarCompiler, json_schema_spec

    write_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    tok.save(str(tmp_path / "tokenizer.json"))
    start, end, eos = (tok.token_to_id(t) for t in ("<think>", "</think>", "<|im_end|>"))
    gc = GrammarCompiler(tmp_path / "tokenizer.json", 320, {eos})
    grammar = gc.compile(json_schema_spec({"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"], "additionalProperties": False}, "response_format"))
    mask = gc.allocate_mask(1)

    def allowed() -> set[int]:
        return set(np.nonzero(np.unpackbits(mask[0].view(np.uint8), bitorder="little"))[0].tolist())

    brace = tok.encode("{", add_special_tokens=False).ids[0]
    text_ids = tok.encode("hm, a is 1", add_special_tokens=False).ids
    for kind, lead in (("deepseek_r1", []), ("qwen3", [start])):
        g = ReasoningGate(gc.matcher(grammar), kind, start, end)
        if lead:   # qwen3: the grammar's first tokens, or <think>
            g.fill_mask(mask, 0)
            assert allowed() == {brace, start}
            g.accept(start)
        for t in text_ids:
            g.fill_mask(mask, 0)
            assert t in allowed() and len(allowed()) >= 300   # free while thinking
            g.accept(t)
        g.fill_mask(mask, 0)
        assert end in allowed()
        g.accept(end)
        for t in tok.encode('{"a": 1}', add_special_tokens=False).ids:
            g.fill_mask(mask, 0)
            assert t in allowed() and text_ids[0] not in allowed()
            g.accept(t)
        g.fill_mask(mask, 0)
        assert allowed() == {eos} and g.is_done()
    g = ReasoningGate(gc.matcher(grammar), "qwen3", start, end)   # no <think>: the grammar from the first token
    g.accept(brace)
    g.fill_mask(mask, 0)
    assert start not in allowed() and end not in allowed()


@pytest.fixture(scope="module")
def qwen3_engine(compiled, tmp_path_factory):
    """The tiny model with Qwen3's chat template and the qwen3 reasoning parser."""
    art = tmp_path_factory.mktemp("qwen3tpl") / "model"
    shutil.copytree(compiled("llama", "q0f32"), art)
    cfg = json.loads((art / "mlcc-config.json").read_text())
    cfg["tokenizer"]["chat_template"] = QWEN3
    (art / "mlcc-config.json").write_text(json.dumps(cfg))
    e = Engine(art, target="llvm", max_batch=2, reasoning_parser="qwen3")
    yield e
    e.shutdown()


THINK = r"<think>\n[a-z]{3,12}( [a-z]{3,12}){0,3}\n</think>\n\n[A-Z][a-z]{2,10}\."


def test_reasoning_fields_through_the_engine(qwen3_engine):
    """Random weights made to think by a regex: the reply's reasoning comes back in reasoning_content and
    reasoning, the rest in content, whole and streamed alike; chat_template_kwargs reaches the template."""
    e = qwen3_engine
    kw = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 80, "temperature": 1.0, "seed": 3,
          "structured_outputs": {"regex": THINK}}
    m = e.chat.completions.create(**kw).choices[0].message
    assert re.fullmatch(r"\n[a-z ]+\n", m.reasoning_content) and m.reasoning == m.reasoning_content
    assert re.fullmatch(r"[A-Z][a-z]+\.", m.content)
    got = {"reasoning_content": "", "reasoning": "", "content": ""}
    for chunk in e.chat.completions.create(**kw, stream=True):
        d = chunk.choices[0].delta.model_dump() if chunk.choices else {}
        for k in got:
            got[k] += d.get(k) or ""
    assert got == {"reasoning_content": m.reasoning_content, "reasoning": m.reasoning, "content": m.content}
    on = e.encode_chat(kw["messages"])
    from mlcc.runtime.api.prepare import chat_call

    off = chat_call(e, {"messages": kw["messages"], "chat_template_kwargs": {"enable_thinking": False}}).ids
    assert e.tokenizer.tok.decode(off[len(on):]) == "<think>\n\n</think>\n\n" and off[:len(on)] == on


def test_without_a_parser_nothing_changes(compiled):
    """No reasoning parser: <think> stays in the content and no reasoning fields appear."""
    with Engine(compiled("llama", "q0f32"), target="llvm", max_batch=1) as e:
        kw = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 80, "temperature": 1.0, "seed": 3,
              "structured_outputs": {"regex": THINK}}
        m = e.chat.completions.create(**kw).choices[0].message
        assert m.content.startswith("<think>\n") and "</think>" in m.content
        assert "reasoning_content" not in m.model_dump() and "reasoning" not in m.model_dump()

