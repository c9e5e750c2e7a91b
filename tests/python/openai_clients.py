"""The openai Python client against `fmoe serve`: completions, chat and streaming of both.

Usage: openai_clients.py BASE_URL MODEL PROMPT_IDS(comma-separated) OUT.json

Writes what each call returned (texts, finish reasons, usage) to OUT.json for the Rust test
(crates/fmoe-cli/tests/serve_python.rs) to compare with the engine's own results; the client
itself raises on anything it cannot parse.
"""

import json
import sys

import openai


def main() -> None:
    base_url, model, ids, out_path = sys.argv[1:5]
    prompt_ids = [int(t) for t in ids.split(",")]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    out = {}

    r = client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=20, temperature=0, logprobs=2
    )
    out["completion"] = {
        "text": r.choices[0].text,
        "finish_reason": r.choices[0].finish_reason,
        "completion_tokens": r.usage.completion_tokens,
        "token_logprobs": r.choices[0].logprobs.token_logprobs,
    }

    pieces, finish, usage = [], None, None
    stream = client.completions.create(
        model=model,
        prompt=prompt_ids,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    out["completion_stream"] = {"text": "".join(pieces), "finish_reason": finish, "usage": usage, "chunks": len(pieces)}

    messages = [{"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    out["chat"] = {
        "text": r.choices[0].message.content,
        "role": r.choices[0].message.role,
        "finish_reason": r.choices[0].finish_reason,
        "prompt_tokens": r.usage.prompt_tokens,
    }

    pieces, finish = [], None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            finish = c.finish_reason or finish
    out["chat_stream"] = {"text": "".join(pieces), "finish_reason": finish}

    try:
        client.completions.create(model="no-such-model", prompt="a", max_tokens=1)
        out["bad_model"] = None
    except openai.BadRequestError as e:
        out["bad_model"] = {"status": e.status_code, "message": str(e)}

    models = client.models.list()
    out["models"] = [m.id for m in models.data]

    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
