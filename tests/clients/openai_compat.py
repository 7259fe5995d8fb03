"""The official `openai` Python client against warmpath routers, used as its documentation
shows. Run by the integration test `clients::the_official_openai_client_works_through_the_router`.

Usage: openai_compat.py OPEN_URL KEYED_URL

- OPEN_URL: a router started as the README's "Run a gateway" shows (no keys configured);
- KEYED_URL: a router whose tenant `acme` has the key `sk-acme` and a rate limit of one
  request per ten seconds, and whose tenant `ghost` (key `sk-ghost`) is served by the pool
  `dead-llama` whose one instance does not listen.

Each check prints one line; the first failure raises, which exits non-zero.
"""

import asyncio
import sys

import openai
from openai import AsyncOpenAI, OpenAI

MODEL = "sim-llama"


def words(seed, n):
    """n distinct words, a function of the seed: prompts long enough to fill cache blocks."""
    return " ".join(f"w{seed}x{i}" for i in range(n))


def check(name):
    print(f"ok: {name}", flush=True)


def cached(usage):
    details = usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def completions(client):
    prompt = words(1, 300)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert first.object == "text_completion", first
    assert first.choices[0].text, first
    assert first.usage.prompt_tokens >= 300 and first.usage.completion_tokens == 8, first.usage
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert cached(again.usage) > 0, f"the repeated prompt found nothing cached: {again.usage}"
    assert again.choices[0].text == first.choices[0].text
    check(f"completions, cached_tokens {cached(again.usage)} of {again.usage.prompt_tokens}")

    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == first.choices[0].text, (text, first.choices[0].text)
    assert usage is not None and cached(usage) > 0, usage
    check("streamed completions with usage")


def token_ids(client):
    ids = list(range(1000, 1400))
    first = client.completions.create(model=MODEL, prompt=ids, max_tokens=4)
    assert first.usage.prompt_tokens == len(ids), first.usage
    again = client.completions.create(model=MODEL, prompt=[ids], max_tokens=4)
    assert cached(again.usage) > 0, again.usage
    check(f"token-id prompts, cached_tokens {cached(again.usage)} of {len(ids)}")


def chat(client):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": words(2, 300)},
    ]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    assert first.object == "chat.completion", first
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content, first
    again = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=6
    )
    assert cached(again.usage) > 0, again.usage
    check(f"chat, cached_tokens {cached(again.usage)} of {again.usage.prompt_tokens}")

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == first.choices[0].message.content, (text, first)
    assert usage is not None and cached(usage) > 0, usage
    check("streamed chat with usage")


def structured_messages(client):
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": words(3, 200)},
                {"type": "text", "text": "What does the text above say?"},
            ],
        }
    ]
    first = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4)
    again = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4)
    assert first.choices[0].message.content
    assert cached(again.usage) > 0, again.usage
    check("content as a list of parts")

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    conversation = [
        {"role": "user", "content": words(4, 200) + " What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=tools, max_tokens=4
    )
    assert reply.choices[0].message.content
    again = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=tools, max_tokens=4
    )
    assert cached(again.usage) > 0, again.usage
    check("assistant tool calls with null content, and tool results")


def models(client):
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids, ids
    check(f"models.list: {ids}")


async def concurrent(url):
    client = AsyncOpenAI(base_url=url + "/v1", api_key="EMPTY")
    replies = await asyncio.gather(
        *(
            client.completions.create(model=MODEL, prompt=words(10 + i, 50), max_tokens=3)
            for i in range(16)
        )
    )
    assert all(r.choices[0].text for r in replies)
    await client.close()
    check("16 concurrent requests from AsyncOpenAI")


def expect(error, call):
    try:
        call()
    except error as e:
        assert isinstance(e.body, dict) and e.body.get("message"), e.body
        return e
    raise AssertionError(f"expected {error.__name__}")


def errors(open_url, keyed_url):
    client = OpenAI(base_url=open_url + "/v1", api_key="EMPTY", max_retries=0)
    e = expect(
        openai.NotFoundError,
        lambda: client.completions.create(model="no-such-model", prompt="hi", max_tokens=1),
    )
    check(f"unknown model: NotFoundError ({e.body['message']})")
    expect(
        openai.BadRequestError,
        lambda: client.completions.create(model=MODEL, prompt="", max_tokens=1),
    )
    expect(
        openai.BadRequestError,
        lambda: client.chat.completions.create(model=MODEL, messages=[], max_tokens=1),
    )
    check("empty prompt and empty messages: BadRequestError")

    wrong = OpenAI(base_url=keyed_url + "/v1", api_key="sk-wrong", max_retries=0)
    expect(
        openai.AuthenticationError,
        lambda: wrong.completions.create(model=MODEL, prompt="hi", max_tokens=1),
    )
    check("a wrong key: AuthenticationError")

    acme = OpenAI(base_url=keyed_url + "/v1", api_key="sk-acme", max_retries=0)
    call = lambda: acme.completions.create(model=MODEL, prompt="hi", max_tokens=1)  # noqa: E731
    limited = None
    for _ in range(5):
        try:
            call()
        except openai.RateLimitError as e:
            limited = e
            break
    assert limited is not None, "five requests at a 0.1 rps limit were all admitted"
    assert limited.response.headers.get("retry-after"), limited.response.headers
    check("over the rate limit: RateLimitError with retry-after")

    ghost = OpenAI(base_url=keyed_url + "/v1", api_key="sk-ghost", max_retries=0)
    expect(
        openai.InternalServerError,
        lambda: ghost.completions.create(model="dead-llama", prompt="hi", max_tokens=1),
    )
    check("no instance answers: InternalServerError (5xx)")


def main():
    open_url, keyed_url = sys.argv[1], sys.argv[2]
    print(f"openai {openai.__version__}", flush=True)
    # As vLLM's documentation shows: any key, since the README's gateway configures none.
    client = OpenAI(base_url=open_url + "/v1", api_key="EMPTY")
    models(client)
    completions(client)
    token_ids(client)
    chat(client)
    structured_messages(client)
    asyncio.run(concurrent(open_url))
    errors(open_url, keyed_url)
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
