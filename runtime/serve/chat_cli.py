"""`mlcc chat`: a terminal chat that streams tokens (or answers one --prompt and exits)."""

from __future__ import annotations

import sys
import time

from mlcc.options import EngineConfig
from mlcc.runtime.engine import Engine


# What an interactive chat samples with where neither the user nor the model's generation_config says (Ollama's
# defaults): greedy decoding of small models tends to repeat one sentence until the token limit.
INTERACTIVE_SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}


def sampling_for(engine: Engine, given: dict[str, float | None]) -> dict[str, float]:
    """The sampling of a chat: the flags the user gave (those not given stay neutral); none given: the model's
    generation_config, else INTERACTIVE_SAMPLING."""
    chosen = {k: v for k, v in given.items() if v is not None}
    if chosen:
        return chosen
    return dict(engine.tokenizer.info.get("generation_defaults") or INTERACTIVE_SAMPLING)


def run_chat(model: str | None, config: EngineConfig | None = None, prompt: str | None = None,
             max_tokens: int = 256, sampling: dict[str, float | None] | None = None) -> int:
    """config: the engine's settings (mlcc.options.EngineConfig; default: batch 1); sampling: temperature, top_p,
    top_k, repetition_penalty as given on the command line (None: not given; see sampling_for). With LoRA adapters
    (config.lora) it answers with the first."""
    t0 = time.time()
    engine = Engine(model, config=config or EngineConfig(max_batch=1))
    params = sampling_for(engine, sampling or {})
    adapter = next(iter(engine.config.lora or {}), None)
    print(f"[{engine.model_name}{f' with LoRA adapter {adapter}' if adapter else ''} on "
          f"{engine.model.config['target']}, ready in {time.time() - t0:.1f}s; sampling "
          f"{', '.join(f'{k} {v}' for k, v in params.items())}]", file=sys.stderr)
    history: list[dict[str, str]] = []
    try:
        while True:
            if prompt is not None:
                text = prompt
            else:
                try:
                    text = input(">>> ")
                except EOFError:
                    return 0
                if text.strip() in ("/exit", "/quit"):
                    return 0
                if text.strip() == "/reset":
                    history.clear()
                    continue
                if not text.strip():
                    continue
            history.append({"role": "user", "content": text})
            answer, t1, n, finish = "", time.time(), 0, None
            for chunk in engine.chat.completions.create(messages=history, model=adapter, stream=True,
                                                        max_tokens=max_tokens,
                                                        stream_options={"include_usage": True}, **params):
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.choices and chunk.choices[0].delta.content:
                    answer += chunk.choices[0].delta.content
                    sys.stdout.write(chunk.choices[0].delta.content)
                    sys.stdout.flush()
                if chunk.usage:
                    n = chunk.usage.completion_tokens
            dt = time.time() - t1
            print()
            print(f"[{n} tokens, {n / dt:.1f} tok/s]", file=sys.stderr)
            if finish == "length":
                print(f"[the answer was cut at the token limit ({max_tokens}); raise it with --max-tokens]",
                      file=sys.stderr)
            history.append({"role": "assistant", "content": answer})
            if prompt is not None:
                return 0
    finally:
        engine.shutdown()
