"""The chat template of a model whose files carry none (some GGUF conversions, bare checkpoints): the template of
its family, recognised by the turn markers its tokenizer has, as llama.cpp and Ollama fall back to theirs.

Each template renders the roles of OpenAI's messages in the family's published format; a family without a system
role (Gemma, Mistral) gets the system text at the top of the first user turn, as their own templates do.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_SYSTEM_INTO_FIRST_USER = (
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] + '\n\n' -%}{%- set messages = messages[1:] -%}"
    "{%- endif -%}"
)

# family -> (a token only that family's tokenizers have, the template)
FAMILY_TEMPLATES: dict[str, tuple[str, str]] = {
    "llama3": ("<|start_header_id|>",
               "{{ bos_token }}{% for m in messages %}"
               "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
               "{% endif %}"),
    "chatml": ("<|im_start|>",
               "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "gemma": ("<start_of_turn>",
              _SYSTEM_INTO_FIRST_USER + "{{ bos_token }}{% for m in messages %}"
              "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
              "{{ (ns.system if loop.first and m['role'] == 'user' else '') + m['content'] | trim }}"
              "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
              "{% endif %}"),
    "phi3": ("<|end|>",
             "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"),
    "mistral": ("[INST]",
                _SYSTEM_INTO_FIRST_USER + "{{ bos_token }}{% for m in messages %}"
                "{% if m['role'] == 'user' %}"
                "{{ '[INST] ' + (ns.system if loop.first else '') + m['content'] + ' [/INST]' }}"
                "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"),
}


def family_of(vocab: set[str] | dict[str, int]) -> str | None:
    """The family whose turn marker the tokenizer's vocabulary (special tokens included) holds, or None."""
    for family, (marker, _) in FAMILY_TEMPLATES.items():
        if marker in vocab:
            return family
    return None


def fallback_chat_template(tokenizer_json: str, model_name: str) -> str | None:
    """The family template for a tokenizer.json file (logged), or None (logged) where no family's markers are
    there: chat then needs a template of the user's, and completions work as before."""
    from tokenizers import Tokenizer

    family = family_of(Tokenizer.from_file(tokenizer_json).get_vocab(with_added_tokens=True))
    if family is None:
        log.warning("%s has no chat template and its tokenizer has no known family's turn markers: chat needs a "
                    "template (completions work)", model_name)
        return None
    log.info("%s has no chat template: using the %s family's, recognised by its tokenizer's %r token", model_name,
             family, FAMILY_TEMPLATES[family][0])
    return FAMILY_TEMPLATES[family][1]
