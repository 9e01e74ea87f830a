"""Conversations into prompts, through the tokenizer's chat template (vLLM's `LLM.chat`).

A conversation is a list of {"role": ..., "content": str} messages. The template renders it to text,
which is tokenized without adding special tokens again: the template writes those it wants.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxrunner.checks import check_text

Conversation = list[dict]


def conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation or a list of them, each checked: ValueError naming what is wrong."""
    if isinstance(messages, dict) or not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts (or a list of such lists), got {messages!r:.80}")
    batch = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
    for i, conversation in enumerate(batch):
        if not isinstance(conversation, Sequence) or isinstance(conversation, str) or not conversation:
            raise ValueError(f"conversation {i} must be a non-empty list of messages, got {conversation!r:.80}")
        for message in conversation:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"each message must be a dict with a string 'role' and 'content', got {message!r:.80}")
            check_text("chat", "a message's role", message["role"])
            check_text("chat", "a message's content", message["content"])
    return batch


def render_chat(
    tokenizer,
    messages: Conversation | Sequence[Conversation],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[dict]:
    """One prompt ({"prompt", "prompt_token_ids"}) per conversation."""
    batch = conversations(messages)
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (the engine runs with skip_tokenizer_init)")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: pass chat_template=, or use generate() with plain prompts")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
    prompts = []
    if chat_template is not None:
        check_text("chat", "chat_template", chat_template)
    for conversation in batch:
        try:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            )
        except Exception as e:  # a template is code: any error it raises is this chat's, not the engine's
            raise ValueError(f"the chat template does not render: {type(e).__name__}: {str(e):.200}") from None
        check_text("chat", "the rendered chat", text)
        prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return prompts
