"""The assistant loss mask must cover exactly the replies plus their end-of-turn marker, for any chat template."""

import copy
import itertools

import pytest

from wingspan.data.conversations import Conversation, Message
from wingspan.data.template import TokenizedConversation, render_with_spans, tokenize_conversations
from wingspan.errors import DataError, ModelError

# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5-Instruct's chat_template (Qwen2 architecture): injects a default system prompt when there is none.
QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# DeepSeek-R1 style: earlier replies lose their reasoning, so the rendered content differs from the message.
REASONING_STRIPPING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
)

# Mistral-7B-Instruct-v0.3 (its chat template without the tool branches): the system prompt goes into the
# last user turn, and disappears when the last turn is the assistant's. This breaks the prefix property.
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the exception of an "
    "initial optional system message!') }}{%- endif %}{%- endfor %}"
)

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def with_template(tokenizer, template: str, special_tokens: tuple[str, ...] = ()):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_tokens(list(special_tokens), special_tokens=True)
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm2_tokenizer):
    # A Llama 3 tokenizer has these as special tokens; the SmolLM2 vocabulary stands in for the rest.
    tokenizer = with_template(
        smollm2_tokenizer,
        LLAMA3_TEMPLATE,
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    )
    tokenizer.bos_token = "<|begin_of_text|>"
    return tokenizer


def conversation(*turns: tuple[str, str]) -> Conversation:
    return Conversation([Message(role, content) for role, content in turns], id="c", source="test.jsonl:1")


MULTI_TURN = conversation(
    ("user", "What is 2 + 2?"),
    ("assistant", "2 + 2 = 4."),
    ("user", "And doubled, in words?"),
    ("assistant", "Eight.\nThat is all."),
)
WITH_SYSTEM = conversation(
    ("system", "Answer in French."),
    ("user", "Say hello."),
    ("assistant", "Bonjour !"),
    ("user", "Now goodbye."),
    ("assistant", "Au revoir."),
)


def masked_texts(tokenizer, record) -> list[str]:
    """Decode each contiguous run of masked tokens."""
    runs = itertools.groupby(zip(record.input_ids, record.loss_mask), key=lambda pair: pair[1])
    return [tokenizer.decode([token for token, _ in run]) for masked, run in runs if masked]


def replies(c: Conversation, end_of_turn: str, strip: bool = False) -> list[str]:
    return [(m.content.strip() if strip else m.content) + end_of_turn for m in c.messages if m.role == "assistant"]


def tokenize_one(tokenizer, c: Conversation, max_length: int) -> TokenizedConversation:
    records, report = tokenize_conversations(tokenizer, [c], max_length)
    assert report.skipped == 0
    return records[0]


def check(tokenizer, c: Conversation, end_of_turn: str, strip: bool = False):
    record = tokenize_one(tokenizer, c, max_length=4096)
    assert len(record.input_ids) == len(record.loss_mask)
    assert masked_texts(tokenizer, record) == replies(c, end_of_turn, strip)
    # The ids are exactly what the template yields when it tokenizes itself.
    assert record.input_ids == tokenizer.apply_chat_template(c.as_dicts(), tokenize=True, return_dict=False)
    return record


@pytest.mark.parametrize("c", [MULTI_TURN, WITH_SYSTEM], ids=["multi_turn", "system"])
def test_chatml_smollm2_own_template(smollm2_tokenizer, c):
    record = check(smollm2_tokenizer, c, "<|im_end|>")
    text = smollm2_tokenizer.decode(record.input_ids)
    # SmolLM2's template injects its own system prompt only when the conversation has none.
    assert (SMOLLM2_DEFAULT_SYSTEM in text) == (c.messages[0].role != "system")
    # The newline after <|im_end|> and the next header are outside the mask.
    end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, (token, masked) in enumerate(zip(record.input_ids, record.loss_mask)):
        if masked and token == end and i + 1 < len(record.input_ids):
            assert record.loss_mask[i + 1] == 0 and smollm2_tokenizer.decode(record.input_ids[i + 1]) == "\n"


@pytest.mark.parametrize("c", [MULTI_TURN, WITH_SYSTEM], ids=["multi_turn", "system"])
def test_llama3_template(llama3_tokenizer, c):
    check(llama3_tokenizer, c, "<|eot_id|>")


def test_llama3_template_trims_replies(llama3_tokenizer):
    padded = conversation(("user", "  hi  "), ("assistant", "\n  hello there \n"), ("user", "x"), ("assistant", " bye"))
    check(llama3_tokenizer, padded, "<|eot_id|>", strip=True)


