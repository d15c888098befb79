"""Drive kvserve's prefix cache by hand on SmolLM2: the shape of building one's own scheduler.

Stream A prefills a ~60-token system prompt plus its question and donates its pages; the cache says
how much of stream B it already holds; B attaches those pages (shared KV cells, no copy) and
prefills only its tail. Run: python examples/prefix_cache_by_hand.py
"""

from __future__ import annotations

import numpy as np

from kvserve.cache import (
    attach, create_kv_pool, create_prefix_cache, insert, match_len, release, release_kv_pages,
)
from kvserve.config import embedded_model_path
from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.model import Model

SYSTEM = (
    "You are Atlas, a geography tutor. Answer in one short sentence, name the country and the "
    "continent, and never invent facts. If a question is not about geography, say so politely. "
    "Prefer well-known cities and keep a friendly tone."
)


def chat_tokens(model: Model, template: ChatTemplate, question: str) -> list[int]:
    text = template.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return model.tokenize(text, add_special=model.adds_bos, parse_special=True)


def greedy_reply(pool, session, logits: np.ndarray, model: Model, n: int = 24) -> str:
    out: list[int] = []
    for _ in range(n):
        token = int(np.argmax(logits))
        if model.is_eog(token):
            break
        out.append(token)
        logits = pool.eval(session, [token])
    return model.detokenize(out)


def main() -> None:
    model = Model(embedded_model_path())
    template = ChatTemplate.from_model(model)
    pool = create_kv_pool(model, page_rows=16, n_ctx=2048, n_seq_max=16)
    cache = create_prefix_cache(pool)

    prompt_a = chat_tokens(model, template, "Where is Lyon?")
    prompt_b = chat_tokens(model, template, "Where is Kyoto?")
    print(f"system prompt + question: A has {len(prompt_a)} tokens, B has {len(prompt_b)}")

    a = pool.new_session()
    reply_a = greedy_reply(pool, a, pool.eval(a, prompt_a), model)
    print(f"A prefilled {len(prompt_a)} tokens and answered: {reply_a!r}")
    chain = insert(pool, a, a.tokens, preview="Where is Lyon?")
    print(f"A donated {len(a.tokens)} evaluated tokens as chain {chain.id}: {cache.held_pages} full pages")

    print(f"the cache holds {match_len(pool, prompt_b)} of B's {len(prompt_b)} leading tokens")
    b = pool.new_session()
    attached = attach(pool, b, prompt_b)
    tail = prompt_b[attached:]
    reply_b = greedy_reply(pool, b, pool.eval(b, tail), model)
    print(f"B attached {attached} tokens, prefilled only {len(tail)}, and answered: {reply_b!r}")

    for entry in cache.chain_list():
        print("chain", entry)
    print(f"held pages: {cache.held_pages} ({cache.held_pages * pool.page_rows} KV cells), "
          f"cells in use: {pool.used_cells} of {pool.n_cells}")

    # Teardown, in order: sessions first (they borrow pages), then the cache, then the pool.
    release_kv_pages(pool, a)
    release_kv_pages(pool, b)
    release(pool)
    pool.close()
    model.close()
    print("released: sessions, cache, pool, model")


if __name__ == "__main__":
    main()
