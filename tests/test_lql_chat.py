"""Chat templates: lql.chat renders the Jinja subset model templates use exactly as Hugging
Face's chat-template compiler does (the oracle: transformers 5.24.0), refuses what it does not
implement by name, and INFER ... CHAT on the default instruct model feeds it the same ids as
transformers' apply_chat_template."""

from __future__ import annotations

import importlib.util

import lql_fixtures  # noqa: F401
import pytest

from lql import chat

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
INST = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + message['content'] | trim + ' [/INST]' }}
    {%- elif message.role == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""
BLOCKS = """{% set sys = 'Be brief.' %}
{% for m in messages %}
  <{{ m.role }}>{{ m.content }}{% if not loop.last %}|{% endif %}
    {# a comment #}
{% endfor %}
{% if add_generation_prompt is defined and add_generation_prompt %}<assistant>{% endif %}{{ sys ~ ' ' ~ messages|length }}"""

CONVERSATIONS = [
    [{"role": "user", "content": "  What is 2+2?  "}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


def _oracle():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("SKIPPED LOUDLY: transformers (the oracle) is not installed; run scripts/test")
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template


@pytest.mark.parametrize("template", [SMOLLM2, INST, BLOCKS], ids=["chatml", "inst", "blocks"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "turns"])
@pytest.mark.parametrize("gen", [True, False])
def test_renders_as_hugging_face_does(template, messages, gen):
    compile_ = _oracle()
    kw = {"add_generation_prompt": gen, "bos_token": "<s>", "eos_token": "</s>"}
    if template is INST and messages[0]["role"] == "system":
        with pytest.raises(chat.ChatTemplateError, match="Only user and assistant roles"):
            chat.render(template, messages, **kw)
        return
    assert chat.render(template, messages, **kw) == compile_(template).render(messages=messages, **kw)


@pytest.mark.parametrize("template,needle", [
    ("{% macro m() %}x{% endmacro %}", "{% macro %}"),
    ("{{ messages | tojson }}", "'|tojson'"),
    ("{% for m in messages %}{{ m.content.upper() }}{% endfor %}", "calls a function"),
    ("{{ x is mapping }}", "'is mapping'"),
])
def test_what_is_not_implemented_is_refused_by_name(template, needle):
    with pytest.raises(chat.ChatTemplateError) as e:
        chat.render(template, [{"role": "user", "content": "x"}])
    assert needle in str(e.value)


@pytest.mark.slow
def test_chat_on_the_default_model_feeds_the_ids_transformers_would(smollm2_gguf, smollm2_container):
    """The ids INFER ... CHAT runs equal apply_chat_template on the same GGUF in transformers;
    the instruct model then answers and stops at its end-of-sequence token."""
    _oracle()
    from transformers import AutoTokenizer

    import lql

    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    question = "What is the capital of France?"
    want = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True)
    want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
    s = lql.connect(smollm2_container)
    r = s.execute_one(f"INFER '{question}' CHAT GENERATE 30")
    assert r.prompt.ids == want
    assert r.stopped_at is not None and "Paris" in r.generated_text