@pytest.mark.parametrize("c", [MULTI_TURN, WITH_SYSTEM], ids=["multi_turn", "system"])
def test_qwen2_template(smollm2_tokenizer, c):
    tokenizer = with_template(smollm2_tokenizer, QWEN2_TEMPLATE)
    record = check(tokenizer, c, "<|im_end|>")
    assert (QWEN_DEFAULT_SYSTEM in tokenizer.decode(record.input_ids)) == (c.messages[0].role != "system")


def test_mistral_template_moves_or_drops_the_system_prompt(smollm2_tokenizer):
    tokenizer = with_template(smollm2_tokenizer, MISTRAL_TEMPLATE)  # eos_token is <|im_end|> here
    ends_with_user = conversation(*[(m.role, m.content) for m in WITH_SYSTEM.messages[:4]])
    record = tokenize_one(tokenizer, ends_with_user, max_length=4096)
    text = tokenizer.decode(record.input_ids)
    assert text.index("Bonjour") < text.index("Answer in French.")  # the system prompt comes after the reply
    # "[/INST] Bonjour": the template's space and the reply's first word are one token, which is masked.
    assert masked_texts(tokenizer, record) == [" Bonjour !<|im_end|>"]
    record = tokenize_one(tokenizer, WITH_SYSTEM, max_length=4096)
    assert masked_texts(tokenizer, record) == [" Bonjour !<|im_end|>", " Au revoir.<|im_end|>"]
    assert "Answer in French." not in tokenizer.decode(record.input_ids)


def test_template_that_rewrites_earlier_replies(smollm2_tokenizer):
    tokenizer = with_template(smollm2_tokenizer, REASONING_STRIPPING_TEMPLATE)
    c = conversation(
        ("user", "q1"),
        ("assistant", "<think>scratch</think>answer one"),
        ("user", "q2"),
        ("assistant", "<think>more</think>two"),
    )
    record = tokenize_one(tokenizer, c, max_length=4096)
    # The mask follows what the template renders: the reasoning it dropped is not trained on.
    assert masked_texts(tokenizer, record) == ["answer one<|im_end|>", "<think>more</think>two<|im_end|>"]


def test_reply_that_repeats_the_prompt_is_masked_in_its_own_turn(smollm2_tokenizer):
    c = conversation(("user", "echo"), ("assistant", "echo"), ("user", "echo echo"), ("assistant", "echo"))
    text, spans = render_with_spans(smollm2_tokenizer, c)
    assert [text[a:b] for a, b in spans] == ["echo<|im_end|>"] * 2
    assert text[: spans[0][0]].endswith("<|im_start|>assistant\n")
    assert text[: spans[1][0]].endswith("echo echo<|im_end|>\n<|im_start|>assistant\n")


def test_truncation_keeps_the_head_and_aligns_mask(smollm2_tokenizer):
    full = tokenize_one(smollm2_tokenizer, MULTI_TURN, max_length=4096)
    cut = len(full.input_ids) - 5
    record = tokenize_one(smollm2_tokenizer, MULTI_TURN, max_length=cut)
    assert record.input_ids == full.input_ids[:cut] and record.loss_mask == full.loss_mask[:cut]


def test_tokenize_conversations_counts_what_it_drops(smollm2_tokenizer):
    prompt_only = conversation(("user", "just a question"))
    long_prompt = conversation(("user", "word " * 200), ("assistant", "short"))
    records, report = tokenize_conversations(smollm2_tokenizer, [MULTI_TURN, prompt_only, long_prompt, WITH_SYSTEM], 64)
    assert len(records) == 2 and report.total == 4
    assert report.counts == {"no assistant token": 2}
    assert report.examples[0] == "test.jsonl:1: no assistant token in the first 64"
    assert all(len(r.input_ids) == len(r.loss_mask) <= 64 and any(r.loss_mask) for r in records)


def test_template_errors_are_counted_not_fatal(smollm2_tokenizer):
    # Gemma-style: the template refuses a system message.
    refusing = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + (smollm2_tokenizer.chat_template)
    )
    twice = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}|{% endif %}"
        "{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    records, report = tokenize_conversations(with_template(smollm2_tokenizer, refusing), [MULTI_TURN, WITH_SYSTEM], 512)
    assert len(records) == 1 and report.counts == {"chat template error": 1}
    assert "System role not supported" in report.examples[0] and report.examples[0].startswith("test.jsonl:1")
    records, report = tokenize_conversations(with_template(smollm2_tokenizer, twice), [MULTI_TURN, WITH_SYSTEM], 512)
    assert len(records) == 1 and report.counts == {"template rewrites contents": 1}
    assert "renders message 0 more than once" in report.examples[0]


