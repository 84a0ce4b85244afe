"""Chat templates a deployment can name when its model ships none (``--chat-template``).

A GGUF file need not carry a chat template (Gemma 3 270M's does not), and a model without one can only
be sent plain text. Rather than guess, the coordinator renders chat with the template its operator
names: one of ``NAMED`` here, or a Jinja file in the Hugging Face chat-template convention
(``messages``, ``add_generation_prompt``, ``bos_token``). Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path

# The turn formats of common instruction-tuned families, written for this project.
NAMED = {
    # ChatML: Qwen, SmolLM and many fine-tunes.
    "chatml": (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Gemma: user and model turns; a system message has no turn of its own and opens the first user turn.
    "gemma": (
        "{{ bos_token }}{% set system = namespace(text='') %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% set system.text = message['content'] | trim + '\n\n' %}"
        "{% else %}{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
        "<start_of_turn>{{ role }}\n{% if role == 'user' %}{{ system.text }}{% set system.text = '' %}{% endif %}"
        "{{ message['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
}


def resolve_chat_template(spec: str) -> str:
    """The Jinja text of ``--chat-template``: a name in ``NAMED``, or a file holding a template.

    Raises ValueError naming both kinds when ``spec`` is neither.
    """
    if spec in NAMED:
        return NAMED[spec]
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(f"chat template {spec!r} is neither a named one ({', '.join(sorted(NAMED))}) nor a file")
