"""gpt-oss's harmony replies: the analysis channel as reasoning_content, the final channel as content, messages
addressed to=functions.NAME as tool calls; streamed in pieces of every size, as the engine chains the reasoning
parser and the tool-call parser (runtime.api.call)."""

from __future__ import annotations

import pytest

from mlcc.runtime.api import reasoning, tool_calls
from mlcc.runtime.api.tool_calls.formats import HARMONY
from mlcc.runtime.api.tool_calls.harmony import HarmonyReasoningParser

# the markers of gpt-oss's chat template (its real one renders many more)
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if tools %}{{ tools | tojson }}{% endif %}<|start|>assistant<|channel|>")

CALL = ('<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>'
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"location": "Paris", "unit": "C"}<|call|>')
ANSWER = ('<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>'
          'It is 4.<|return|>')
# the recipient before the channel, a preamble on commentary, two calls
TWO_CALLS = ('<|channel|>commentary<|message|>Checking both.<|end|>'
             '<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|call|>'
             '<|start|>assistant to=functions.b<|channel|>commentary json<|message|>{}<|call|>')


def run(text: str, step: int) -> tuple[str, str, list[dict], list]:
    """(reasoning, content, calls, tool-call deltas) as Call streams them."""
    fmt = HARMONY
    r, t = reasoning.make_parser("openai_gptoss"), tool_calls.tool_call_parser(fmt, None)
    thought, deltas = "", []
    pieces = [p for i in range(0, len(text), step) for p in r.feed(text[i:i + step])] + r.flush()
    for kind, s in pieces:
        if kind == "reasoning":
            thought += s
        else:
            deltas += t.feed(s)
    deltas += t.flush()
    content, calls = t.finish()
    assert "".join(d.content or "" for d in deltas) == (content or "")
    return thought, content, calls, [d for d in deltas if d.index is not None]


@pytest.mark.parametrize("step", [1, 2, 7, 10_000])
def test_analysis_is_reasoning_and_final_is_content(step):
    thought, content, calls, _ = run(ANSWER, step)
    assert (thought, content, calls) == ("2 + 2 is 4.", "It is 4.", [])


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_a_call_message_is_a_tool_call(step):
    thought, content, calls, deltas = run(CALL, step)
    assert thought == "The user wants the weather. Call the tool."
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"location": "Paris", "unit": "C"}')]
    assert deltas[0].name == "get_weather" and deltas[0].id == calls[0]["id"]
    assert "".join(d.arguments or "" for d in deltas) == calls[0]["function"]["arguments"]


@pytest.mark.parametrize("step", [1, 10_000])
def test_recipient_before_the_channel_and_two_calls(step):
    _, content, calls, _ = run(TWO_CALLS, step)
    assert content == "Checking both."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("a", '{"x": 1}'), ("b", "{}")]


def test_cut_off_while_thinking_is_all_reasoning():
    r = HarmonyReasoningParser()
    r.feed("<|channel|>analysis<|message|>Let me th")
    assert r.finish() == ("Let me th", "")


def test_a_harmony_template_selects_the_format():
    assert tool_calls.tool_call_format(HARMONY_TEMPLATE, "gpt_oss").name == "harmony"
    assert tool_calls.template_takes_tools(HARMONY_TEMPLATE)