def test_nothing_left_or_a_broken_template_is_an_error(smollm2_tokenizer):
    with pytest.raises(DataError, match=r"no conversation has an assistant token.*no assistant token: 1"):
        tokenize_conversations(smollm2_tokenizer, [conversation(("user", "only a prompt"))], 512)
    broken = with_template(smollm2_tokenizer, "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ModelError, match="the chat template does not parse: unexpected '}'"):
        tokenize_conversations(broken, [MULTI_TURN], 512)


def test_reasoning_is_learned_or_left_out_as_asked(smollm2_tokenizer):
    reply = "<think>\nThe user wants a number; 4 is even.\n</think>\n\nFour is even."
    c = conversation(
        ("user", "Name an even number."), ("assistant", reply), ("user", "Another?"), ("assistant", "Six.")
    )
    (learned,), _ = tokenize_conversations(smollm2_tokenizer, [c], 512)
    assert masked_texts(smollm2_tokenizer, learned) == [reply + "<|im_end|>", "Six.<|im_end|>"]
    (left_out,), _ = tokenize_conversations(smollm2_tokenizer, [c], 512, learn_reasoning=False)
    assert masked_texts(smollm2_tokenizer, left_out) == ["Four is even.<|im_end|>", "Six.<|im_end|>"]
    assert left_out.input_ids == learned.input_ids


def test_prompts_are_learned_when_asked(smollm2_tokenizer):
    (replies_only,), _ = tokenize_conversations(smollm2_tokenizer, [WITH_SYSTEM], 512)
    (whole,), _ = tokenize_conversations(smollm2_tokenizer, [WITH_SYSTEM], 512, learn_prompts=True)
    assert whole.input_ids == replies_only.input_ids
    assert all(whole.loss_mask) and not all(replies_only.loss_mask)
    assert masked_texts(smollm2_tokenizer, whole) == [smollm2_tokenizer.decode(whole.input_ids)]
    reply = "<think>\nGreet.\n</think>\n\nBonjour !"
    thinking = conversation(("user", "Say hello."), ("assistant", reply))
    (record,), _ = tokenize_conversations(smollm2_tokenizer, [thinking], 512, learn_reasoning=False, learn_prompts=True)
    (learned_text,) = masked_texts(smollm2_tokenizer, record)[:1]
    assert "Say hello." in learned_text and "Greet." not in "".join(masked_texts(smollm2_tokenizer, record))


def test_chat_template_file_and_variables(smollm2_tokenizer, tmp_path):
    from wingspan.data.template import chat_prompt, set_chat_template
    from wingspan.errors import ConfigError

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ModelError, match="no chat template .*chat_template=PATH"):
        tokenize_conversations(tokenizer, [MULTI_TURN], 512)
    with pytest.raises(ModelError, match="no chat template"):
        chat_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    # Qwen3's switch, in a template that reads it the way Qwen3's does.
    template = tmp_path / "thinking.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    set_chat_template(tokenizer, str(template))
    messages = [{"role": "user", "content": "hi"}]
    assert not tokenizer.decode(chat_prompt(tokenizer, messages)).endswith("</think>\n\n")
    set_chat_template(tokenizer, variables={"enable_thinking": False})
    assert tokenizer.decode(chat_prompt(tokenizer, messages)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    check(tokenizer, MULTI_TURN, "<|im_end|>")  # the mask is unchanged by the variables
    with pytest.raises(ConfigError, match="cannot read"):
        set_chat_template(tokenizer, str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="not template variable names"):
        set_chat_template(tokenizer, variables={"enable-thinking": False})


def test_tokenize_conversations_matches_one_at_a_time(smollm2_tokenizer):
    many = [
        conversation(
            ("user", f"Question {i}: " + "why? " * (i % 50)), ("assistant", f"Answer {i}. " + "because " * (i % 300))
        )
        for i in range(2000)
    ]
    records, report = tokenize_conversations(smollm2_tokenizer, many, max_length=2048)
    assert report.skipped == 0 and len(records) == len(many)
    for i in (0, 777, 1999):
        one = tokenize_one(smollm2_tokenizer, many[i], max_length=2048)
        assert (records[i].input_ids, records[i].loss_mask) == (one.input_ids, one.loss_mask)
