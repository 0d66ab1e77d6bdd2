"""Chat prompts are rendered with thinking off: a hybrid-thinking template (Qwen3's shape: an
empty <think></think> block when `enable_thinking` is false, nothing otherwise, so the model opens
its own think block) gets the switch from every task that renders a chat."""

import copy
import types

from harness.core import models
from tasks.longbench import chat_pieces
from tasks.prompts import PromptFormat

# Qwen3's rule, reduced: thinking unless the caller passes enable_thinking=false
HYBRID_THINKING = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
EMPTY_THINK = "<think>\n\n</think>\n\n"


def thinking_tokenizer(smollm2):
    tok = copy.deepcopy(smollm2[1])
    tok.chat_template = HYBRID_THINKING
    return tok


def test_every_chat_rendering_turns_thinking_off(smollm2):
    tok = thinking_tokenizer(smollm2)
    messages = [{"role": "user", "content": "Where is the key?"}]
    # the template really switches (so the assertions below can fail)
    assert not tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=True).endswith(EMPTY_THINK)
    assert models.chat_text(tok, messages).endswith(EMPTY_THINK)
    # RULER / multi-turn
    assert PromptFormat(tok, "chat").render("Where is the key?", " Answer:").endswith(
        EMPTY_THINK + "Answer:")
    # LongBench: the template's tokens after the user message
    engine = types.SimpleNamespace(tokenizer=tok,
                                   encode=lambda text, **kw: tok.encode(text, **kw))
    _, after = chat_pieces(engine)
    assert tok.decode(after).endswith(EMPTY_THINK)
